"""KV admission: which decode instance may take a request, and when.

A request needs `prompt_tokens + max_tokens` tokens of KV on the decode instance that will generate it
(its history plus everything it may still write). The gate promises those tokens before the request
starts and takes the promise back when it ends, so decode never runs out of KV half way through.

- Each decode instance tells us its KV `capacity_tokens` and `free_tokens` in a load report every
  second. Its *budget* is `capacity_tokens * budget_fraction`. It is *committed* by
  `max(sum of our reservations on it, capacity_tokens - free_tokens)`: when decode reports less free
  KV than our bookkeeping says (a gate restart lost reservations, a request outgrew its estimate),
  we believe decode.
- `admit` answers at once with `Admitted(instance)` (reserved on the live instance with the least
  committed fraction that still fits), `Invalid(reason)` (can never fit: over a configured limit or
  over the largest budget we know), `Rejected(unavailable=True)` (decode instances are known but none
  live can ever hold it now: waiting would only delay a certain failure), or `Wait` (queued). With no
  decode known at all (the gate just started), a request waits for one to report.
- The queue is ordered by due time: when a request arrived, less a head start of `priority x
  priority_step_s` plus its `latency_s` (agent hints; both 0 by default, which is plain FIFO). `drain`
  admits from the head while the head fits, and a new request is admitted at once only when nobody is
  waiting or it is due before the head. A big request at the head is never overtaken for ever: a
  later one overtakes it only by its bounded head start (the router caps priorities per tenant).
- `prefer`: the decode that served the session's last turn keeps its prompt's blocks (decode reuse), so it
  is chosen when it fits now; else the usual choice (a preference never makes a request wait).
- An expected output length (agent hint `osl`) reserves `min(max_tokens, osl x osl_margin)` output
  tokens instead of max_tokens, so more requests fit; validity is still judged on max_tokens. One that
  writes more than it said is not cut: its KV grows on decode, whose reported free count we believe.
- `expire` rejects requests that waited `admission_wait_s` and drops reservations older than
  `reservation_ttl_s` (their router died). What a router process holds (reservations, waiting admits)
  is dropped once it has sent no load report for `router_timeout_s` (counted "router_gone"), or at
  once when its instance reports another process (`router_report`, counted "orphaned").
- Every rejection carries `retry_after_s`, an estimate of when the tokens could be had
  (`retry_after`): the tokens that must be freed first (the queue ahead, plus the request, less the
  budget free now) over the rate releases freed budget at in the last `release_window_s`, within
  [retry_after_s, retry_after_max_s] of the settings. With no live decode able to hold it: the time a
  (re)started decode takes to be seen, `instance_timeout_s`.
- `release` ends a reservation (or cancels a waiting request). It is idempotent: a duplicate or
  unknown id changes nothing and is only counted; an unknown one is remembered, so its admit, if it
  arrives after all (the bus delivers them on separate subscriptions), is refused instead of reserved.
- `instance_exited` / `router_exited`: a supervisor announced that a process ended (InstanceExited). A
  decode is out of choice at once (its late reports are ignored); what a router process held is dropped
  at once (counted "exited"), as for a restarted one. Silence is only the backstop above: a busy peer is
  never dropped for a few seconds without a report.
- `reconcile` takes a router's list of what it may still hold (`Holdings`): what that router process
  holds here, is not listed and is older than `holdings_grace_s` lost its Release (to a bus outage);
  it is dropped (counted "reconciled").

Pure bookkeeping: no clock, no I/O. Every call takes `now` (monotonic seconds) where time matters.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict, deque
from dataclasses import dataclass, field

from services.gate.config import GateSettings

NO_INSTANCE = "no decode instance available"  # the router maps this rejection to 503, others to 429
_FINISHED_MEMORY = 65536  # released/expired ids remembered to tell a duplicate release from an unknown one
_DEAD_BOOTS = 8  # per instance: the ended processes whose late load reports are ignored


# ---- what admit / drain / expire return ----------------------------------------------------------
@dataclass(frozen=True)
class Admitted:
    request_id: str
    instance: str
    tokens: int
    waited_s: float = 0.0


@dataclass(frozen=True)
class Invalid:
    request_id: str
    reason: str


@dataclass(frozen=True)
class Wait:
    request_id: str


@dataclass(frozen=True)
class Rejected:
    request_id: str
    reason: str
    waited_s: float
    retry_after_s: float
    unavailable: bool = False  # no live decode can take it (HTTP 503), rather than a full budget (429)


@dataclass
class Expiry:
    rejected: list[Rejected] = field(default_factory=list)      # waited too long
    reservations: list[Reservation] = field(default_factory=list)  # never released: dropped
    gone: list[Reservation] = field(default_factory=list)       # their router process went silent: dropped
    gone_waiting: list[str] = field(default_factory=list)       # waiting for a router that went silent: dequeued


# ---- state -------------------------------------------------------------------------------------
@dataclass
class Instance:
    name: str
    capacity_tokens: int = 0
    free_tokens: int = 0
    budget: int = 0
    ready: bool = False
    last_seen: float = 0.0
    reserved: int = 0  # sum of our reservations on it
    boot: str = ""     # the reporting process's incarnation

    @property
    def committed(self) -> int:
        return max(self.reserved, self.capacity_tokens - self.free_tokens)


@dataclass(frozen=True)
class Reservation:
    request_id: str
    instance: str
    tokens: int
    admitted_at: float
    owner: str = ""  # the router process (boot id) that releases it


@dataclass(frozen=True)
class Waiting:
    request_id: str
    prompt_tokens: int
    max_tokens: int
    instance: str | None  # the router's choice, honoured when that instance is live and big enough
    enqueued_at: float
    owner: str = ""       # the router process (boot id) that asked
    head_start_s: float = 0.0  # from its priority and latency hints: served as if it had arrived this much earlier
    output_tokens: int = -1    # output tokens reserved (fewer than max_tokens from an osl hint); -1: max_tokens
    prefer: str = ""           # the session's last decode (holds its prompt's blocks): chosen when it fits now

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + (self.max_tokens if self.output_tokens < 0 else self.output_tokens)

    @property
    def due(self) -> tuple[float, float]:
        return self.enqueued_at - self.head_start_s, self.enqueued_at


class IntegrityError(AssertionError):
    pass


class Admission:
    def __init__(self, settings: GateSettings | None = None):
        self.settings = settings or GateSettings()
        self.instances: dict[str, Instance] = {}
        self.reservations: dict[str, Reservation] = {}
        self.queue: OrderedDict[str, Waiting] = OrderedDict()  # by request id, in arrival order; served by due time
        self._finished: OrderedDict[str, str] = OrderedDict()  # request id -> how it ended ("released", "expired", ...)
        self._freed: deque[tuple[float, int]] = deque()  # (when, tokens) budget given back, release_window_s
        self._since: float | None = None  # first time we were asked anything (the window's start, early on)
        self.counters = dict(admitted=0, rejected=0, invalid=0, released=0, cancelled=0, expired=0,
                             release_duplicate=0, release_unknown=0, orphaned=0, reconciled=0, router_gone=0,
                             admit_after_release=0, exited=0)
        self.routers: dict[str, str] = {}  # router instance -> the boot id of its process, from its load reports
        self.router_seen: dict[str, float] = {}  # router process (boot id) -> when it last reported
        self.dead: defaultdict[tuple[str, str], deque[str]] = defaultdict(lambda: deque(maxlen=_DEAD_BOOTS))
        #                                             (role, instance) -> boots announced exited (InstanceExited)

    # ---- decode instances --------------------------------------------------------------------
    def report(self, instance: str, capacity_tokens: int, free_tokens: int, ready: bool, now: float,
               boot: str = "") -> None:
        """A decode load report. `ready=False` (a goodbye) takes the instance out of choice; a report from a
        process announced exited (sent before it ended, delivered after) changes nothing."""
        if self._since is None:
            self._since = now
        if boot and boot in self.dead[("decode", instance)]:
            return
        inst = self.instances.setdefault(instance, Instance(instance))
        inst.boot = boot or inst.boot
        inst.capacity_tokens = max(0, int(capacity_tokens))
        inst.free_tokens = min(max(0, int(free_tokens)), inst.capacity_tokens)
        inst.budget = int(inst.capacity_tokens * self.settings.budget_fraction)
        inst.ready = bool(ready)
        inst.last_seen = now

    def instance_exited(self, instance: str, boot: str) -> bool:
        """A decode's process ended (InstanceExited): out of choice until a new process reports. Its
        reservations stay until their routers release them (their requests fail on the same announcement).
        False when another process than the one that ended reports under that name now."""
        if boot:
            self.dead[("decode", instance)].append(boot)
        inst = self.instances.get(instance)
        if inst is None or (boot and inst.boot and inst.boot != boot):
            return False
        inst.ready = False
        return True

    def router_exited(self, instance: str, boot: str, now: float) -> tuple[list[Reservation], list[str]]:
        """A router's process ended (InstanceExited): what it held can never be released. Its reservations
        are dropped (counted "exited") and its waiting requests dequeued, at once. Returns both."""
        owner = boot or self.routers.get(instance, "")
        if not owner:
            return [], []
        self.dead[("router", instance)].append(owner)
        self.router_seen.pop(owner, None)
        if self.routers.get(instance) == owner:
            del self.routers[instance]
        return self._drop_owner(owner, "exited", now)

    def live(self, inst: Instance, now: float) -> bool:
        return inst.ready and inst.budget > 0 and now - inst.last_seen <= self.settings.instance_timeout_s

    def _choose(self, w: Waiting, now: float) -> Instance | None:
        """The live instance, big enough for w, with the least committed fraction that fits w now (w's preferred
        one, the session's last, when it fits)."""
        able = [i for i in self.instances.values() if self.live(i, now) and i.budget >= w.tokens]
        pinned = [i for i in able if i.name == w.instance]
        fits = [i for i in (pinned or able) if i.committed + w.tokens <= i.budget]
        preferred = [i for i in fits if i.name == w.prefer]
        return min(preferred or fits, key=lambda i: (i.committed / i.budget, i.name), default=None)

    # ---- admission ---------------------------------------------------------------------------
    def _invalid_reason(self, prompt_tokens: int, max_tokens: int) -> str | None:
        s = self.settings
        if prompt_tokens < 1:
            return f"prompt_tokens must be positive, got {prompt_tokens}"
        if max_tokens < 0:
            return f"max_tokens must not be negative, got {max_tokens}"
        if s.max_input_tokens and prompt_tokens > s.max_input_tokens:
            return (f"prompt of {prompt_tokens} tokens exceeds the maximum context length for input "
                    f"(max_input_tokens={s.max_input_tokens})")
        if s.max_output_tokens and max_tokens > s.max_output_tokens:
            return f"max_tokens {max_tokens} exceeds max_output_tokens={s.max_output_tokens}"
        largest = max((i.budget for i in self.instances.values()), default=None)
        if largest is not None and prompt_tokens + max_tokens > largest:
            return (f"prompt_tokens + max_tokens = {prompt_tokens + max_tokens} exceeds the maximum context "
                    f"length of {largest} tokens (the largest decode KV budget: capacity x budget_fraction "
                    f"{s.budget_fraction})")
        return None

    def _unavailable_reason(self, tokens: int, now: float) -> str | None:
        """Why no live instance can ever take `tokens` now (None if one can, or none is known yet)."""
        if not self.instances:
            return None
        live = [i.budget for i in self.instances.values() if self.live(i, now)]
        if not live:
            return NO_INSTANCE
        if max(live) < tokens:
            return (f"{NO_INSTANCE} with room for {tokens} tokens: the largest live decode KV budget is "
                    f"{max(live)} tokens")
        return None

    def output_reserve(self, max_tokens: int, osl: int) -> int:
        """Output tokens to reserve: max_tokens, or the expected output length (osl) x osl_margin when that
        is less. A request that outgrows it is not cut: decode's own free count (reported) is believed."""
        if osl <= 0 or not self.settings.osl_margin:
            return max_tokens
        return min(max_tokens, math.ceil(osl * self.settings.osl_margin))

    def head_start(self, priority: int, latency_s: float = 0.0) -> float:
        return priority * self.settings.priority_step_s + max(0.0, latency_s)

    def _head(self) -> Waiting | None:
        return min(self.queue.values(), key=lambda w: w.due, default=None)

    def admit(self, request_id: str, prompt_tokens: int, max_tokens: int, now: float,
              instance: str | None = None, owner: str = "", priority: int = 0,
              latency_s: float = 0.0, osl: int = 0, prefer: str = "") -> Admitted | Invalid | Rejected | Wait:
        """Reserve at once, refuse for good, or queue. Repeating an admit for a request that is
        reserved or waiting returns its current state and reserves nothing more. Validity is judged on
        max_tokens; the reservation takes the osl hint into account (output_reserve)."""
        if self._since is None:
            self._since = now
        if request_id in self.reservations:
            r = self.reservations[request_id]
            return Admitted(request_id, r.instance, r.tokens)
        if request_id in self.queue:
            return Wait(request_id)
        if request_id in self._finished:  # released (or dropped) already: an admit that came late reserves nothing
            self.counters["admit_after_release"] += 1
            return Rejected(request_id, "the request was already released", 0.0, self.settings.retry_after_s)
        reason = self._invalid_reason(prompt_tokens, max_tokens)
        if reason is not None:
            self.counters["invalid"] += 1
            return Invalid(request_id, reason)
        w = Waiting(request_id, prompt_tokens, max_tokens, instance, now, owner, self.head_start(priority, latency_s),
                    self.output_reserve(max_tokens, osl), prefer)
        unavailable = self._unavailable_reason(w.tokens, now)
        if unavailable is not None:
            self.counters["rejected"] += 1
            return Rejected(request_id, unavailable, 0.0, self.retry_after(w.tokens, now), unavailable=True)
        head = self._head()
        if head is None or w.due < head.due:  # nobody overtakes a request due before it
            inst = self._choose(w, now)
            if inst is not None:
                return self._reserve(w, inst, now)
        self.queue[request_id] = w
        return Wait(request_id)

    def _reserve(self, w: Waiting, inst: Instance, now: float) -> Admitted:
        self.reservations[w.request_id] = Reservation(w.request_id, inst.name, w.tokens, now, w.owner)
        inst.reserved += w.tokens
        self._finished.pop(w.request_id, None)
        self.counters["admitted"] += 1
        return Admitted(w.request_id, inst.name, w.tokens, now - w.enqueued_at)

    def drain(self, now: float) -> list[Admitted]:
        """Admit waiting requests in due order while the head fits (call after a release or a report)."""
        out = []
        while self.queue:
            w = self._head()
            inst = self._choose(w, now)
            if inst is None:
                break
            del self.queue[w.request_id]
            out.append(self._reserve(w, inst, now))
        return out

    def expire(self, now: float, heard_since: float = float("-inf")) -> Expiry:
        """Reject requests that waited admission_wait_s; drop reservations older than reservation_ttl_s;
        forget instances silent for reservation_ttl_s that hold nothing; drop what a router process holds
        (reservations and waiting admits) once it has sent no load report for router_timeout_s, counted
        from `heard_since` at the earliest (when this gate's bus connection was last restored: a router is
        not silent while we could not hear it)."""
        s, out = self.settings, Expiry()
        if s.router_timeout_s:
            cutoff = now - s.router_timeout_s
            for boot in [b for b, seen in self.router_seen.items() if max(seen, heard_since) <= cutoff]:
                del self.router_seen[boot]
                self.routers = {i: b for i, b in self.routers.items() if b != boot}
                dropped, waiting = self._drop_owner(boot, "router_gone", now)
                out.gone += dropped
                out.gone_waiting += waiting
        for w in [w for w in self.queue.values() if now - w.enqueued_at >= s.admission_wait_s]:
            del self.queue[w.request_id]
            self.counters["rejected"] += 1
            big_enough = any(self.live(i, now) and i.budget >= w.tokens for i in self.instances.values())
            reason = (f"no KV budget for {w.tokens} tokens on decode within {s.admission_wait_s:g} s"
                      if big_enough else NO_INSTANCE)
            ahead = sum(q.tokens for q in self.queue.values() if q.due <= w.due)
            out.rejected.append(Rejected(w.request_id, reason, now - w.enqueued_at,
                                         self.retry_after(w.tokens, now, ahead), unavailable=not big_enough))
        for r in [r for r in self.reservations.values() if now - r.admitted_at >= s.reservation_ttl_s]:
            self._drop(r, "expired", now)
            self.counters["expired"] += 1
            out.reservations.append(r)
        for inst in [i for i in self.instances.values()
                     if i.reserved == 0 and now - i.last_seen >= s.reservation_ttl_s]:
            del self.instances[inst.name]
        return out

    def router_report(self, instance: str, boot: str, now: float) -> tuple[list[Reservation], list[str]]:
        """A router's load report. When `instance` reports another process than before (it was restarted,
        e.g. after kill -9), what its previous process held can never be released: its reservations are
        dropped (counted "orphaned") and its waiting requests taken out of the queue. Returns both."""
        if boot in self.dead[("router", instance)]:  # sent before it ended, delivered after its announcement
            return [], []
        old = self.routers.get(instance)
        if boot:
            self.routers[instance] = boot
            self.router_seen[boot] = now
        if not boot or not old or old == boot:
            return [], []
        self.router_seen.pop(old, None)
        return self._drop_owner(old, "orphaned", now)

    def _drop_owner(self, owner: str, how: str, now: float) -> tuple[list[Reservation], list[str]]:
        """Drop every reservation of the router process `owner` (counted `how`) and take its waiting
        requests out of the queue (counted "cancelled"). Returns both."""
        dropped = [r for r in self.reservations.values() if r.owner == owner]
        for r in dropped:
            self._drop(r, how, now)
            self.counters[how] += 1
        waiting = [w.request_id for w in self.queue.values() if w.owner == owner]
        for rid in waiting:
            del self.queue[rid]
            self.counters["cancelled"] += 1
        return dropped, waiting

    def reconcile(self, owner: str, held: set[str], now: float) -> tuple[list[Reservation], list[str]]:
        """A router process's `Holdings`: drop its reservations, and take out of the queue its waiting
        requests, that it no longer lists and that are older than holdings_grace_s (the grace covers a
        Holdings sent before an admit that overtook it). Returns both; a release of them later is a duplicate."""
        if not owner:
            return [], []
        cutoff = now - self.settings.holdings_grace_s
        dropped = [r for r in self.reservations.values()
                   if r.owner == owner and r.request_id not in held and r.admitted_at <= cutoff]
        for r in dropped:
            self._drop(r, "reconciled", now)
            self.counters["reconciled"] += 1
        waiting = [w.request_id for w in self.queue.values()
                   if w.owner == owner and w.request_id not in held and w.enqueued_at <= cutoff]
        for rid in waiting:
            del self.queue[rid]
            self.counters["cancelled"] += 1
        return dropped, waiting

    def release(self, request_id: str, now: float | None = None) -> str:
        """End a request however it ended. Returns "released" (its reservation is freed), "cancelled"
        (it was still waiting: the caller answers it), "duplicate" or "unknown" (nothing changes).
        `now` dates the freed budget for the release rate (Retry-After)."""
        r = self.reservations.get(request_id)
        if r is not None:
            self._drop(r, "released", now)
            self.counters["released"] += 1
            return "released"
        if request_id in self.queue:
            del self.queue[request_id]
            self.counters["cancelled"] += 1
            return "cancelled"
        if request_id in self._finished:
            self.counters["release_duplicate"] += 1
            return "duplicate"
        self.counters["release_unknown"] += 1
        self._remember(request_id, "released unadmitted")  # its admit may still be on the way: refused then
        return "unknown"

    def _remember(self, request_id: str, how: str) -> None:
        self._finished[request_id] = how
        while len(self._finished) > _FINISHED_MEMORY:
            self._finished.popitem(last=False)

    def _drop(self, r: Reservation, how: str, now: float | None = None) -> None:
        del self.reservations[r.request_id]
        self.instances[r.instance].reserved -= r.tokens
        self._remember(r.request_id, how)
        if now is not None:
            self._freed.append((now, r.tokens))

    # ---- Retry-After -------------------------------------------------------------------------
    def release_rate(self, now: float) -> float:
        """Budget tokens freed per second over the last release_window_s (or since we started)."""
        window = self.settings.release_window_s
        while self._freed and self._freed[0][0] < now - window:
            self._freed.popleft()
        span = min(window, now - (self._since if self._since is not None else now))
        return sum(t for _, t in self._freed) / max(1.0, span)

    def retry_after(self, tokens: int, now: float, ahead: int | None = None) -> float:
        """Seconds until `tokens` could plausibly be admitted, behind `ahead` queued tokens (default: the
        whole queue), bounded by [retry_after_s, retry_after_max_s] (see the module doc)."""
        s = self.settings
        lo, hi = s.retry_after_s, max(s.retry_after_s, s.retry_after_max_s)
        live = [i for i in self.instances.values() if self.live(i, now) and i.budget >= tokens]
        if not live:  # nothing live can hold it: until a (re)started decode can have reported
            return min(hi, max(lo, s.instance_timeout_s))
        ahead = sum(w.tokens for w in self.queue.values()) if ahead is None else ahead
        need = ahead + tokens - max(max(0, i.budget - i.committed) for i in live)
        if need <= 0:
            return lo
        rate = self.release_rate(now)
        return hi if rate <= 0 else min(hi, max(lo, need / rate))

    # ---- observability -----------------------------------------------------------------------
    def stats(self, now: float) -> dict:
        return {**self.counters, "waiting": len(self.queue), "reservations": len(self.reservations),
                "live_instances": sum(self.live(i, now) for i in self.instances.values()),
                "reserved_tokens": {n: i.reserved for n, i in self.instances.items()},
                "committed_tokens": {n: i.committed for n, i in self.instances.items()},
                "budget_tokens": {n: i.budget for n, i in self.instances.items()}}

    def check_integrity(self) -> None:
        """Raise IntegrityError if the books do not balance."""
        sums: dict[str, int] = {}
        for rid, r in self.reservations.items():
            if rid != r.request_id or r.tokens < 1 or r.instance not in self.instances:
                raise IntegrityError(f"bad reservation {r}")
            sums[r.instance] = sums.get(r.instance, 0) + r.tokens
        for name, inst in self.instances.items():
            if inst.reserved != sums.get(name, 0):
                raise IntegrityError(f"{name}: reserved {inst.reserved} != sum of reservations {sums.get(name, 0)}")
            if min(inst.capacity_tokens, inst.free_tokens, inst.budget, inst.reserved) < 0:
                raise IntegrityError(f"{name}: negative numbers {inst}")
            if inst.free_tokens > inst.capacity_tokens or inst.budget > inst.capacity_tokens:
                raise IntegrityError(f"{name}: free or budget above capacity {inst}")
        both = self.queue.keys() & self.reservations.keys()
        if both:
            raise IntegrityError(f"both waiting and reserved: {sorted(both)}")
        if any(rid != w.request_id for rid, w in self.queue.items()):
            raise IntegrityError("queue index out of step")
        negative = {k: v for k, v in self.counters.items() if v < 0}
        if negative:
            raise IntegrityError(f"negative counters {negative}")
