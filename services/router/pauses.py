"""How long agents pause between turns, and how long the pool keeps a paused session's KV for that.

A session whose answer ended in a tool call is expected back once the tool has run (a test suite, a build, a
person reading a diff). The router sees both ends of that pause: the answer ending, and the session's next
request. The pauses it saw size the soft pin (Mooncake's) that prefill gives a returning session's new pool
objects, never shorter than `min_s`, never longer than `max_s`. Until MIN_SAMPLES pauses were seen the pin is
`max_s`.

- **No pressure** (the pool evicted nothing lately: services/router/pool_turnover.py says no turnover): space
  costs nothing, so the pin outlasts nearly every pause: PAUSE_QUANTILE of the recent pauses, times PAUSE_MARGIN.
- **Under pressure** the pool keeps an unpinned chunk `turnover` seconds, so a pin pays only for the returns it
  catches after that, and it holds space that LRU would have given to others. `pin_for` weighs the two:
  - what the space is worth: under LRU a byte-second of pool catches F(turnover) / H(turnover) returns, where
    F(t) is the share of pauses up to t and H(t) the mean of min(pause, t), the time a session's KV is held;
  - what the pin saves: each return it catches is a recompute of the session's history. Per byte, recompute costs
    more for a long history (attention: shared/engine/model_config.recompute_knee_tokens), so a session's returns
    weigh (1 + N / 2 knee) / (1 + N_mean / 2 knee) against those of the average session expected back;
  - the pin covers the pauses up to the t that maximizes weight x (F(t) - F(turnover)) - worth x (H(t) -
    H(turnover)), times PAUSE_MARGIN; `min_s` when no t past the turnover pays (the pin then only keeps the
    session's chunks behind those of sessions not expected back).
  Long pauses that are rare, on a pool that turns over fast, are not worth their space; a long history's are
  worth more of it.

A pin only orders eviction: the master evicts pinned objects once no unpinned one is left, and each read
renews a pin, so a TTL that is too long costs ordering, never a wrong byte.

Pure logic, clock injected.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import numpy as np

PAUSE_QUANTILE = 95.0  # no pressure: percentile of the recent pauses a pin should outlast
PAUSE_MARGIN = 1.5     # times that percentile (or the pause a pin under pressure was sized to catch)
MIN_SAMPLES = 8        # fewer pauses than this say too little: the pin is max_s
WINDOW = 512           # the pauses (and the histories of sessions expected back) remembered (the newest)


def pin_for(pauses: np.ndarray, turnover_s: float | None, weight: float, min_s: float, max_s: float) -> float:
    """The soft pin for a session expected back, from the pauses seen (seconds), the pool's turnover (None: no
    pressure) and the weight of its recompute per byte against the average session's (module docstring)."""
    if turnover_s is None:
        want = PAUSE_MARGIN * float(np.percentile(pauses, PAUSE_QUANTILE))
        return min(max_s, max(min_s, want))
    p = np.sort(pauses)

    def caught(t: np.ndarray | float) -> np.ndarray:  # F: share of pauses no longer than t
        return np.searchsorted(p, t, side="right") / len(p)

    def held(t: np.ndarray | float) -> np.ndarray:  # H: mean of min(pause, t)
        return np.minimum(p[None, :], np.reshape(t, (-1, 1))).mean(axis=1)

    lru_caught, lru_held = float(caught(turnover_s)), float(held(turnover_s)[0])
    worth = lru_caught / lru_held if lru_held > 0 else 0.0  # returns per second a byte of LRU pool catches
    longer = np.unique(p[p > turnover_s])
    if not len(longer):
        return min_s
    gain = weight * (caught(longer) - lru_caught) - worth * (held(longer) - lru_held)
    best = int(np.argmax(gain))
    if gain[best] <= 0:
        return min_s
    return min(max_s, max(min_s, PAUSE_MARGIN * float(longer[best])))


class PauseTracker:
    def __init__(self, min_s: float, max_s: float, max_sessions: int = 4096, knee_tokens: float = math.inf,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 < min_s <= max_s:
            raise ValueError(f"need 0 < min_s <= max_s, got {min_s}, {max_s}")
        if not knee_tokens > 0:
            raise ValueError(f"need knee_tokens > 0, got {knee_tokens}")
        self.min_s, self.max_s, self.max_sessions, self.clock = min_s, max_s, max_sessions, clock
        self.knee_tokens = knee_tokens
        self._paused: OrderedDict[tuple[str, str], float] = OrderedDict()  # session -> when its tool call ended
        self._pauses: deque[float] = deque(maxlen=WINDOW)
        self._histories: deque[int] = deque(maxlen=WINDOW)  # tokens of the sessions expected back
        self.last_pin_s: float | None = None

    def ended(self, key: tuple[str, str], expected_back: bool, tokens: int = 0) -> None:
        """A turn of `key` (tenant, session) was answered, its history now `tokens` long (prompt and answer);
        a tool call means a pause starts now."""
        self._paused.pop(key, None)
        if expected_back:
            self._paused[key] = self.clock()
            if tokens > 0:
                self._histories.append(tokens)
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

    def weight(self, tokens: int) -> float:
        """What recomputing `tokens` of history costs per byte, against the average session expected back."""
        if tokens <= 0 or not self._histories or math.isinf(self.knee_tokens):
            return 1.0
        mean = float(np.mean(np.fromiter(self._histories, float)))
        return (1 + tokens / (2 * self.knee_tokens)) / (1 + mean / (2 * self.knee_tokens))

    def pin_s(self, turnover_s: float | None = None, tokens: int = 0) -> float:
        """The pin for a session expected back with `tokens` of history, the pool turning over every
        `turnover_s` (None: no pressure)."""
        self.last_pin_s = self._pin(turnover_s, tokens)
        return self.last_pin_s

    def _pin(self, turnover_s: float | None, tokens: int) -> float:
        if len(self._pauses) < MIN_SAMPLES:
            return self.max_s
        return pin_for(np.fromiter(self._pauses, float), turnover_s, self.weight(tokens), self.min_s, self.max_s)

    def expected_s(self) -> float:
        """The median pause (0 until MIN_SAMPLES were seen): when a paused session is most likely back."""
        if len(self._pauses) < MIN_SAMPLES:
            return 0.0
        return float(np.percentile(np.fromiter(self._pauses, float), 50))

    def stats(self) -> dict:
        p = np.fromiter(self._pauses, float)
        pin = self.last_pin_s if self.last_pin_s is not None else self._pin(None, 0)
        return {"paused_sessions": len(self._paused), "pauses_seen": len(p), "pin_s": round(pin, 1),
                **({"pause_p50_s": round(float(np.percentile(p, 50)), 2),
                    "pause_p95_s": round(float(np.percentile(p, 95)), 2)} if len(p) else {})}
