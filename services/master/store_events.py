"""Store-tier KV events: the master tells routers when chunks leave the pool (or enter it).

mooncake_master can publish per-key events itself (`--enable_kv_events`, ZMQ), but the PyPI wheels
(0.3.13.post1 checked) are built without it: `/kv_events/status` answers `"enabled": false`. So this
service lists the pool's keys every `events_interval_s` (`/get_all_keys`: read-only, no lease) and
publishes the difference on `moorage.kv.events.<master instance>` (see store_tier.py for the rules):
- `{"type": "removed", "medium": "store", "hashes": [...], "causes": [...]}` for chunks gone since
  the last listing, or claimed by a prefill's "stored" and absent. `causes` names what happened in that
  interval, as far as the master can tell: "evicted" (its eviction counter rose), "store_gone" (a
  segment left: its store died or was stopped) or "deleted" (neither: removed by a client). Mooncake
  0.3.x has no per-object expiry: a read lease ending only makes an object evictable again.
- `{"type": "stored", "medium": "store", ...}` for chunks that appeared (normally the prefill said so first).
- `{"type": "cleared", "medium": "store"}` when this service starts and whenever mooncake_master
  restarts (its objects die with it).
Events are advisory, as every KV event: a router that misses some is wrong for at most one interval
after the next listing that changes those chunks, never incorrect in what it serves.
"""

from __future__ import annotations

import asyncio
import contextlib

from services.master.store_tier import Diff, StoreTier, parse_keys
from shared.messages import KVEventBatch
from shared.service import ServiceContext

MAX_HASHES_PER_EVENT = 2000  # 32 KB of digests per event: far under the bus cap
LISTING_TIMEOUT_S = 10.0


class StoreEventPublisher:
    def __init__(self, ctx: ServiceContext, master, interval_s: float, http_get):
        self.ctx, self.master, self.interval_s, self.http_get = ctx, master, interval_s, http_get
        self.tier = StoreTier()
        self.subject = ctx.bus.subjects.kv_events(ctx.instance)
        self._segments: set[str] | None = None
        self._evictions: float | None = None
        self._restarts = master.restarts
        self.listing_failures = 0

    async def on_kv_events(self, batch: KVEventBatch, _raw) -> None:
        """Prefills' "stored" (medium store) claims: checked by the next listing."""
        if batch.instance == self.ctx.instance or not isinstance(batch.events, list):
            return
        for ev in batch.events:
            if isinstance(ev, dict) and ev.get("type") == "stored" and ev.get("medium") == "store" \
                    and isinstance(ev.get("hashes"), list):
                self.tier.claim(ev["hashes"])

    async def run(self) -> None:
        await self._publish([{"type": "cleared", "hashes": [], "medium": "store", "causes": ["master_started"]}])
        while not self.ctx.stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctx.stop.wait(), timeout=self.interval_s)
            if self.ctx.stop.is_set():
                return
            with contextlib.suppress(Exception):  # a lost round is made good by the next one
                await self.list_once()

    async def list_once(self) -> Diff | None:
        if self.master.restarts != self._restarts:
            self._restarts = self.master.restarts
            self.tier.clear()
            self._segments, self._evictions = None, None
            await self._publish([{"type": "cleared", "hashes": [], "medium": "store",
                                  "causes": ["master_restarted"]}])
        if not self.master.alive():
            return None
        self.tier.begin_listing()
        try:
            keys = await asyncio.to_thread(self.http_get, self.master.base_url + "/get_all_keys", LISTING_TIMEOUT_S)
            segments = await asyncio.to_thread(self.http_get, self.master.base_url + "/get_all_segments", 2.0)
        except Exception:
            self.tier.listing_failed()
            self.listing_failures += 1
            return None
        diff = self.tier.observe(parse_keys(k for k in keys.splitlines() if k))
        causes = self._causes({s for s in segments.splitlines() if s})
        await self._publish(self._events("stored", diff.stored, []) + self._events("removed", diff.removed, causes))
        return diff

    def _causes(self, segments: set[str]) -> list[str]:
        causes = []
        evictions = self.master.stats.get("master_evicted_key_count")
        if self._evictions is not None and evictions is not None and evictions > self._evictions:
            causes.append("evicted")
        if self._segments is not None and self._segments - segments:
            causes.append("store_gone")
        self._segments, self._evictions = segments, evictions if evictions is not None else self._evictions
        return causes or ["deleted"]

    @staticmethod
    def _events(kind: str, digests: list[bytes], causes: list[str]) -> list[dict]:
        return [{"type": kind, "hashes": digests[i:i + MAX_HASHES_PER_EVENT], "medium": "store", "causes": causes}
                for i in range(0, len(digests), MAX_HASHES_PER_EVENT)]

    async def _publish(self, events: list[dict]) -> None:
        for ev in events:  # one event per batch: a batch stays small whatever the pool's churn
            await self.ctx.bus.publish(self.subject, KVEventBatch(self.ctx.instance, [ev]))

    def detail(self) -> dict:
        return {**self.tier.counters, "held_chunks": len(self.tier.held), "listing_failures": self.listing_failures,
                "interval_s": self.interval_s}
