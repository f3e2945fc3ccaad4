"""Which KV blocks each prefill instance holds in device memory, mirrored from its lifecycle events.

Prefill instances publish `KVEventBatch(instance, events)` on `moorage.kv.events.<instance>`; each event
is `{"type": "stored" | "removed" | "cleared", "hashes": [16-byte digest, ...], "medium": ...}`. Device
hashes are chained block digests (`shared.hashing.block_hashes`), so a hash names its whole prefix and
the resident prefix of a prompt on an instance is the number of its leading block hashes present there.

Events are advisory: a lost "stored" costs hit rate, a lost "removed" makes the router overestimate
(the prefill recomputes what is missing). Memory is bounded: at most `max_blocks` hashes per instance
(the oldest go first) and `max_store_chunks` store digests. Store-medium events (chunk digests) feed one
global table: prefills say "stored" after a save; the master says "removed" when a chunk leaves the pool
(evicted, its store gone) and "cleared" when the pool lost everything, so the table follows the pool
(services/master/store_events.py). The shared pool serves every instance alike, so it does not change
which one is chosen; `store_prefix` says how much of a prompt the pool holds.
"transferred" events (a prefill handed a request's blocks to a decode instance) are counted only: decode
instances take no new prompts. Unknown event types or media ("ssd") are ignored; malformed events are
counted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from shared.hashing import DIGEST_BYTES

DEFAULT_MAX_BLOCKS = 1 << 21        # per instance: 2M blocks = 32M tokens, above any device cache
DEFAULT_MAX_STORE_CHUNKS = 1 << 21  # store digests kept for the count
EVENT_TYPES = ("stored", "removed", "cleared")
COUNTED_TYPES = ("transferred",)  # known, no state here


class KVIndex:
    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS, max_store_chunks: int = DEFAULT_MAX_STORE_CHUNKS):
        if max_blocks < 1 or max_store_chunks < 1:
            raise ValueError("KVIndex caps must be positive")
        self.max_blocks, self.max_store_chunks = max_blocks, max_store_chunks
        self._device: dict[str, OrderedDict[bytes, None]] = {}  # never holds an empty table
        self._store: OrderedDict[bytes, None] = OrderedDict()
        self.applied = 0    # events applied (or ignored as unknown type / medium)
        self.malformed = 0  # events dropped as malformed
        self.evicted = 0    # hashes dropped to stay under the caps
        self.counts: dict[str, int] = {}  # "<type>/<medium>" -> events applied

    # ---- events ------------------------------------------------------------------------------------
    def apply(self, instance: str, events: object) -> int:
        """Apply one batch from `instance`; returns how many of its events were malformed (ignored)."""
        if not isinstance(instance, str) or not instance or not isinstance(events, list):
            self.malformed += 1
            return 1
        bad = sum(not self._apply_one(instance, ev) for ev in events)
        self.applied += len(events) - bad
        self.malformed += bad
        return bad

    def _apply_one(self, instance: str, ev: object) -> bool:
        if not isinstance(ev, dict):
            return False
        kind, medium, hashes = ev.get("type"), ev.get("medium", "device"), ev.get("hashes", [])
        if not isinstance(kind, str) or not isinstance(medium, str) or not isinstance(hashes, (list, tuple)):
            return False
        if any(not isinstance(h, bytes) or len(h) != DIGEST_BYTES for h in hashes):
            return False
        if kind not in EVENT_TYPES + COUNTED_TYPES or medium not in ("device", "store"):
            return True  # a newer publisher: nothing for this index, not an error
        self.counts[f"{kind}/{medium}"] = self.counts.get(f"{kind}/{medium}", 0) + 1
        if kind in COUNTED_TYPES:
            return True
        if medium == "store":
            self._change(self._store, kind, hashes, self.max_store_chunks)
            return True
        table = self._device.get(instance)
        if table is None:
            if kind != "stored" or not hashes:
                return True
            table = self._device[instance] = OrderedDict()
        self._change(table, kind, hashes, self.max_blocks)
        if not table:
            del self._device[instance]
        return True

    def _change(self, table: OrderedDict[bytes, None], kind: str, hashes: Sequence[bytes], cap: int) -> None:
        if kind == "stored":
            for h in hashes:
                table[h] = None
                table.move_to_end(h)
            while len(table) > cap:
                table.popitem(last=False)
                self.evicted += 1
        elif kind == "removed":
            for h in hashes:
                table.pop(h, None)
        else:
            table.clear()

    def forget(self, instance: str) -> None:
        """Drop everything known about `instance` (gone, restarted, or its namespace changed)."""
        self._device.pop(instance, None)

    # ---- queries -----------------------------------------------------------------------------------
    def longest_prefix(self, instance: str, hashes: Sequence[bytes], start: int = 0) -> int:
        """Number of leading `hashes` resident on `instance`, given that the first `start` are."""
        table = self._device.get(instance)
        if not table:
            return 0
        n = start
        while n < len(hashes) and hashes[n] in table:
            n += 1
        return n

    def store_prefix(self, chunk_hashes: Sequence[bytes]) -> int:
        """Number of leading chunk digests the pool holds, as far as the events say."""
        n = 0
        while n < len(chunk_hashes) and chunk_hashes[n] in self._store:
            n += 1
        return n

    def store_holds(self, digest: bytes) -> bool:
        return digest in self._store

    def blocks(self, instance: str) -> int:
        table = self._device.get(instance)
        return len(table) if table else 0

    def instances(self) -> list[str]:
        return list(self._device)

    @property
    def total_blocks(self) -> int:
        return sum(len(t) for t in self._device.values())

    @property
    def store_chunks(self) -> int:
        return len(self._store)

    def check_integrity(self) -> None:
        tables = [(name, t, self.max_blocks) for name, t in self._device.items()]
        for name, table, cap in [*tables, ("<store>", self._store, self.max_store_chunks)]:
            assert name == "<store>" or table, f"{name}: empty table kept"
            assert len(table) <= cap, f"{name}: {len(table)} hashes over the cap of {cap}"
            bad = [h for h in table if not isinstance(h, bytes) or len(h) != DIGEST_BYTES]
            assert not bad, f"{name}: malformed hashes {bad[:3]}"
        assert min(self.applied, self.malformed, self.evicted) >= 0, "negative counters"
