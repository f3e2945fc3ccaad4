"""Drives an Engine from asyncio: steps run in one worker thread, everything else on the event loop.

Invariant: engine state (requests, block manager) is only mutated on the event loop *between* steps,
through `call`; the worker thread only runs `engine.step()`. Bulk reads and writes of pages owned by a
handoff (gather, scatter) may run in other threads: those blocks belong to no running sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from shared.engine.engine import Engine, StepOutput
from shared.logging import get_logger

log = get_logger("engine.loop")


class EngineLoop:
    def __init__(self, engine: Engine, on_outputs: Callable[[list[StepOutput]], Awaitable[None]],
                 idle_wait_s: float = 0.05):
        self.engine = engine
        self.on_outputs = on_outputs
        self.idle_wait_s = idle_wait_s
        self._pending: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._task: asyncio.Task | None = None
        self.steps = 0

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the event loop between two steps; returns its result or raises its error."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((fn, fut))
        self._wake.set()
        return await fut

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for fn, fut in pending:
            try:
                result = fn()
            except Exception as e:
                if not fut.done():
                    fut.set_exception(e)
            else:
                if not fut.done():
                    fut.set_result(result)

    async def run_in_worker(self, fn: Callable[[], Any]) -> Any:
        """Bulk tensor work (gather/scatter) off the event loop, beside the engine thread."""
        return await asyncio.to_thread(fn)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._apply_pending()
        self._executor.shutdown(wait=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            self._apply_pending()
            if self.engine.has_unfinished() and not self._pending:
                try:
                    outputs = await loop.run_in_executor(self._executor, self.engine.step)
                except Exception:
                    log.exception("engine step failed")
                    raise
                self.steps += 1
                if outputs:
                    await self.on_outputs(outputs)
                if not self.engine.stalled:
                    continue
            # idle, or stalled until some other owner releases blocks: wait for a call or a timeout
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.idle_wait_s if self.engine.stalled else None)
