"""Drives an Engine from asyncio: steps run in one worker thread, everything else on the event loop.

Invariant: engine state (requests, block manager) is only mutated on the event loop, through `call`
(between two steps: anything, aborts of running requests included) or `call_now` (at once, under the
engine's lock, even while a step's forward pass runs: only changes that touch no running sequence, such
as queueing a request or pinning, restoring and releasing blocks no running sequence owns). The worker
thread only runs `engine.step()`. Bulk reads and writes of pages owned by a handoff (gather, scatter) may
run in other threads: those blocks belong to no running sequence.

Failures: a step that raises StepFailed fails only its requests (`on_failed`) and the loop goes on, as does
a request whose grammar refused its token (`Engine.take_guide_failures`);
any other error marks the loop dead (`dead_reason`). A step running longer than `stall_after_s` makes
the loop unhealthy while it lasts. Services report `unhealthy_reason` as not ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from shared.engine.engine import Engine, StepFailed, StepOutput
from shared.logging import get_logger
from shared.threads import started_executor

log = get_logger("engine.loop")

OnFailed = Callable[[list[str], str], Awaitable[None]]  # (request ids, message for the client)


class EngineLoopDead(RuntimeError):
    """The loop stopped for good: nothing more runs on this engine."""


class EngineLoop:
    def __init__(self, engine: Engine, on_outputs: Callable[[list[StepOutput]], Awaitable[None]],
                 idle_wait_s: float = 0.05, on_failed: OnFailed | None = None, stall_after_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_prefill_ending: Callable[[list[str]], None] | None = None):
        self.engine = engine
        self.on_outputs = on_outputs
        self.on_failed = on_failed
        self.on_prefill_ending = on_prefill_ending  # on the event loop: see Engine.on_prefill_ending
        self.idle_wait_s = idle_wait_s
        self.stall_after_s = stall_after_s
        self.clock = clock
        self.dead_reason: str | None = None
        self.failed_steps = 0
        self._step_started: float | None = None  # clock() when the running step began
        self._pending: list[tuple[Callable[[], Any], asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()  # set (and replaced) whenever engine state may have changed
        self._executor = started_executor(1, "engine")  # started now, not at the first step (shared/threads.py)
        self._task: asyncio.Task | None = None
        self.steps = 0

    @property
    def unhealthy_reason(self) -> str | None:
        """Why this loop cannot serve now (dead, or one step running too long), else None."""
        if self.dead_reason is not None:
            return f"engine loop dead: {self.dead_reason}"
        started = self._step_started
        elapsed = 0.0 if started is None else self.clock() - started
        if elapsed > self.stall_after_s:
            return f"engine step running for {elapsed:.0f} s (stall_after_s={self.stall_after_s:g})"
        return None

    @property
    def healthy(self) -> bool:
        return self.unhealthy_reason is None

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the event loop between two steps; returns its result or raises its error
        (EngineLoopDead once the loop has died)."""
        if self.dead_reason is not None:
            raise EngineLoopDead(self.dead_reason)
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((fn, fut))
        self._wake.set()
        return await fut

    async def call_now(self, fn: Callable[[], Any]) -> Any:
        """Run fn() now, without waiting for the running step to end (a step of a long prompt may take
        seconds): for changes that touch no running sequence (see the module's invariant). The engine's
        lock keeps fn out of the step's own bookkeeping, which lasts milliseconds."""
        if self.dead_reason is not None:
            raise EngineLoopDead(self.dead_reason)
        with self.engine.lock:
            result = fn()
        self._wake.set()  # an idle loop has work now
        self._pulse()
        return result

    def pulse(self) -> None:
        """Wake what waits in `changed` (state outside the engine that they also watch has changed)."""
        self._pulse()

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def changed(self, timeout: float) -> bool:
        """Wait until engine state may have changed (a step ended, a call ran: blocks may be free now),
        at most `timeout` seconds; False on timeout. Waiters re-check their own condition."""
        if timeout <= 0:
            return False
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

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
        if pending:
            self._pulse()

    async def run_in_worker(self, fn: Callable[[], Any]) -> Any:
        """Bulk tensor work (gather/scatter) off the event loop, beside the engine thread."""
        return await asyncio.to_thread(fn)

    def start(self) -> None:
        if self.on_prefill_ending is not None:  # the engine calls it from the stepping thread: hop to the loop
            loop, listener = asyncio.get_running_loop(), self.on_prefill_ending
            self.engine.on_prefill_ending = lambda ids: loop.call_soon_threadsafe(listener, ids)
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._apply_pending()
        self._executor.shutdown(wait=True)

    async def _run(self) -> None:
        try:
            await self._serve()
        except Exception as e:
            self.dead_reason = f"{type(e).__name__}: {e}"
            log.exception("engine loop died", error=self.dead_reason)
            await self._after_death()

    async def _after_death(self) -> None:
        """Fail queued calls and the engine's requests: nothing will ever answer them."""
        pending, self._pending = self._pending, []
        for _, fut in pending:
            if not fut.done():
                fut.set_exception(EngineLoopDead(self.dead_reason))
        with contextlib.suppress(Exception):
            await self._report_failed(list(self.engine.sequences), f"engine failed: {self.dead_reason}")

    async def _report_failed(self, request_ids: list[str], message: str) -> None:
        if self.on_failed is not None and request_ids:
            await self.on_failed(request_ids, message)

    async def _step(self) -> list[StepOutput]:
        self._step_started = self.clock()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self.engine.step)
        finally:
            self._step_started = None

    async def _serve(self) -> None:
        while True:
            self._wake.clear()
            self._apply_pending()
            if self.engine.has_unfinished() and not self._pending:
                try:
                    outputs = await self._step()
                except StepFailed as e:
                    self.failed_steps += 1
                    log.error("engine step failed: its requests fail", request_ids=e.request_ids, error=str(e),
                              exc_info=e.cause)
                    await self._report_failed(e.request_ids, f"engine step failed: {e}")
                    continue
                self.steps += 1
                self._pulse()
                if outputs:
                    await self.on_outputs(outputs)
                for failure in self.engine.take_guide_failures():  # a grammar ended these: already aborted
                    await self._report_failed([failure.request_id], failure.message)
                if not self.engine.stalled:
                    continue
            # idle, or stalled until some other owner releases blocks: wait for a call or a timeout
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.idle_wait_s if self.engine.stalled else None)
