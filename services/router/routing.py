"""Which prefill instance takes a request: pure logic over load reports and session history.

`LoadTable` keeps the latest LoadReport of every instance (any role) with the time it arrived; an
instance counts only while its report is fresh and says ready. `PrefillPicker.pick` runs a chain of
strategies over the fresh, ready prefill instances; the first that names one wins:

- `Sticky`: the session's previous prefill (its history is in that instance's device cache), unless the
  session has been idle longer than `session_idle_s` or that instance is gone / not ready (failover).
- `CacheAware`: the instance with the longest resident prefix of the prompt, per the `KVIndex` mirrored
  from KV events (block hashes under each instance's own `kv_namespace`), unless it holds none or its
  queued tokens exceed the least loaded candidate's by more than `max_imbalance_tokens`.
- `PowerOfTwo`: two distinct instances drawn at random, the less loaded wins (queued prompt tokens,
  then running, then waiting requests). Always answers when there is a candidate.

Policies (POLICIES): "cache-aware" = sticky -> cache-aware -> p2c; "sticky" = sticky -> p2c; "p2c".
The picker forgets an instance's index entries when its report goes stale or not ready or names another
namespace: events are advisory, so an index that missed some only routes less well, never wrongly.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from services.router.kv_index import KVIndex
from shared.hashing import BLOCK_TOKENS, chain_hashes
from shared.kv_tenant import KVNamespace
from shared.messages import InstanceExited, LoadReport

DEFAULT_MAX_IMBALANCE_TOKENS = 16384


def kv_namespace(report: LoadReport) -> str:
    """The namespace a prefill's block hashes are chained under ("" when it does not say)."""
    ns = report.detail.get("kv_namespace") if isinstance(report.detail, dict) else None
    return ns if isinstance(ns, str) else ""


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
    kv_namespace: str = ""         # seeds the block hash chain of this instance's KV events
    boot: str = ""                 # the reporting process's incarnation

    @property
    def load_key(self) -> tuple[int, int, int]:
        return (self.queued_tokens + self.assigned_tokens, self.running, self.waiting)


class LoadTable:
    """Latest report per (role, instance). Reports older than `instance_timeout_s` are stale.
    `listeners` hear every report as it arrives (the router's liveness watch on in-flight requests), and
    `exit_listeners` every InstanceExited that ends the instance's current process (`exited`)."""

    DEAD_BOOTS_KEPT = 8  # per instance: reports of an ended process that arrive after its exit are dropped

    def __init__(self, instance_timeout_s: float):
        self.instance_timeout_s = instance_timeout_s
        self._loads: dict[tuple[str, str], InstanceLoad] = {}
        self._dead: dict[tuple[str, str], deque[str]] = {}  # boots announced exited, per instance
        self.listeners: list[Callable[[LoadReport, float], None]] = []
        self.exit_listeners: list[Callable[[InstanceExited, float], None]] = []

    def from_dead(self, report: LoadReport) -> bool:
        """A report its process sent before it ended, delivered after its InstanceExited (another connection)."""
        return bool(report.boot) and report.boot in self._dead.get((report.role, report.instance), ())

    def update(self, report: LoadReport, now: float) -> None:
        if self.from_dead(report):
            return
        for listener in self.listeners:
            listener(report, now)
        self._loads[(report.role, report.instance)] = InstanceLoad(
            report.instance, report.role, report.ready, now, report.queued_tokens, report.running,
            report.waiting, report.free_tokens, report.capacity_tokens, kv_namespace=kv_namespace(report),
            boot=report.boot)
        # forget instances silent for long (they may be gone for good): keeps the table bounded
        horizon = now - 10 * self.instance_timeout_s
        for key in [k for k, v in self._loads.items() if v.seen_at < horizon]:
            del self._loads[key]

    def exited(self, msg: InstanceExited, now: float) -> bool:
        """A supervisor saw `msg.instance`'s process end: it is out of choice (until a new process reports)
        and the exit listeners hear it. False, changing nothing else, when another process than the one
        that ended reports under that name now (a late announcement of an earlier run)."""
        key = (msg.role, msg.instance)
        if msg.boot:
            self._dead.setdefault(key, deque(maxlen=self.DEAD_BOOTS_KEPT)).append(msg.boot)
        load = self._loads.get(key)
        if msg.boot and load is not None and load.boot and load.boot != msg.boot:
            return False
        if load is not None:
            load.ready = False
        for listener in self.exit_listeners:
            listener(msg, now)
        return True

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
    prompt_ids: Sequence[int] = ()   # for the cache-aware strategy (block hashes)
    resident: dict[str, int] | None = None  # set by CacheAware: resident prefix blocks per instance
    tenant: str = ""                 # the request's KV namespace salt: only its tenant's blocks count


