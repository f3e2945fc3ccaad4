"""The faults bench/faults.py injects into a running `moorage up` (infra.up.Launcher), one at a time:
kill -9 of one process, a disconnect storm, an overload burst beyond the gate's budget, the same burst at
the highest priority a key may ask for (a priority flood from one tenant: issue 30), and a NATS
restart (stopped cleanly, then started again on the same port with the same credential)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench.faults_load import Result, burst, storm
from infra.up import NATS_CHILD, Launcher


@dataclass(frozen=True)
class Fault:
    name: str        # the table's row
    kind: str        # kill | storm | overload | priority_flood | nats_restart
    victim: str = ""  # the supervised child it restarts (kill, nats_restart)

    @property
    def restarts(self) -> bool:
        return bool(self.victim)


KILLS = ("store-0", "master-0", "prefill-0", "decode-0", "gate-0", "router-0", NATS_CHILD)
FAULTS = (Fault("disconnect storm", "storm"), Fault("overload burst", "overload"),
          Fault("priority flood", "priority_flood"),
          *(Fault(f"kill -9 {v}", "kill", v) for v in KILLS), Fault("NATS restart", "nats_restart", NATS_CHILD))


@dataclass
class FaultSize:
    storm_streams: int = 50
    storm_max_tokens: int = 128
    storm_stop_after: int = 3      # SSE events a storm stream reads before its client hangs up
    storm_close_after_s: float = 2.0  # ... or seconds, if it has not got them by then (queued)
    burst_requests: int = 24
    burst_prompt_bytes: int = 1500  # long prompts, short answers: a few fill the budget, the burst ends soon
    burst_max_tokens: int = 64     # at 32, a quick burst drained in ~2.5 s here: some runs had no request wait the
                                   # 2 s admission_wait_s, so nothing overran; 64 doubles the drain (decode-bound)
    burst_timeout_s: float = 120.0
    flood_priority: int = 10       # router.max_priority's default: the most a key may ask for


class Restarts:
    """When the launcher said it restarted a child (its console lines, pushed from its thread)."""

    def __init__(self, launcher: Launcher):
        self.at: dict[str, list[float]] = {}
        self.lock = threading.Lock()
        say = launcher._say

        def hooked(line: str) -> None:
            say(line)
            name, _, rest = line.partition(" ")
            if rest.startswith("restarted"):
                self.mark(name)
        launcher._say = hooked

    def mark(self, name: str) -> None:
        with self.lock:
            self.at.setdefault(name, []).append(time.monotonic())

    def since(self, name: str, t: float) -> float | None:
        with self.lock:
            return next((x for x in self.at.get(name, []) if x >= t), None)


async def restart_nats(launcher: Launcher, restarts: Restarts) -> None:
    """What an operator's restart of the bus does: SIGTERM (nats-server exits 0, which Restart=on-failure
    leaves stopped), then start it again through the supervisor (same port, same credential)."""
    proc = launcher.supervisor.children[NATS_CHILD].process
    proc.terminate()
    await asyncio.to_thread(proc.wait, 30)
    await asyncio.to_thread(launcher.supervisor.add, NATS_CHILD, launcher.nats.spawn)
    restarts.mark(NATS_CHILD)


async def inject(fault: Fault, launcher: Launcher, base_url: str, record: Callable[[Result], Result],
                 size: FaultSize, restarts: Restarts) -> None:
    """Start the fault now; returns when the injection itself is over (a kill at once; a storm or a
    burst once its requests ended; a NATS restart once the new server was started)."""
    if fault.kind == "kill":
        os.kill(launcher.supervisor.pids()[fault.victim], signal.SIGKILL)
    elif fault.kind == "storm":
        await storm(base_url, record, size.storm_streams, size.storm_max_tokens, size.storm_stop_after,
                    size.storm_close_after_s)
    elif fault.kind == "overload":
        await burst(base_url, record, size.burst_requests, size.burst_prompt_bytes, size.burst_max_tokens,
                    size.burst_timeout_s)
    elif fault.kind == "priority_flood":  # the burst, every request at the tenant's ceiling (router.max_priority)
        await burst(base_url, record, size.burst_requests, size.burst_prompt_bytes, size.burst_max_tokens,
                    size.burst_timeout_s, priority=size.flood_priority, tag="flood")
    elif fault.kind == "nats_restart":
        await restart_nats(launcher, restarts)
    else:
        raise ValueError(f"unknown fault kind {fault.kind!r}")
