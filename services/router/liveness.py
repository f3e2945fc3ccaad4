"""Whether the instances serving in-flight requests are still there: the router's watch on each request's
prefill and decode, fed by the load reports every service publishes each `load_interval_s`.

An instance is *gone* for the requests that watch it when
- its process ended: a supervisor announced it (InstanceExited, from `moorage up`, systemd's ExecStopPost
  or `moorage watch`), within milliseconds of the exit. Busy is not dead: this is the fast path, and
  silence below is only a stall-level backstop;
- it says so: a report with ready=False (its engine loop is dead or stalled, `detail.unhealthy`, or the
  goodbye a service sends when it stops);
- it was restarted: its report carries another process incarnation (`boot`) than before, however quickly
  the new process came back (what the old one held, such as an admit it never answered, is lost);
- it fell silent: no report from it for `timeout_s` (tens of seconds: a process alive but wedged, or a
  host gone without a word; never a few seconds of CPU starvation) while the router kept hearing others. After the
  router itself heard nothing for a while (its event loop was blocked, or its bus was slow), every
  instance gets `timeout_s` again from the moment it hears again: the reports queued meanwhile arrive in
  a burst, in no useful order, and must not make anyone look silent;
- the router itself lost the bus: no report from anyone (the router hears its own) for `timeout_s`
  while its connection is down, or for 2 x `timeout_s` in any case; or its connection was re-established
  since the request started (what was published meanwhile is lost, so the stream may have missed tokens).

`Liveness` is the bookkeeping, with time passed in. `LivenessMonitor` drives it from the event loop: the
load-report and exit callbacks push reports and exits in, and one timer task shared by every request
covers a silent bus.
A watch fires at most once; then it is forgotten.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.messages import InstanceExited, LoadReport

Key = tuple[str, str]  # (role, instance)
LATE_WAKE_S = 0.5      # the timer woke this much later than asked: the router's event loop was blocked


@dataclass(frozen=True)
class Gone:
    role: str      # "prefill" | "decode" | "bus"
    instance: str
    reason: str    # for logs and spans, never for the client


@dataclass(eq=False)
class Watch:
    """One request's interest in some instances; `on_gone` is called once, with the first one that goes."""
    on_gone: Callable[[Gone], None]
    keys: set[Key] = field(default_factory=set)
    epoch: int | None = None  # the bus connection it started on
    gone: Gone | None = None


def not_ready_reason(report: LoadReport) -> str:
    detail = report.detail if isinstance(report.detail, dict) else {}
    unhealthy = detail.get("unhealthy")
    return f"unhealthy: {unhealthy}" if unhealthy else "not ready (stopped)"