@dataclass(frozen=True)
class Decision:
    """What the latest pick chose and why (for metrics and the request's span)."""
    instance: str
    reason: str                         # sticky | cache | load
    resident_tokens: int | None = None  # the chosen instance's resident prefix, when CacheAware ran


Strategy = Callable[[Sequence[InstanceLoad], PickRequest], "str | None"]


@dataclass
class Sticky:
    """session -> (instance, last used), forgotten after `idle_s` without a request."""
    reason: ClassVar[str] = "sticky"
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


class _PromptChain:
    """The prompt's block hashes under one seed, computed only as far as some instance may hold them."""

    def __init__(self, prompt_ids: Sequence[int], seed: bytes):
        self.prompt_ids, self.seed = prompt_ids, seed
        self.hashes: list[bytes] = []
        self.total = len(prompt_ids) // BLOCK_TOKENS

    def extend(self) -> bool:
        have = len(self.hashes)
        if have >= self.total:
            return False
        want = min(self.total, max(8, 4 * have))
        self.hashes += chain_hashes(self.prompt_ids[have * BLOCK_TOKENS: want * BLOCK_TOKENS], BLOCK_TOKENS,
                                    self.seed, prev=self.hashes[-1] if self.hashes else None)
        return True


@dataclass
class CacheAware:
    """The candidate with the longest resident prefix (ties: the less loaded), if it is not overloaded."""
    reason: ClassVar[str] = "cache"
    index: KVIndex
    max_imbalance_tokens: int = DEFAULT_MAX_IMBALANCE_TOKENS

    def resident(self, candidates: Sequence[InstanceLoad], req: PickRequest) -> dict[str, int]:
        """Resident prefix blocks of the prompt per candidate that the index knows anything about."""
        chains: dict[str, _PromptChain] = {}  # one chain per namespace within this pick
        out: dict[str, int] = {}
        for c in candidates:
            if not c.kv_namespace or not self.index.blocks(c.instance):
                continue
            chain = chains.get(c.kv_namespace)
            if chain is None:
                seed = KVNamespace.of(c.kv_namespace, req.tenant).seed  # the request's tenant's chain
                chain = chains[c.kv_namespace] = _PromptChain(req.prompt_ids, seed)
            n = 0
            while True:
                n = self.index.longest_prefix(c.instance, chain.hashes, n)
                if n < len(chain.hashes) or not chain.extend():
                    break
            out[c.instance] = n
        return out

    def __call__(self, candidates: Sequence[InstanceLoad], req: PickRequest) -> str | None:
        resident = req.resident = self.resident(candidates, req)
        if not any(resident.values()):
            return None
        best = min(candidates, key=lambda c: (-resident.get(c.instance, 0), c.load_key, c.instance))
        floor = min(c.load_key[0] for c in candidates)
        if best.load_key[0] - floor > self.max_imbalance_tokens:
            return None  # the cache is not worth that queue: let load decide
        return best.instance


