"""Publishes this instance's KV lifecycle events (device blocks indexed / evicted, chunks saved to the
pool, a request's blocks handed to a decode instance) on `moorage.kv.events.<instance>` for routers to
mirror (chunks that later leave the pool are the master's to report: services/master/store_events.py).
Advisory: a lost batch costs routers hit rate, never correctness. The block manager calls `emit` from
the engine thread; batches go out from the event loop every `interval_s`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

from shared.bus import Bus
from shared.kv_events import BlockStored
from shared.messages import KVEventBatch, kv_event_dict

MAX_EVENTS_PER_BATCH = 2000  # ~40 KB of hashes: far under the bus cap


class KVEventPublisher:
    def __init__(self, bus: Bus, instance: str, interval_s: float = 0.1):
        self.bus, self.instance, self.interval_s = bus, instance, interval_s
        self._queue: collections.deque = collections.deque()  # appends are thread-safe
        self._task: asyncio.Task | None = None
        self.published = 0

    def emit(self, event) -> None:
        self._queue.append(kv_event_dict(event))

    def emit_store(self, digests: list[bytes], chunk_tokens: int) -> None:
        self._queue.append(kv_event_dict(BlockStored(list(digests), None, [], chunk_tokens, medium="store")))

    def emit_transferred(self, block_hashes: list[bytes], to_instance: str) -> None:
        """A request's KV (these full blocks' chained hashes) landed on decode instance `to_instance`."""
        self._queue.append({"type": "transferred", "hashes": list(block_hashes), "medium": "device",
                            "to": to_instance})

    async def flush(self) -> None:
        while self._queue:
            events = [self._queue.popleft() for _ in range(min(MAX_EVENTS_PER_BATCH, len(self._queue)))]
            await self.bus.publish(self.bus.subjects.kv_events(self.instance), KVEventBatch(self.instance, events))
            self.published += len(events)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            with contextlib.suppress(Exception):
                await self.flush()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self.flush()
