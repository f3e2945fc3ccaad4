"""Publishes this instance's KV lifecycle events (device blocks indexed / evicted, chunks saved to the
pool, a request's blocks handed to a decode instance) on `moorage.kv.events.<instance>` for routers to
mirror (chunks that later leave the pool are the master's to report: services/master/store_events.py).
Advisory: a lost batch costs routers hit rate, never correctness. The block manager calls `emit` from
the engine thread. The first event into an empty queue wakes the event loop, which waits `window_s` for
the rest of that step's events and sends them as one batch; an idle instance sends nothing and never wakes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

from shared.bus import Bus
from shared.kv_events import BlockStored
from shared.messages import KVEventBatch, kv_event_dict

MAX_EVENTS_PER_BATCH = 2000  # ~40 KB of hashes: far under the bus cap
MAX_QUEUED = 100_000  # events kept while the bus is down


class KVEventPublisher:
    def __init__(self, bus: Bus, instance: str, window_s: float = 0.1):
        self.bus, self.instance, self.window_s = bus, instance, window_s
        self._queue: collections.deque = collections.deque()  # appends are thread-safe
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._armed = False  # a wake-up is on its way for what the queue holds
        self.published = self.dropped = 0

    def _append(self, event: dict) -> None:
        """From any thread. Only the first event after a flush began costs a wake-up."""
        self._queue.append(event)
        if not self._armed and self._loop is not None:
            self._armed = True
            with contextlib.suppress(RuntimeError):  # the loop closed: stop() flushes what is left
                self._loop.call_soon_threadsafe(self._wake.set)

    def emit(self, event) -> None:
        self._append(kv_event_dict(event))

    def emit_store(self, digests: list[bytes], chunk_tokens: int) -> None:
        self._append(kv_event_dict(BlockStored(list(digests), None, [], chunk_tokens, medium="store")))

    def emit_transferred(self, block_hashes: list[bytes], to_instance: str) -> None:
        """A request's KV (these full blocks' chained hashes) landed on decode instance `to_instance`."""
        self._append({"type": "transferred", "hashes": list(block_hashes), "medium": "device", "to": to_instance})

    async def flush(self) -> None:
        self._armed = False  # before draining: an event appended from here on wakes the loop again
        while self._queue:
            events = [self._queue.popleft() for _ in range(min(MAX_EVENTS_PER_BATCH, len(self._queue)))]
            try:
                await self.bus.publish(self.bus.subjects.kv_events(self.instance), KVEventBatch(self.instance, events))
            except Exception:  # kept for the next try, the oldest dropped past MAX_QUEUED (routers then miss hits)
                self._queue.extendleft(reversed(events))
                while len(self._queue) > MAX_QUEUED:
                    self._queue.popleft()
                    self.dropped += 1
                raise
            self.published += len(events)

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.window_s)  # the batch's deadline, counted from its first event
            with contextlib.suppress(Exception):  # the bus is down: what is left goes after the next window
                await self.flush()
            if self._queue and not self._armed:
                self._armed = True
                self._wake.set()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run())
        if self._queue:  # events emitted before the loop was known
            self._armed = True
            self._wake.set()

    async def stop(self) -> None:
        self._loop = None
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self.flush()
