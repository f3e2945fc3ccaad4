"""First touch of fresh KV pages, off the critical path: `prefault` faults blocks in without changing a byte.

Not a copy kernel (no C of its own: one libc call, madvise), but its callers are the copy kernels' (decode
landing a handoff, the page warmer), so it lives beside them.
"""

from __future__ import annotations

import ctypes
import os

import torch

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
