"""Keep the KV blocks the engine will hand out next resident, ahead of need, at idle CPU priority.

KV pages come from calloc (shared/kv_layout.py), so start-up commits nothing and a block nobody has
written yet is not in memory: the first write into it (a prefill's compute, a restore's unpack, a
handoff's scatter) pays about one page fault per 4 KiB. Measured on a 2-core VM: 8 MB of fresh blocks
cost 25-40 ms to fault in, against ~3 ms to write once resident, and a fresh system hands out fresh
blocks for every request until the pool has been used once (the prefix cache keeps released blocks).

The block manager hands out never-used blocks in increasing id order (its plain free list starts as
0..n-1, released blocks join it behind them). So "what comes next" is a frontier: after blocks up to id
`top` were allocated, blocks [top + 1, top + 1 + ahead) come next. A native thread at nice 19
(`kernels.cpu_prefault.Warmer`) keeps that window resident in steps of `step_bytes`, faulting each page in
by an atomic add of 0 (no byte changes, so it may race anything), and sleeps until the frontier moves.
Memory is committed only `ahead` blocks beyond what has been used, never the whole pool up front.

It takes neither the GIL nor the process's mmap lock. It used to be a Python thread calling
madvise(MADV_POPULATE_WRITE) at nice 19: on a host busy with other work the scheduler left it off the CPU
while it held the mmap lock, and the engine stalled behind it (kernels/csrc/page_warmer.c has the numbers;
bench/busy_host.py measures it). Without a C compiler there is no warmer: first writes fault pages in, as
with `engine.kv_warm_ahead = 0`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from kernels.cpu_prefault import Warmer
from shared.logging import get_logger

log = get_logger("engine.page_warmer")


class PageWarmer:
    def __init__(self, pages: list[torch.Tensor], ahead_blocks: int, step_bytes: int = 16 << 20):
        pages = [p for p in pages if p.device.type == "cpu" and p.is_contiguous()]
        self.num_blocks = pages[0].shape[0] if pages else 0
        self.ahead = max(0, min(ahead_blocks, self.num_blocks))
        block_bytes = sum(p[0].numel() * p.element_size() for p in pages) or 1
        self._warmer: Warmer | None = None
        self._wanted = self.ahead
        if pages and self.ahead:
            try:
                self._warmer = Warmer(pages, self.num_blocks, max(1, step_bytes // block_bytes), self.ahead)
            except (RuntimeError, OSError) as e:
                log.info("kv page warmer off", reason=str(e))
            else:
                # The pages stay alive while the thread may touch them: this object holds them, and dropping
                # it (an engine dropped without close) stops and joins the thread before they can go.
                self._pages = pages
                self._stopper = weakref.finalize(self, self._warmer.stop)

    @property
    def running(self) -> bool:
        return self._warmer is not None and not self._warmer.state()[2]

    @property
    def wanted(self) -> int:
        return self._warmer.state()[1] if self._warmer is not None else 0

    @property
    def warmed(self) -> int:
        return self._warmer.state()[0] if self._warmer is not None else 0

    def allocated(self, block_ids: Iterable[int]) -> None:
        """The block manager handed these out: move the window past the highest."""
        if self._warmer is None:
            return
        want = min(self.num_blocks, max(block_ids, default=-1) + 1 + self.ahead)
        if want > self._wanted:  # the C call only when the frontier moves
            self._wanted = want
            self._warmer.want(want)

    def close(self) -> None:
        if self._warmer is not None:
            self._stopper()  # stops and joins once, here or at collection

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Tests: True once everything wanted so far is resident (or the warmer stopped)."""
        if self._warmer is None:
            return True
        return self._warmer.wait(timeout)