class Liveness:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.seen: dict[Key, float] = {}      # time of each instance's latest report
        self.down: dict[Key, str] = {}        # instances whose latest report said not ready: why
        self.heard: float | None = None       # time of the latest report from anyone
        self.resumed = float("-inf")          # when the router last started hearing again after a gap
        self.deaf_gap_s = timeout_s / 2       # no report from anyone for longer: the router was deaf
        self.epoch = 0                        # bus connection generation (reconnects so far)
        self.watchers: dict[Key, set[Watch]] = {}
        self.boots: dict[Key, str] = {}       # each instance's process incarnation, from its reports

    # ---- watches ---------------------------------------------------------------------------------
    def add(self, watch: Watch, role: str, instance: str, now: float) -> None:
        """Watch `instance` for `watch` (an instance never heard of gets timeout_s from now to report)."""
        if watch.gone is not None:
            return
        if watch.epoch is None:
            watch.epoch = self.epoch
        key = (role, instance)
        self.seen.setdefault(key, now)
        if self.heard is None:
            self.heard = now
        watch.keys.add(key)
        self.watchers.setdefault(key, set()).add(watch)
        if key in self.down:
            self._fire(watch, Gone(role, instance, self.down[key]))

    def remove(self, watch: Watch, role: str | None = None, instance: str | None = None) -> None:
        """Stop watching one instance (role and instance given) or all of them."""
        keys = [(role, instance)] if role is not None else list(watch.keys)
        for key in keys:
            watch.keys.discard(key)
            ws = self.watchers.get(key)
            if ws is not None:
                ws.discard(watch)
                if not ws:
                    del self.watchers[key]

    def watching(self) -> bool:
        return bool(self.watchers)

    def _fire(self, watch: Watch, gone: Gone) -> None:
        if watch.gone is not None:
            return
        watch.gone = gone
        self.remove(watch)
        watch.on_gone(gone)

    def _fire_key(self, key: Key, reason: str) -> None:
        for watch in list(self.watchers.get(key, ())):
            self._fire(watch, Gone(key[0], key[1], reason))

    # ---- what the router hears -------------------------------------------------------------------
    def report(self, role: str, instance: str, ready: bool, reason: str, now: float, boot: str = "") -> None:
        """A load report arrived: note it, fire the watches of an instance that says it is not ready or
        was restarted (another process answers to its name: what the old one held is lost), and of every
        watched instance that has been silent for timeout_s meanwhile."""
        key = (role, instance)
        self.seen[key] = now
        if boot:
            before = self.boots.get(key)
            self.boots[key] = boot
            if before and before != boot:
                self._fire_key(key, "restarted")
        if self.heard is not None and now - self.heard > self.deaf_gap_s:
            self.resumed = now
        self.heard = now if self.heard is None else max(self.heard, now)
        if ready:
            self.down.pop(key, None)
        else:
            self.down[key] = reason
            self._fire_key(key, reason)
        for k in [k for k in self.watchers if now - max(self.seen[k], self.resumed) > self.timeout_s]:
            self._fire_key(k, f"no load report for {now - self.seen[k]:.1f} s")
        horizon = now - 10 * self.timeout_s  # forget long-silent instances nobody watches (bounded)
        for k in [k for k, t in self.seen.items() if t < horizon and k not in self.watchers]:
            del self.seen[k]
            self.down.pop(k, None)
            self.boots.pop(k, None)

    def exited(self, role: str, instance: str, reason: str) -> None:
        """The instance's process ended (announced by its supervisor): its watches fire now, and so does any
        watch added before a new process of that name reports ready."""
        key = (role, instance)
        self.down[key] = reason
        self._fire_key(key, reason)

    def resume(self, now: float) -> None:
        """The router's own event loop was blocked until now: it heard nothing, but nobody was silent."""
        self.heard = self.resumed = now

    def check_bus(self, now: float, connected: bool, epoch: int) -> float:
        """Fire every watch if the router lost the bus (see the module doc); returns when to look again."""
        if epoch != self.epoch:
            self.epoch = epoch
            for watch in {w for ws in self.watchers.values() for w in ws if w.epoch != epoch}:
                self._fire(watch, Gone("bus", "nats", "the router's bus connection was re-established"))
        if self.heard is None:
            self.heard = now
        silent = now - self.heard
        if (silent > self.timeout_s and not connected) or silent > 2 * self.timeout_s:
            reason = f"no load report from anyone for {silent:.1f} s (bus {'up' if connected else 'down'})"
            for watch in {w for ws in self.watchers.values() for w in ws}:
                self._fire(watch, Gone("bus", "nats", reason))
        limit = self.timeout_s if silent <= self.timeout_s else 2 * self.timeout_s
        return self.heard + limit + 0.01


class LivenessMonitor:
    """Liveness on the event loop: reports pushed in from the load-report callback, plus one timer task
    (running only while some request watches something) for the case where nothing arrives at all."""

    def __init__(self, timeout_s: float, clock: Callable[[], float], bus=None):
        self.liveness = Liveness(timeout_s)
        self.clock, self.bus = clock, bus
        self._task: asyncio.Task | None = None

    def _bus_state(self) -> tuple[bool, int]:
        nc = getattr(self.bus, "nc", None)
        if nc is None or not hasattr(nc, "stats"):
            return True, 0
        return bool(nc.is_connected), int(nc.stats.get("reconnects", 0))

    def on_report(self, report: LoadReport, now: float) -> None:
        self.liveness.check_bus(now, *self._bus_state())
        self.liveness.report(report.role, report.instance, report.ready,
                             "" if report.ready else not_ready_reason(report), now, report.boot)

    def on_exit(self, msg: InstanceExited, now: float) -> None:
        self.liveness.exited(msg.role, msg.instance, f"exited ({msg.how or 'announced by ' + (msg.source or '?')})")

    def watch(self, watch: Watch, role: str, instance: str) -> None:
        """Its timer depends only on when anything was last heard, not on what is watched: a running timer
        keeps its time (no wake-up per watch: three per request)."""
        self.liveness.add(watch, role, instance, self.clock())
        if self.liveness.watching() and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._run(), name="router-liveness")

    def unwatch(self, watch: Watch, role: str | None = None, instance: str | None = None) -> None:
        self.liveness.remove(watch, role, instance)

    async def _run(self) -> None:
        wake_at = None
        while self.liveness.watching():
            now = self.clock()
            if wake_at is not None and now - wake_at > LATE_WAKE_S:  # this loop itself was blocked
                self.liveness.resume(now)
            wake_at = self.liveness.check_bus(now, *self._bus_state())
            await asyncio.sleep(max(0.01, wake_at - now))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
