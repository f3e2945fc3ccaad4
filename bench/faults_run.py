"""One fault under load (bench/faults.py): warm the load up, inject, watch what the requests in flight got,
how long until a new request succeeded, wait for the system to be whole again, stop the load, check
that nothing is held, and compare every answer with the greedy reference."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from bench.faults_inject import Fault, FaultSize, Restarts, inject
from bench.faults_load import CLEAN, Load, LoadShape, Result, probe_until_success
from bench.faults_reference import Reference
from bench.faults_watch import Leaks, Watcher
from infra.up import NATS_CHILD, Launcher


@dataclass
class Size:
    load: LoadShape = field(default_factory=LoadShape)
    fault: FaultSize = field(default_factory=FaultSize)
    warm_ok: int = 4               # answers before the fault is injected
    recovery_window_s: float = 60.0  # the prober gives up after this (no success: recovery "none")
    healthy_timeout_s: float = 120.0  # the killed process back and every instance reporting ready
    after_s: float = 1.0           # load kept on once recovered and whole again
    quiet_timeout_s: float = 30.0  # for nothing to be held once the load stopped


@dataclass
class FaultResult:
    fault: str
    kind: str
    victim: str
    in_flight: dict[str, int]        # outcome -> requests in flight at the fault (a burst's own included)
    error_end_s: float | None         # latest end, after the fault, of an in-flight request that did not succeed
    during: dict[str, int]            # outcome -> new requests started after the fault, up to the first success
    first_success_s: float | None     # fault -> end of the first new request that succeeded
    back_s: float | None              # fault -> the restarted process (every instance, for NATS) ready on the bus
    healthy: bool                     # every instance ready again before the next fault
    requests: int
    storm_closed: int
    others: list[str]                 # what "other" outcomes were (plain 500, hang, cut stream, ...)
    compared: int = 0
    wrong_answers: int = 0
    wrong_tokens: int = 0
    wrong_examples: list[str] = field(default_factory=list)
    leaks: dict = field(default_factory=dict)
    leaked_budget_tokens: int = 0
    leaked_kv_tokens: int = 0
    quiet_s: float | None = None
    clean: bool = False               # every leak figure 0 and every expected instance reporting
    wall_s: float = 0.0
    phases_s: dict = field(default_factory=dict)  # where the wall time went: warm, until whole, quiet, reference


class Harness:
    """A launched system plus the restart hook; `run(fault)` measures one fault."""

    def __init__(self, launcher: Launcher, base_url: str, size: Size, reference: Reference | None):
        self.launcher, self.base_url, self.size, self.reference = launcher, base_url, size, reference
        self.restarts = Restarts(launcher)
        self.expected = set(launcher.procs)

    def run(self, fault: Fault) -> FaultResult:
        t0 = time.monotonic()
        result, answers = asyncio.run(self._run(fault))
        t_ref = time.monotonic()
        if self.reference is not None:
            check = self.reference.check(answers)
            result.compared, result.wrong_answers, result.wrong_tokens = (check.compared, check.wrong_answers,
                                                                          check.wrong_tokens)
            result.wrong_examples = list(check.examples)
        result.phases_s["reference"] = round(time.monotonic() - t_ref, 1)
        result.wall_s = round(time.monotonic() - t0, 1)
        return result

    async def _run(self, fault: Fault) -> tuple[FaultResult, list]:
        size = self.size
        nats = self.launcher.nats.url
        async with Watcher(nats) as watch:
            warm = asyncio.Event()
            results: list[Result] = []

            def record(res: Result) -> Result:
                results.append(res)
                if sum(r.outcome == "ok" for r in results) >= size.warm_ok:
                    warm.set()
                return res

            load = Load(self.base_url, size.load, record)
            t_start = time.monotonic()
            load_task = asyncio.create_task(load.run())
            await asyncio.wait_for(warm.wait(), size.recovery_window_s)
            t_fault = time.monotonic()
            probe = asyncio.create_task(probe_until_success(self.base_url, record, t_fault,
                                                            size.recovery_window_s))
            await inject(fault, self.launcher, self.base_url, record, size.fault, self.restarts)
            t_injected = time.monotonic()
            first_probe = await probe
            back_s, healthy = await self._whole_again(watch, fault, t_fault)
            await asyncio.sleep(size.after_s)  # a little load on the healed system too
            t_whole = time.monotonic()
            load.running.clear()
            await load_task
            t_quiet = time.monotonic()
            leaks = await watch.leaks(self.expected, t_quiet, size.quiet_timeout_s)
        result, answers = self._summarize(fault, results, t_fault, t_injected, first_probe, back_s, healthy, leaks)
        result.phases_s = {"warm": round(t_fault - t_start, 1), "fault_to_whole": round(t_whole - t_fault, 1),
                           "load_stop": round(t_quiet - t_whole, 1), "quiet": round(time.monotonic() - t_quiet, 1)}
        return result, answers

    async def _whole_again(self, watch: Watcher, fault: Fault, t_fault: float) -> tuple[float | None, bool]:
        """(seconds from the fault until the restarted process reported ready, every instance ready again)."""
        def back() -> float | None:
            if not fault.restarts:
                return 0.0
            t = self.restarts.since(fault.victim, t_fault)
            if t is None:
                return None
            who = self.expected if fault.victim == NATS_CHILD else {fault.victim}
            return t if all(watch.ready_since(i, t) for i in who) else None

        def whole() -> bool:
            return back() is not None and all(watch.ready_since(i, t_fault) for i in self.expected) \
                and not self.launcher.dead()

        healthy = await watch.until(whole, self.size.healthy_timeout_s)
        back_at = None
        if fault.restarts:  # the first report that made back() true: the latest of the victims' reports
            t = self.restarts.since(fault.victim, t_fault)
            who = self.expected if fault.victim == NATS_CHILD else {fault.victim}
            if t is not None and all(watch.ready_since(i, t) for i in who):
                back_at = max(watch.reports[i][0] for i in who) - t_fault
        return (round(back_at, 2) if back_at is not None else (0.0 if not fault.restarts else None)), healthy

    def _summarize(self, fault: Fault, results: list[Result], t_fault: float, t_injected: float,
                   first_probe: float | None, back_s: float | None, healthy: bool,
                   leaks: Leaks) -> tuple[FaultResult, list]:
        affected = [r for r in results if (r.kind == "load" and r.start < t_injected and r.end > t_fault)
                    or r.kind == "burst"]
        new_ok = [r.end - t_fault for r in results if r.kind in ("load", "probe") and r.start >= t_fault
                  and r.outcome == "ok"]
        first = min(new_ok + ([first_probe] if first_probe is not None else []), default=None)
        until = t_fault + (first if first is not None else float("inf"))
        during = [r for r in results if r.kind in ("load", "probe") and t_fault <= r.start <= until]
        errors = [r.end - t_fault for r in affected if r.outcome != "ok"]
        others = [f"{r.kind} {'stream' if r.stream else 'json'}: {r.detail}" for r in results
                  if r.outcome == "other"]
        answers = [(r.prompt, r.max_tokens, r.text, r.complete) for r in results
                   if r.outcome == "ok" or (r.stream and r.text and r.outcome in ("sse_error", "dropped",
                                                                                 "client_closed"))]
        out = FaultResult(
            fault.name, fault.kind, fault.victim, dict(Counter(r.outcome for r in affected)),
            round(max(errors), 2) if errors else None, dict(Counter(r.outcome for r in during)),
            round(first, 2) if first is not None else None, back_s, healthy, len(results),
            sum(r.outcome == "client_closed" for r in results), others[:10],
            leaks=asdict(leaks), leaked_budget_tokens=leaks.budget_tokens, leaked_kv_tokens=leaks.kv_tokens,
            quiet_s=leaks.quiet_s, clean=leaks.clean())
        return out, answers


def unclean(result: FaultResult) -> list[str]:
    """In-flight outcomes that are not clean for this fault: a killed router can only drop its connections
    (nothing else holds them); everything else must end ok, with an SSE error, a 503 or a 429."""
    allowed = CLEAN | ({"dropped"} if result.victim.startswith("router") else set())
    return [o for o in result.in_flight if o not in allowed]
