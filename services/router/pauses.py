"""How long agents pause between turns, and how long the pool keeps a paused session's KV for that.

A session whose answer ended in a tool call is expected back once the tool has run (a test suite, a build, a
person reading a diff). The router sees both ends of that pause: the answer ending, and the session's next
request. The pauses it saw size the soft pin (Mooncake's) that prefill gives a returning session's new pool
objects: long enough that nearly every session comes back to its KV (PAUSE_QUANTILE of the recent pauses,
times PAUSE_MARGIN), never shorter than `min_s`, never longer than `max_s` (space held for a session that
never returns is space another session lacks). Until MIN_SAMPLES pauses were seen the pin is `max_s`.

A pin only orders eviction: the master evicts pinned objects once no unpinned one is left, and each read
renews a pin, so a TTL that is too long costs ordering, never a wrong byte.

Pure logic, clock injected.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

import numpy as np

PAUSE_QUANTILE = 95.0  # percentile of the recent pauses a pin should outlast
PAUSE_MARGIN = 1.5     # times that percentile
MIN_SAMPLES = 8        # fewer pauses than this say too little: the pin is max_s
WINDOW = 512           # the pauses remembered (the newest)


class PauseTracker:
    def __init__(self, min_s: float, max_s: float, max_sessions: int = 4096,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 < min_s <= max_s:
            raise ValueError(f"need 0 < min_s <= max_s, got {min_s}, {max_s}")
        self.min_s, self.max_s, self.max_sessions, self.clock = min_s, max_s, max_sessions, clock
        self._paused: OrderedDict[tuple[str, str], float] = OrderedDict()  # session -> when its tool call ended
        self._pauses: deque[float] = deque(maxlen=WINDOW)

    def ended(self, key: tuple[str, str], expected_back: bool) -> None:
        """A turn of `key` (tenant, session) was answered; a tool call means a pause starts now."""
        self._paused.pop(key, None)
        if expected_back:
            self._paused[key] = self.clock()
            while len(self._paused) > self.max_sessions:
                self._paused.popitem(last=False)

    def returned(self, key: tuple[str, str]) -> float | None:
        """The session's next request arrived: the pause it ended, in seconds (None: it was not paused)."""
        t = self._paused.pop(key, None)
        if t is None:
            return None
        pause = max(0.0, self.clock() - t)
        self._pauses.append(pause)
        return pause

    def pin_s(self) -> float:
        if len(self._pauses) < MIN_SAMPLES:
            return self.max_s
        want = PAUSE_MARGIN * float(np.percentile(np.fromiter(self._pauses, float), PAUSE_QUANTILE))
        return min(self.max_s, max(self.min_s, want))

    def expected_s(self) -> float:
        """The median pause (0 until MIN_SAMPLES were seen): when a paused session is most likely back."""
        if len(self._pauses) < MIN_SAMPLES:
            return 0.0
        return float(np.percentile(np.fromiter(self._pauses, float), 50))

    def stats(self) -> dict:
        p = np.fromiter(self._pauses, float)
        return {"paused_sessions": len(self._paused), "pauses_seen": len(p), "pin_s": round(self.pin_s(), 1),
                **({"pause_p50_s": round(float(np.percentile(p, 50)), 2),
                    "pause_p95_s": round(float(np.percentile(p, 95)), 2)} if len(p) else {})}
