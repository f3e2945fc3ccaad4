"""What bench/faults.py reads off the bus: every instance's latest LoadReport, pushed to a condition that
waiters check (no polling), and from it the two things a fault must not leave behind: a gate holding
budget for requests that ended, and KV blocks held on a prefill or decode with nothing running."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from shared.bus import Bus, BusConfig
from shared.messages import LoadReport

ENGINES = ("prefill", "decode")


@dataclass
class Leaks:
    """Held after the load stopped (all zero when nothing leaked), from reports that arrived afterwards."""
    reservations: int = 0        # gate reservations
    budget_tokens: int = 0       # gate reserved tokens, all decodes
    gate_waiting: int = 0        # admits still queued at the gate
    kv_tokens: int = 0           # prefill + decode KV not free
    engine_requests: int = 0     # running + waiting on prefills and decodes
    handoffs: int = 0            # prefill handoffs / decode landings in progress
    router_in_flight: int = 0
    missing: list[str] = field(default_factory=list)  # expected instances with no fresh report
    quiet_s: float | None = None  # seconds from the end of the load until all of the above were 0

    def clean(self) -> bool:
        return not self.missing and not any((self.reservations, self.budget_tokens, self.gate_waiting,
                                             self.kv_tokens, self.engine_requests, self.handoffs,
                                             self.router_in_flight))


def leaks_of(reports: dict[str, tuple[float, LoadReport]], expected: set[str], after: float) -> Leaks:
    fresh = {i: r for i, (t, r) in reports.items() if t > after}
    out = Leaks(missing=sorted(i for i in expected if i not in fresh or not fresh[i].ready))
    for r in fresh.values():
        d = r.detail or {}
        if r.role == "gate":
            out.reservations += int(d.get("reservations", 0))
            out.gate_waiting += int(d.get("waiting", 0))
            out.budget_tokens += sum(int(v) for v in (d.get("reserved_tokens") or {}).values())
        elif r.role in ENGINES:
            out.kv_tokens += r.capacity_tokens - r.free_tokens
            out.engine_requests += r.running + r.waiting
            out.handoffs += int(d.get("handoffs", 0) or 0) + int(d.get("landing", 0) or 0)
        elif r.role == "router":
            out.router_in_flight += r.running
    return out


class Watcher:
    """The latest report of every instance (with its arrival time), on the harness's event loop."""

    def __init__(self, nats_url: str):
        self.nats_url = nats_url
        self.reports: dict[str, tuple[float, LoadReport]] = {}
        self.changed = asyncio.Condition()
        self.bus: Bus | None = None

    async def __aenter__(self) -> "Watcher":
        self.bus = await Bus.connect(BusConfig(url=self.nats_url), "bench-faults")

        async def on_load(msg: LoadReport, raw) -> None:
            self.reports[msg.instance] = (time.monotonic(), msg)
            async with self.changed:
                self.changed.notify_all()

        await self.bus.subscribe(self.bus.subjects.load_all, LoadReport, on_load)
        return self

    async def __aexit__(self, *exc) -> None:
        if self.bus is not None:
            await self.bus.close()

    async def until(self, predicate, timeout: float) -> bool:
        """Wait for predicate() to hold, checked on every report; False after `timeout`."""
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(predicate), timeout)
                return True
            except asyncio.TimeoutError:
                return predicate()

    def ready_since(self, instance: str, since: float) -> bool:
        t, r = self.reports.get(instance, (0.0, None))
        return r is not None and t > since and r.ready

    async def leaks(self, expected: set[str], after: float, timeout: float) -> Leaks:
        """Wait (up to `timeout`) until every expected instance reported, after `after`, holding nothing.
        Returns what was still held then; quiet_s says how long it took when it did get there."""
        ok = await self.until(lambda: leaks_of(self.reports, expected, after).clean(), timeout)
        out = leaks_of(self.reports, expected, after)
        if ok and out.clean():
            out.quiet_s = round(time.monotonic() - after, 2)
        return out
