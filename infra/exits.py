"""Busy is not dead: a service process that ends is announced on the bus (InstanceExited) by whoever saw it
end, so routers, gates and engines act within milliseconds, and silence stays a stall-level backstop.

Three supervisors, one message (docs/protocol.md, "Exits"):
- `moorage up`: its supervisor thread sees every child's exit from waitpid and hands it to an
  `ExitAnnouncer` (a bus client on a thread of its own; `announce` never blocks the supervisor).
- systemd: each unit's `ExecStopPost=moorage exited ROLE --config FILE` (`announce_systemd`). systemd runs
  it after the main process ended however it ended (SIGKILL and the OOM killer included) with
  SERVICE_RESULT, EXIT_CODE and EXIT_STATUS set, and the same INVOCATION_ID the service took as its boot.
- compose: the service's command is `moorage watch ROLE --config FILE` (`watch`): it runs `moorage serve`
  as its child, forwards SIGTERM/SIGINT, and announces the child's end before exiting with its status. A
  container killed whole (`docker kill`) takes the watcher along: that end is found by the silence
  backstop (router.liveness_timeout_s), as is a host that loses power.

Why not the bus's own view of disconnects: nats-server's $SYS disconnect events need a system account on
every deployment's server, and a disconnect is not a death (a slow consumer or a bus restart disconnects a
live process too). A supervisor knows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import uuid

from infra.supervise import describe_exit
from shared.bus import Bus, BusConfig, Subjects
from shared.messages import InstanceExited
from shared.service import BOOT_ENV

ANNOUNCE_TIMEOUT_S = 5.0  # a one-shot announcement gives up after this (the bus is down: the backstop applies)


def new_boot() -> str:
    return uuid.uuid4().hex[:12]


class ExitAnnouncer:
    """A bus client on a thread of its own, for callers on other threads (the launcher's supervisor):
    `announce` queues a publish and returns at once. While the bus is down the client buffers and
    reconnects (shared/bus.py); what was queued goes out once it is back."""

    def __init__(self, config: BusConfig, name: str):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="exit-announcer", daemon=True)
        self._thread.start()
        self._bus = asyncio.run_coroutine_threadsafe(Bus.connect(config, name), self._loop)
        self._closed = False

    def announce(self, msg: InstanceExited, prefix: str = "moorage") -> None:
        if not self._closed:
            asyncio.run_coroutine_threadsafe(self._publish(msg, prefix), self._loop)

    async def _publish(self, msg: InstanceExited, prefix: str) -> None:
        bus = await asyncio.wrap_future(self._bus)
        await bus.nc.publish(Subjects(prefix).exited(msg.role, msg.instance), bus.pack(msg))
        with contextlib.suppress(Exception):
            await bus.nc.flush(timeout=1)

    def close(self, timeout: float = 3.0) -> None:
        self._closed = True
        if self._bus.done() and self._bus.exception() is None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._bus.result().close(), self._loop).result(timeout)
        else:
            self._bus.cancel()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)


async def _announce_once(config: BusConfig, msg: InstanceExited) -> None:
    bus = await Bus.connect(config, f"exited-{msg.instance}")
    try:
        await bus.publish(bus.subjects.exited(msg.role, msg.instance), msg)
        await bus.nc.flush(timeout=2)
    finally:
        await bus.close()


def announce_once(config: BusConfig, msg: InstanceExited) -> bool:
    """Publish one announcement and wait until the server has it; False (said on stderr) when the bus
    cannot be reached within ANNOUNCE_TIMEOUT_S."""
    try:
        asyncio.run(asyncio.wait_for(_announce_once(config, msg), ANNOUNCE_TIMEOUT_S))
        return True
    except Exception as e:  # never fail the caller's stop over this: the silence backstop remains
        print(f"moorage: could not announce the exit of {msg.instance}: {type(e).__name__}: {e}", file=sys.stderr)
        return False


def systemd_exit(env: dict[str, str]) -> tuple[str, bool]:
    """(how, clean) from the variables systemd gives ExecStopPost: EXIT_CODE is exited | killed | dumped,
    EXIT_STATUS the status or the signal's name; SERVICE_RESULT is "success" for a clean stop."""
    code, status = env.get("EXIT_CODE", ""), env.get("EXIT_STATUS", "")
    signame = status if status.startswith("SIG") or not status else f"SIG{status}"
    how = {"exited": f"exit code {status}", "killed": f"killed by {signame}",
           "dumped": f"dumped core ({signame})"}.get(code, env.get("SERVICE_RESULT", "") or "ended")
    return how, env.get("SERVICE_RESULT") == "success"


def _service_config(role: str, rest: list[str]):
    from infra.cli import service_config_class
    from shared.service import parse_service_args

    return parse_service_args(role, service_config_class(role), rest)


def announce_systemd(role: str, rest: list[str], env: dict[str, str] | None = None) -> int:
    """`moorage exited ROLE --config FILE`: systemd's ExecStopPost. Always exits 0."""
    env = dict(os.environ if env is None else env)
    config = _service_config(role, rest)
    how, clean = systemd_exit(env)
    pid = env.get("MAINPID", "")
    announce_once(config.bus, InstanceExited(role, config.instance, env.get("INVOCATION_ID", ""), how, clean,
                                             int(pid) if pid.isdigit() else 0, "systemd"))
    return 0


def watch(role: str, rest: list[str]) -> int:
    """`moorage watch ROLE [serve options]`: run `moorage serve ROLE` as a child, forward SIGTERM/SIGINT to
    it, announce its end, and exit as it did (128 + signal when killed)."""
    config = _service_config(role, rest)
    boot = new_boot()
    child = subprocess.Popen([sys.executable, "-m", "infra.cli", "serve", role, *rest],
                             env={**os.environ, BOOT_ENV: boot})
    asked = []

    def forward(signum, frame) -> None:
        asked.append(signum)
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    returncode = child.wait()
    announce_once(config.bus, InstanceExited(role, config.instance, boot, describe_exit(returncode),
                                             bool(asked) and returncode == 0, child.pid, "watch"))
    return 128 - returncode if returncode < 0 else returncode
