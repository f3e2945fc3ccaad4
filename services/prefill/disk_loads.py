"""Prefill's side of the stores' disk tier (services/store/disk_serve.py): which store holds which object on
disk, and asking one to put a request's missing chunks back into the pool before the restore reads them.

The directory is built from the stores' DiskIndex announcements (a snapshot each at start, and on this
prefill's DiskSync). It is advisory: a store that no longer holds an object answers that it loaded fewer,
and a dead store's subject has no responders; either way those chunks are computed. Whatever a store puts
back is restored as any pool hit: read and verified again, byte for byte.
"""

from __future__ import annotations

import asyncio
import time

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from shared.bus import Bus
from shared.logging import get_logger
from shared.messages import DiskIndex, DiskLoad, DiskLoaded, DiskSync, MessageError
from shared.tracing import get_tracer

log = get_logger("prefill.disk")
tracer = get_tracer("moorage.prefill.disk")


class DiskDirectory:
    """Which store holds which object on disk (pure: no I/O)."""

    def __init__(self):
        self.held: dict[str, set[str]] = {}  # store instance -> keys on its disk

    def apply(self, msg: DiskIndex) -> None:
        keys = self.held.setdefault(msg.store, set())
        if msg.snapshot:
            keys.clear()
        keys.update(msg.added)
        keys.difference_update(msg.removed)

    def holder(self, keys: list[str]) -> str | None:
        """A store holding every one of `keys` (a chunk's objects), else None."""
        return next((store for store, held in self.held.items() if all(k in held for k in keys)), None)

    def __len__(self) -> int:
        return sum(len(k) for k in self.held.values())


class DiskLoader:
    def __init__(self, bus: Bus, instance: str, timeout_s: float):
        self.bus, self.instance, self.timeout_s = bus, instance, timeout_s
        self.directory = DiskDirectory()
        self.counters = {"disk_loads": 0, "disk_loaded_chunks": 0, "disk_load_failures": 0}

    async def start(self) -> None:
        async def on_index(msg: DiskIndex, raw) -> None:
            self.directory.apply(msg)

        await self.bus.subscribe(self.bus.subjects.disk_index, DiskIndex, on_index)
        await self.bus.publish(self.bus.subjects.disk_sync, DiskSync(self.instance))

    def plan(self, chunk_keys: list[list[str]], present: list[bool]) -> dict[str, list[int]]:
        """The chunks to load, by store: those the pool lacks, up to the first that no disk holds either."""
        if not self.directory.held:
            return {}
        by_store: dict[str, list[int]] = {}
        for c, (keys, have) in enumerate(zip(chunk_keys, present)):
            if have:
                continue
            store = self.directory.holder(keys)
            if store is None:
                break
            by_store.setdefault(store, []).append(c)
        return by_store

    async def load(self, chunk_keys: list[list[str]], present: list[bool], trace_ctx,
                   replace: bool = False) -> list[bool]:
        """`present` (per chunk: in the pool) after asking the stores to put back the chunks the pool lacks.
        replace: the pool lists them but could not serve them (DiskLoad.replace)."""
        plan = self.plan(chunk_keys, present)
        if not plan:
            return present
        out = list(present)
        with tracer.start_as_current_span("store.disk_load", context=trace_ctx) as span:
            t0 = time.perf_counter()
            got = await asyncio.gather(*(self._ask(store, [chunk_keys[c] for c in chunks], replace)
                                         for store, chunks in plan.items()))
            loaded = 0
            for (store, chunks), n in zip(plan.items(), got):
                for c in chunks[:n]:
                    out[c] = True
                loaded += n
            self.counters["disk_loads"] += 1
            self.counters["disk_loaded_chunks"] += loaded
            span.set_attributes({"chunks": sum(len(c) for c in plan.values()), "loaded_chunks": loaded,
                                 "stores": len(plan), "ms": (time.perf_counter() - t0) * 1e3})
        return out

    async def _ask(self, store: str, chunk_keys: list[list[str]], replace: bool) -> int:
        """How many leading chunks of `chunk_keys` store put back into the pool."""
        keys = [k for chunk in chunk_keys for k in chunk]
        try:
            reply = await self.bus.request(self.bus.subjects.disk_load(store), DiskLoad(keys, replace), DiskLoaded,
                                           timeout=self.timeout_s)
        except (NatsError, asyncio.TimeoutError, MessageError) as e:
            self.counters["disk_load_failures"] += 1
            if isinstance(e, NoRespondersError):  # that store is gone: its restart announces its listing anew
                self.directory.held.pop(store, None)
            log.info("disk load failed", store=store, error=repr(e))
            return 0
        if reply.reason:
            log.info("disk load short", store=store, loaded=reply.loaded, asked=len(keys), reason=reply.reason)
        per_chunk = len(chunk_keys[0]) if chunk_keys else 1
        return min(reply.loaded, len(keys)) // per_chunk
