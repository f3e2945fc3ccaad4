"""How long the pool keeps a chunk under its present pressure: the turnover a soft pin must be worth more than.

The router hears every chunk enter the pool (prefills' "stored" events after a save, medium "store") and leave
it (the master's "removed" events, whose `causes` say "evicted" when its eviction counter rose in that listing:
services/master/store_events.py). The age of each evicted chunk, from the first time the router heard of it to
its eviction, is how long the pool keeps what nobody pins. Their median over the recent evictions is the
turnover; while fewer than MIN_EVICTIONS chunks were evicted within the last `window_s`, the pool is under no
pressure and the turnover is None (space costs nothing: services/router/pauses.py pins for the pauses alone).

Events are advisory: a chunk the router never heard enter is no sample; one it heard of twice keeps its first
time. Memory is bounded: at most `max_chunks` entry times (the oldest go first) and WINDOW ages.

Pure logic, clock injected.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

import numpy as np

MIN_EVICTIONS = 16   # fewer recent evictions than this: no pressure
WINDOW = 4096        # the eviction ages remembered (the newest)
WINDOW_S = 300.0     # evictions older than this say nothing of the pressure now


class PoolTurnover:
    def __init__(self, window_s: float = WINDOW_S, max_chunks: int = 1 << 20,
                 clock: Callable[[], float] = time.monotonic):
        if window_s <= 0 or max_chunks < 1:
            raise ValueError(f"need window_s > 0 and max_chunks >= 1, got {window_s}, {max_chunks}")
        self.window_s, self.max_chunks, self.clock = window_s, max_chunks, clock
        self._entered: OrderedDict[bytes, float] = OrderedDict()  # chunk digest -> when the router heard it enter
        self._ages: deque[tuple[float, float]] = deque(maxlen=WINDOW)  # (when evicted, age then)

    def apply(self, events: object) -> None:
        """One KVEventBatch's events; all but the store medium's are someone else's."""
        if not isinstance(events, list):
            return
        now = self.clock()
        for ev in events:
            if not isinstance(ev, dict) or ev.get("medium") != "store" or not isinstance(ev.get("hashes"), list):
                continue
            kind, hashes = ev.get("type"), [h for h in ev["hashes"] if isinstance(h, bytes)]
            if kind == "stored":
                for h in hashes:
                    self._entered.setdefault(h, now)
                while len(self._entered) > self.max_chunks:
                    self._entered.popitem(last=False)
            elif kind == "removed":
                evicted = "evicted" in (ev.get("causes") or ())
                for h in hashes:
                    t = self._entered.pop(h, None)
                    if evicted and t is not None:
                        self._ages.append((now, now - t))
            elif kind == "cleared":
                self._entered.clear()

    def turnover_s(self) -> float | None:
        """The median age at eviction of the chunks evicted within window_s; None: no pressure."""
        since = self.clock() - self.window_s
        recent = [age for when, age in self._ages if when >= since]
        if len(recent) < MIN_EVICTIONS:
            return None
        return float(np.median(recent))

    def stats(self) -> dict:
        t = self.turnover_s()
        return {"pool_chunks_tracked": len(self._entered),
                **({"pool_turnover_s": round(t, 1)} if t is not None else {})}
