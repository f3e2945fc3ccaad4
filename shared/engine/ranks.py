"""Rank processes for one engine instance: started together, joined by a gloo group, watched, stopped together.

Rank 0 is the engine's own process; `RankGroup` starts ranks 1..world-1 (spawned, so no state leaks from the
parent), each of which runs `target(pg, rank, world, *args)` once the group is joined. The parent's tensors in
`args` (weights, pages) reach the ranks through shared memory (torch.multiprocessing's pickling).

A rank that dies ends the group: the watcher kills the others (so no rank waits on a dead peer), names the
rank in `lost` and calls `on_lost`; an exchange in flight then fails with `RanksLost` carrying that name. A rank
dies with rank 0 (PR_SET_PDEATHSIG). Used by pipeline-parallel prefill (shared/engine/pipeline.py) and
context-parallel decode (shared/engine/context_parallel.py).
"""

from __future__ import annotations

import ctypes
import math
import datetime
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from shared.logging import get_logger

log = get_logger("engine.ranks")

STOP, STEP = 0, 1          # a rank message header's op
JOIN_TIMEOUT_S = 120.0     # how long ranks may take to start and join the group
OP_TIMEOUT_S = 600.0       # a send or receive that waits this long fails (a live peer answers within a step)


class RanksLost(RuntimeError):
    """A rank of the instance exited: its group can run no more steps."""


def shared_storage(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor in shared memory that a rank process can map (passed to it as an argument); its pages are
    zero until first written, like allocate_pages' calloc."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype).set_(torch.UntypedStorage._new_shared(nbytes)).view(shape)


def header(op: int, nbytes: int, rows: int) -> torch.Tensor:
    """What every message from rank 0 starts with: its op (STEP or STOP), the plan's bytes and the step's rows."""
    return torch.tensor([op, nbytes, rows], dtype=torch.int64)


def wait_all(works: list) -> None:
    """Waits for the gloo works in a list (other entries, the tensors they send, are kept alive by it)."""
    for w in works:
        if hasattr(w, "wait"):
            w.wait()


class RankGroup:
    def __init__(self, kind: str, world: int, target: Callable, args_of: Callable[[int], tuple], threads: int = 0):
        self.kind, self.world = kind, world
        self.lost: str | None = None
        self.on_lost: list[Callable[[str], None]] = []
        self._closing = False
        self._lost_named = threading.Event()
        self._loss_tasks: set = set()
        self.threads = threads or max(1, (os.cpu_count() or 1) // world)
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S),
                              wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self.procs = []
        for r in range(1, world):
            p = ctx.Process(target=_rank_entry, name=f"{kind}-rank-{r}", daemon=True,
                            args=(target, r, world, store.port, self.threads, os.getpid(), args_of(r)))
            p.start()
            self.procs.append(p)
        self._store = store
        try:
            self.pg = dist.ProcessGroupGloo(store, 0, world, datetime.timedelta(seconds=OP_TIMEOUT_S))
        except Exception:
            self._kill_all()
            raise
        self._stop_r, self._stop_w = os.pipe()
        threading.Thread(target=self._watch, name=f"{kind}-watch", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [os.getpid()] + [p.pid for p in self.procs]

    def alive(self) -> list[bool]:
        return [True] + [p.is_alive() for p in self.procs]

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        waiting = {p.sentinel: p for p in self.procs}
        while waiting:
            ready = wait(list(waiting) + [self._stop_r])
            if self._stop_r in ready:
                return
            for s in ready:
                p = waiting.pop(s)
                p.join(1.0)  # the sentinel fires before the exit code is collected
                if not self._closing and self.lost is None:
                    self._lose(f"{self.kind} rank {self.procs.index(p) + 1} (pid {p.pid}) exited with code {p.exitcode}")

    def _lose(self, reason: str) -> None:
        self.lost = reason
        self._lost_named.set()
        log.error("rank lost: the instance's ranks stop", reason=reason)
        self._kill_all()  # no rank then waits on a dead peer: every pending send and receive fails
        for cb in list(self.on_lost):
            try:
                cb(reason)
            except Exception:
                log.exception("on_lost callback failed")

    def call_on_loss(self, loop, handler: Callable[[str], object]) -> None:
        """Run coroutine function `handler(reason)` on `loop` once a rank is lost (at once if one already is)."""
        def start(reason: str) -> None:
            task = loop.create_task(handler(reason))  # held until it ends: the loop keeps only weak references
            self._loss_tasks.add(task)
            task.add_done_callback(self._loss_tasks.discard)

        def schedule(reason: str) -> None:
            loop.call_soon_threadsafe(start, reason)
        self.on_lost.append(schedule)
        if self.lost is not None:
            schedule(self.lost)

    def check(self) -> None:
        if self.lost is not None:
            raise RanksLost(self.lost)

    def failed(self, e: BaseException) -> RanksLost:
        """The error for an exchange that raised: a peer gone, named by the watcher (it sees the exit within
        milliseconds of the socket closing)."""
        self._lost_named.wait(1.0)
        return RanksLost(self.lost or f"{self.kind} exchange failed: {e}")

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()

    def close(self, say_stop: Callable[[], None] | None = None) -> None:
        """Stops every rank: `say_stop` (a STOP message the ranks act on), then a kill for any that lingers."""
        if self._closing:
            return
        self._closing = True
        os.write(self._stop_w, b"x")
        if self.lost is None and say_stop is not None:
            try:
                say_stop()
            except Exception:
                pass
        for p in self.procs:
            p.join(5.0 / len(self.procs))
        self._kill_all()
        for p in self.procs:
            p.join(1.0)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _rank_entry(target: Callable, rank: int, world: int, port: int, threads: int, parent: int, args: tuple) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the instance's process to act on
    if os.getppid() != parent:  # rank 0 died before the death signal was set
        os._exit(1)
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    pg = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=OP_TIMEOUT_S))
    target(pg, rank, world, *args)
