"""Runs a NativePlan the way `docker compose up` would: each service starts once its `depends_on` conditions
hold, and its healthcheck runs as Docker runs it: a probe every `interval` (every `start_interval` inside
`start_period`), the first one an interval after the start; a probe over `timeout` fails; failures inside
`start_period` do not count; `retries` failures in a row make it unhealthy. Unlike compose, a service that
exits before it is healthy fails the run at once (compose would restart it, `restart: on-failure`), and the
whole start is bounded. Every process runs in its own session; `down()` ends each process group it started
(SIGTERM, then SIGKILL), in reverse start order.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

from tests.compose_native import ComposeError, Healthcheck, Launch, NativePlan

CONDITIONS = ("service_started", "service_healthy")


class ComposeRun:
    def __init__(self, plan: NativePlan, logs: Path):
        self.plan, self.logs = plan, logs
        logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.started = {n: asyncio.Event() for n in plan.launches}
        self.healthy = {n: asyncio.Event() for n in plan.launches}
        self.waited_s: dict[str, float] = {}  # from its start to healthy

    def log(self, name: str, lines: int = 40) -> str:
        path = self.logs / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"--- {name} (last {lines} lines of {path}):\n" + "\n".join(text.splitlines()[-lines:])

    async def up(self, bound_s: float) -> None:
        """Every service started and healthy within bound_s, else ComposeError with the logs that explain it."""
        tasks = [asyncio.create_task(self._service(launch)) for launch in self.plan.launches.values()]
        done, pending = await asyncio.wait(tasks, timeout=bound_s, return_when=asyncio.FIRST_EXCEPTION)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        failed = [t.exception() for t in done if t.exception() is not None]
        if failed:
            raise failed[0]
        if pending:
            late = [n for n, e in self.healthy.items() if not e.is_set()]
            raise ComposeError(f"not healthy within {bound_s:.0f}s: {late}\n" + "\n".join(self.log(n) for n in late))

    async def _service(self, launch: Launch) -> None:
        for dep, condition in launch.depends_on.items():
            if condition not in CONDITIONS:
                raise ComposeError(f"{launch.name}: depends_on {dep} condition {condition!r} is not emulated")
            if dep in self.plan.launches:  # jaeger and grafana are not run here
                await (self.healthy if condition == "service_healthy" else self.started)[dep].wait()
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("MOORAGE")}
        with open(self.logs / f"{launch.name}.log", "wb") as out:
            proc = await asyncio.create_subprocess_exec(*launch.argv, env={**env, **launch.env}, stdout=out,
                                                        stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        self.procs[launch.name] = proc
        self.started[launch.name].set()
        began = asyncio.get_running_loop().time()
        if launch.health is not None:
            await self._until_healthy(launch.name, launch.health, proc)
        self.waited_s[launch.name] = asyncio.get_running_loop().time() - began
        self.healthy[launch.name].set()

    async def _until_healthy(self, name: str, hc: Healthcheck, proc: asyncio.subprocess.Process) -> None:
        loop = asyncio.get_running_loop()
        began, failures = loop.time(), 0
        exited = asyncio.ensure_future(proc.wait())
        try:
            while True:
                # the next probe one interval on, unless the process ends first
                starting = loop.time() - began < hc.start_period_s
                if (await asyncio.wait({exited}, timeout=hc.start_interval_s if starting else hc.interval_s))[0]:
                    raise ComposeError(f"{name} exited with {proc.returncode} before it was healthy\n{self.log(name)}")
                ok, said = await probe(hc)
                if ok:
                    return
                if loop.time() - began >= hc.start_period_s:
                    failures += 1
                    if failures >= hc.retries:
                        raise ComposeError(f"{name} is unhealthy: {said}\n{self.log(name)}")
        finally:
            exited.cancel()

    def exited(self, name: str) -> asyncio.Future:
        """Completes when that service's process ends (to stop a wait on it early)."""
        return asyncio.ensure_future(self.procs[name].wait())

    async def down(self, grace_s: float = 20.0) -> None:
        live = [p for p in reversed(self.procs.values()) if p.returncode is None]
        for p in live:
            _signal_group(p.pid, signal.SIGTERM)
        if live:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live], timeout=grace_s)
        for p in self.procs.values():  # stragglers, and children of a leader that already exited
            _signal_group(p.pid, signal.SIGKILL)
            if p.returncode is None:
                await p.wait()


async def probe(hc: Healthcheck) -> tuple[bool, str]:
    """One run of the healthcheck's command: (passed, what it printed)."""
    try:
        proc = await asyncio.create_subprocess_exec(*hc.argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
    except FileNotFoundError:  # in the image, not here: say so rather than wait out the start period
        raise ComposeError(f"healthcheck {hc.argv}: {hc.argv[0]} is not installed on this machine") from None
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), hc.timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return False, f"{hc.argv} timed out after {hc.timeout_s}s"
    return proc.returncode == 0, out.decode(errors="replace").strip()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