@dataclass
class PowerOfTwo:
    reason: ClassVar[str] = "load"
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

    def __init__(self, loads: LoadTable, strategies: Sequence[Strategy], sticky: Sticky | None = None,
                 index: KVIndex | None = None):
        self.loads = loads
        self.strategies = list(strategies)
        self.sticky = sticky
        self.index = index
        self.last: Decision | None = None
        self._unreported: dict[str, float] = {}  # indexed instances without a report yet: since when

    def update(self, report: LoadReport, now: float) -> None:
        if self.loads.from_dead(report):
            return
        if self.index is not None:
            if report.role == "prefill":
                old = self.loads.get("prefill", report.instance)
                if not report.ready or (old is not None and old.kv_namespace != kv_namespace(report)):
                    self.index.forget(report.instance)
            self.forget_gone(now)  # before the table drops long-silent instances
        self.loads.update(report, now)

    def exited(self, msg: InstanceExited, now: float) -> None:
        """An instance's process ended: out of choice at once, and a prefill's cache with it."""
        if self.loads.exited(msg, now) and msg.role == "prefill" and self.index is not None:
            self.index.forget(msg.instance)

    def forget_gone(self, now: float) -> None:
        """Forget the index entries of instances whose report is stale or not ready (their events may have
        been missed, or their cache is gone), or that never reported within instance_timeout_s."""
        timeout, unreported = self.loads.instance_timeout_s, {}
        for instance in self.index.instances():
            load = self.loads.get("prefill", instance)
            if load is None:
                since = self._unreported.get(instance, now)
                if now - since <= timeout:
                    unreported[instance] = since
                    continue
            elif load.ready and now - load.seen_at <= timeout:
                continue
            self.index.forget(instance)
        self._unreported = unreported

    def pick(self, session_id: str | None, now: float, prompt_tokens: int = 0,
             prompt_ids: Sequence[int] = (), exclude: Collection[str] = (), tenant: str = "") -> str | None:
        """The prefill for a request; never one in `exclude` (where a first attempt failed)."""
        candidates = [c for c in self.loads.fresh("prefill", now) if c.instance not in exclude]
        if not candidates:
            return None
        req = PickRequest(session_id, now, prompt_tokens, prompt_ids, tenant=tenant)
        choice, reason = None, "load"
        for strategy in self.strategies:
            choice = strategy(candidates, req)
            if choice is not None:
                reason = getattr(strategy, "reason", "other")
                break
        if choice is None:  # a chain without a catch-all: fall back to the least loaded
            choice = min(candidates, key=lambda c: c.load_key).instance
        resident = None if req.resident is None else req.resident.get(choice, 0) * BLOCK_TOKENS
        self.last = Decision(choice, reason, resident)
        if self.sticky is not None and session_id:
            self.sticky.remember(session_id, choice, now)
        self.loads.note_assigned("prefill", choice, prompt_tokens)
        return choice


def _cache_aware(loads: LoadTable, idle_s: float, rng: random.Random, max_imbalance: int) -> PrefillPicker:
    sticky, index = Sticky(idle_s), KVIndex()
    return PrefillPicker(loads, [sticky, CacheAware(index, max_imbalance), PowerOfTwo(rng)], sticky, index)


def _sticky(loads: LoadTable, idle_s: float, rng: random.Random, max_imbalance: int) -> PrefillPicker:
    sticky = Sticky(idle_s)
    return PrefillPicker(loads, [sticky, PowerOfTwo(rng)], sticky)


def _p2c(loads: LoadTable, idle_s: float, rng: random.Random, max_imbalance: int) -> PrefillPicker:
    return PrefillPicker(loads, [PowerOfTwo(rng)])


POLICIES: dict[str, Callable[[LoadTable, float, random.Random, int], PrefillPicker]] = {
    "cache-aware": _cache_aware,
    "sticky": _sticky,
    "p2c": _p2c,
}


def make_picker(policy: str, loads: LoadTable, session_idle_s: float, rng: random.Random | None = None,
                max_imbalance_tokens: int = DEFAULT_MAX_IMBALANCE_TOKENS) -> PrefillPicker:
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}: one of {', '.join(POLICIES)}")
    return POLICIES[policy](loads, session_idle_s, rng or random.Random(), max_imbalance_tokens)
