"""First touch of fresh KV pages, off the critical path: `prefault` faults blocks in without changing a byte.

`prefault` is one libc call, madvise, for a caller's own thread (decode landing a handoff). `Warmer` is the
page warmer's thread (shared/engine/page_warmer.py): native, at nice 19, faulting pages in by touch, never
holding the GIL or the mmap lock (kernels/csrc/page_warmer.c says why), built like the copy kernels
(kernels/cbuild.py).
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from kernels.cbuild import BASE_FLAGS, CSRC, CKernel

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in, writable, without changing their bytes
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# One madvise call holds the process's mmap lock (read) for the whole range it populates, and any mmap,
# munmap or thread start in the process (torch's large temporaries, a new worker thread) waits for that
# lock while every later page fault of every thread queues behind the waiting writer: the whole process
# stops. Populating costs ~2.8 ms per MiB on these VMs (fresh pages are zeroed), so one 16 MiB call from
# the nice-19 page warmer on a saturated host held the lock for seconds and froze prefill (and its load
# reports) for 2-5 s. Each call covers at most this much: a writer waits for one piece at most.
POPULATE_PIECE_BYTES = 256 << 10
_libc: list = []


def prefault(pages: torch.Tensor, block_ids: list[int]) -> bool:
    """Fault in the memory of `block_ids` of a CPU page tensor now, without changing a byte.

    KV pages come from calloc (shared/kv_layout.py): a block nobody has written yet is not in memory,
    and the first write into it pays ~1 page fault per 4 KiB (measured: a scatter of 8 MB into fresh
    blocks 30-150 ms, into touched ones 3 ms). Decode calls this for a landing's blocks while the bytes
    are still on the wire. Cheap when already resident (~0.2 ms per 8 MB). False when it cannot (not
    Linux >= 5.14, not a contiguous CPU tensor): nothing happens then, the first write faults the pages
    in as before. (Transparent huge pages would make first touch ~30x cheaper, but with THP defrag in
    "madvise" mode a fault may compact memory synchronously: 0.6 s measured once here, so not used.)
    """
    if pages.device.type != "cpu" or not pages.is_contiguous() or not block_ids:
        return False
    if not _libc:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            _libc.append(libc)
        except (OSError, AttributeError):
            _libc.append(None)
    libc = _libc[0]
    if libc is None:
        return False
    base, block_bytes = pages.data_ptr(), pages[0].numel() * pages.element_size()
    ids = sorted(set(block_ids))
    runs, start, prev = [], ids[0], ids[0]
    for b in ids[1:]:
        if b != prev + 1:
            runs.append((start, prev + 1))
            start = b
        prev = b
    runs.append((start, prev + 1))
    for lo, hi in runs:
        a, z = base + lo * block_bytes, base + hi * block_bytes
        a -= a % _PAGE  # madvise wants a page-aligned start; the page before is part of the pool or its header
        for start in range(a, z, POPULATE_PIECE_BYTES):  # pieces: see POPULATE_PIECE_BYTES
            if libc.madvise(start, min(z, start + POPULATE_PIECE_BYTES) - start, _MADV_POPULATE_WRITE) != 0:
                return False
    return True


_P, _I64 = ctypes.c_void_p, ctypes.c_int64
WARMER = CKernel("page_warmer", CSRC / "page_warmer.c", "moorage_warmer_start",
                 [ctypes.c_int, _P, _P, _I64, _I64, _I64, _I64, _P], [["-pthread"]],
                 base_flags=list(BASE_FLAGS), what="KV page warmer",
                 more={"moorage_warmer_want": [_P, _I64], "moorage_warmer_state": [_P, _P],
                       "moorage_warmer_wait": [_P, _I64], "moorage_warmer_stop": [_P]})


class Warmer:
    """A native thread at nice 19 keeping blocks [0, wanted) of CPU page tensors resident and writable
    (without changing a byte), in steps of `step_blocks`. The caller keeps the tensors alive until `stop()` returns.
    RuntimeError when the C library cannot be built (no compiler)."""

    def __init__(self, pages: list[torch.Tensor], num_blocks: int, step_blocks: int, wanted: int):
        start = WARMER.load()
        n = len(pages)
        bases = (ctypes.c_uint64 * n)(*[p.data_ptr() for p in pages])
        block_bytes = (ctypes.c_int64 * n)(*[p[0].numel() * p.element_size() for p in pages])
        handle = ctypes.c_void_p()
        rc = start(n, bases, block_bytes, num_blocks, step_blocks, POPULATE_PIECE_BYTES, wanted, ctypes.byref(handle))
        if rc != 0:
            raise OSError(rc, f"starting the page warmer: {os.strerror(rc)}")
        self._handle, self._lock = handle.value, threading.Lock()  # the lock: no call after stop() freed it

    def _call(self, name: str, *args) -> int | None:
        with self._lock:
            return None if self._handle is None else WARMER.symbol_fn(name)(self._handle, *args)

    def want(self, wanted: int) -> None:
        self._call("moorage_warmer_want", wanted)

    def state(self) -> tuple[int, int, bool]:
        """(warmed, wanted, ended)."""
        out = (ctypes.c_int64 * 3)()
        if self._call("moorage_warmer_state", out) is None:
            return 0, 0, True
        return out[0], out[1], bool(out[2])

    def wait(self, timeout_s: float) -> bool:
        """True once everything wanted so far is resident, or the thread ended (tests)."""
        return self._call("moorage_warmer_wait", int(timeout_s * 1000)) != 0

    def stop(self) -> None:
        """Ends the thread (within one piece) and frees it; idempotent."""
        with self._lock:
            if self._handle is not None:
                WARMER.symbol_fn("moorage_warmer_stop")(self._handle)
                self._handle = None
