"""Which prefill instance takes a request: pure logic over load reports and session history.

`LoadTable` keeps the latest LoadReport of every instance (any role) with the time it arrived; an
instance counts only while its report is fresh and says ready. `PrefillPicker.pick` runs a chain of
strategies over the fresh, ready prefill instances; the first that names one wins:

- `Sticky`: the session's previous prefill (its history is in that instance's device cache), unless the
  session has been idle longer than `session_idle_s` or that instance is gone / not ready (failover).
- `PowerOfTwo`: two distinct instances drawn at random, the less loaded wins (queued prompt tokens,
  then running, then waiting requests). Always answers when there is a candidate.

A cache-aware strategy (longest resident prefix from KV events) slots in between: it is one more
callable `(candidates, PickRequest) -> instance | None`, registered in POLICIES.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from shared.messages import LoadReport


@dataclass
class InstanceLoad:
    instance: str
    role: str
    ready: bool
    seen_at: float                 # monotonic time the latest report arrived
    queued_tokens: int = 0
    running: int = 0
    waiting: int = 0
    free_tokens: int = 0
    capacity_tokens: int = 0
    assigned_tokens: int = 0       # prompt tokens routed here since that report (not in it yet)

    @property
    def load_key(self) -> tuple[int, int, int]:
        return (self.queued_tokens + self.assigned_tokens, self.running, self.waiting)


class LoadTable:
    """Latest report per (role, instance). Reports older than `instance_timeout_s` are stale."""

    def __init__(self, instance_timeout_s: float):
        self.instance_timeout_s = instance_timeout_s
        self._loads: dict[tuple[str, str], InstanceLoad] = {}

    def update(self, report: LoadReport, now: float) -> None:
        self._loads[(report.role, report.instance)] = InstanceLoad(
            report.instance, report.role, report.ready, now, report.queued_tokens, report.running,
            report.waiting, report.free_tokens, report.capacity_tokens)
        # forget instances silent for long (they may be gone for good): keeps the table bounded
        horizon = now - 10 * self.instance_timeout_s
        for key in [k for k, v in self._loads.items() if v.seen_at < horizon]:
            del self._loads[key]

    def fresh(self, role: str, now: float) -> list[InstanceLoad]:
        """Ready instances of `role` with a fresh report, sorted by name (deterministic)."""
        return sorted((v for (r, _), v in self._loads.items()
                       if r == role and v.ready and now - v.seen_at <= self.instance_timeout_s),
                      key=lambda v: v.instance)

    def get(self, role: str, instance: str) -> InstanceLoad | None:
        return self._loads.get((role, instance))

    def note_assigned(self, role: str, instance: str, tokens: int) -> None:
        load = self._loads.get((role, instance))
        if load is not None:
            load.assigned_tokens += tokens


@dataclass
class PickRequest:
    session_id: str | None
    now: float
    prompt_tokens: int = 0
    prompt_ids: Sequence[int] = ()   # for a cache-aware strategy (chunk hashes)


Strategy = Callable[[Sequence[InstanceLoad], PickRequest], "str | None"]


@dataclass
class Sticky:
    """session -> (instance, last used), forgotten after `idle_s` without a request."""
    idle_s: float
    sessions: OrderedDict[str, tuple[str, float]] = field(default_factory=OrderedDict)

    def __call__(self, candidates: Sequence[InstanceLoad], req: PickRequest) -> str | None:
        if not req.session_id:
            return None
        entry = self.sessions.get(req.session_id)
        if entry is None or req.now - entry[1] > self.idle_s:
            return None
        owner = entry[0]
        return owner if any(c.instance == owner for c in candidates) else None

    def remember(self, session_id: str, instance: str, now: float) -> None:
        self.sessions[session_id] = (instance, now)
        self.sessions.move_to_end(session_id)
        while self.sessions:  # least recently used first: drop the expired head
            _, (_, last) = next(iter(self.sessions.items()))
            if now - last <= self.idle_s:
                break
            self.sessions.popitem(last=False)

    def owner(self, session_id: str, now: float) -> str | None:
        entry = self.sessions.get(session_id)
        return entry[0] if entry is not None and now - entry[1] <= self.idle_s else None


@dataclass
class PowerOfTwo:
    rng: random.Random = field(default_factory=random.Random)

    def __call__(self, candidates: Sequence[InstanceLoad], req: PickRequest) -> str | None:
        if not candidates:
            return None
        if len(candidates) == 1:
            return candidates[0].instance
        a, b = self.rng.sample(list(candidates), 2)
        return min((a, b), key=lambda c: c.load_key).instance


class PrefillPicker:
    """Runs the strategy chain over fresh, ready prefill instances; records the session's choice."""

    def __init__(self, loads: LoadTable, strategies: Sequence[Strategy], sticky: Sticky | None = None):
        self.loads = loads
        self.strategies = list(strategies)
        self.sticky = sticky

    def update(self, report: LoadReport, now: float) -> None:
        self.loads.update(report, now)

    def pick(self, session_id: str | None, now: float, prompt_tokens: int = 0,
             prompt_ids: Sequence[int] = ()) -> str | None:
        candidates = self.loads.fresh("prefill", now)
        if not candidates:
            return None
        req = PickRequest(session_id, now, prompt_tokens, prompt_ids)
        choice = None
        for strategy in self.strategies:
            choice = strategy(candidates, req)
            if choice is not None:
                break
        if choice is None:  # a chain without a catch-all: fall back to the least loaded
            choice = min(candidates, key=lambda c: c.load_key).instance
        if self.sticky is not None and session_id:
            self.sticky.remember(session_id, choice, now)
        self.loads.note_assigned("prefill", choice, prompt_tokens)
        return choice


def _sticky(loads: LoadTable, idle_s: float, rng: random.Random) -> PrefillPicker:
    sticky = Sticky(idle_s)
    return PrefillPicker(loads, [sticky, PowerOfTwo(rng)], sticky)


def _p2c(loads: LoadTable, idle_s: float, rng: random.Random) -> PrefillPicker:
    return PrefillPicker(loads, [PowerOfTwo(rng)])


POLICIES: dict[str, Callable[[LoadTable, float, random.Random], PrefillPicker]] = {
    "sticky": _sticky,
    "p2c": _p2c,
}


def make_picker(policy: str, loads: LoadTable, session_idle_s: float,
                rng: random.Random | None = None) -> PrefillPicker:
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}: one of {', '.join(POLICIES)}")
    return POLICIES[policy](loads, session_idle_s, rng or random.Random())
