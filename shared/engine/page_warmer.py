"""Keep the KV blocks the engine will hand out next resident, ahead of need, at idle CPU priority.

KV pages come from calloc (shared/kv_layout.py), so start-up commits nothing and a block nobody has
written yet is not in memory: the first write into it (a prefill's compute, a restore's unpack, a
handoff's scatter) pays about one page fault per 4 KiB. Measured on a 2-core VM: 8 MB of fresh blocks
cost 25-40 ms to fault in, against ~3 ms to write once resident, and a fresh system hands out fresh
blocks for every request until the pool has been used once (the prefix cache keeps released blocks).

The block manager hands out never-used blocks in increasing id order (its plain free list starts as
0..n-1, released blocks join it behind them). So "what comes next" is a frontier: after blocks up to id
`top` were allocated, blocks [top + 1, top + 1 + ahead) come next. A daemon thread at nice 19 keeps
that window resident (`kernels.cpu_prefault.prefault`: MADV_POPULATE_WRITE, no byte changes, so it may race
anything), in steps of `step_bytes`, and sleeps on a condition until the frontier moves. Memory is
committed only `ahead` blocks beyond what has been used, never the whole pool up front.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable

import torch

from kernels.cpu_prefault import prefault
from shared.logging import get_logger

log = get_logger("engine.page_warmer")


class _Window:
    """What the warmer thread shares with the engine: blocks [0, warmed) are resident, [0, wanted) should be."""

    def __init__(self, wanted: int):
        self.cond = threading.Condition()
        self.warmed, self.wanted, self.closed = 0, wanted, False

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


class PageWarmer:
    def __init__(self, pages: list[torch.Tensor], ahead_blocks: int, step_bytes: int = 16 << 20):
        pages = [p for p in pages if p.device.type == "cpu" and p.is_contiguous()]
        self.num_blocks = pages[0].shape[0] if pages else 0
        self.ahead = max(0, min(ahead_blocks, self.num_blocks))
        block_bytes = sum(p[0].numel() * p.element_size() for p in pages) or 1
        self._w = _Window(self.ahead)
        self._thread: threading.Thread | None = None
        if pages and self.ahead:
            # The thread holds the pages weakly: an engine dropped without close() frees its KV, and the
            # finalizer stops the thread.
            self._thread = threading.Thread(target=_warm, name="kv-page-warmer", daemon=True, args=(
                self._w, [weakref.ref(p) for p in pages], self.num_blocks, max(1, step_bytes // block_bytes)))
            self._thread.start()
            weakref.finalize(self, self._w.close)

    @property
    def wanted(self) -> int:
        return self._w.wanted

    @property
    def warmed(self) -> int:
        return self._w.warmed

    def allocated(self, block_ids: Iterable[int]) -> None:
        """The block manager handed these out: move the window past the highest."""
        if self._thread is None:
            return
        want = min(self.num_blocks, max(block_ids, default=-1) + 1 + self.ahead)
        if want > self._w.wanted:
            with self._w.cond:
                self._w.wanted = max(self._w.wanted, want)
                self._w.cond.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        self._w.close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Tests: True once everything wanted so far is resident (or the warmer stopped)."""
        w = self._w
        with w.cond:
            return w.cond.wait_for(lambda: w.closed or w.warmed >= w.wanted, timeout)


def _warm(w: _Window, page_refs: list, num_blocks: int, step_blocks: int) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
    except (OSError, AttributeError):
        pass
    while True:
        with w.cond:
            w.cond.wait_for(lambda: w.closed or w.warmed < w.wanted)
            if w.closed:
                return
            lo, hi = w.warmed, min(w.wanted, w.warmed + step_blocks)
        pages = [r() for r in page_refs]
        if any(p is None for p in pages):
            return w.close()
        ok = all(prefault(p, list(range(lo, hi))) for p in pages)
        del pages
        with w.cond:
            if not ok:  # not Linux >= 5.14: nothing to gain, stop trying
                log.info("kv page warmer off: MADV_POPULATE_WRITE unavailable")
                w.warmed, w.closed = num_blocks, True
            else:
                w.warmed = hi
            w.cond.notify_all()
            if w.warmed >= num_blocks:  # the whole pool is resident: nothing left to do, ever
                w.closed = True
                return
