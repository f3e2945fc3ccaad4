"""Exit announcements (issue 33, infra/exits.py): whoever saw a service process end says so on the bus, with
the incarnation (`boot`) its load reports carried, so peers act at once instead of waiting out a silence.
`moorage up`'s announcements are proven end to end in tests/test_router_failfast.py and tests/test_faults.py;
here the other two supervisors, each against a real nats-server and a real gate process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.exits import systemd_exit
from shared.bus import Bus, BusConfig
from shared.messages import InstanceExited, LoadReport
from tests.natsbus import nats_url

ROOT = Path(__file__).resolve().parent.parent


def test_systemd_exit_reads_execstoppost_variables():
    assert systemd_exit({"EXIT_CODE": "killed", "EXIT_STATUS": "KILL", "SERVICE_RESULT": "signal"}) == \
        ("killed by SIGKILL", False)
    assert systemd_exit({"EXIT_CODE": "exited", "EXIT_STATUS": "3", "SERVICE_RESULT": "exit-code"}) == \
        ("exit code 3", False)
    assert systemd_exit({"EXIT_CODE": "dumped", "EXIT_STATUS": "SEGV", "SERVICE_RESULT": "core-dump"}) == \
        ("dumped core (SIGSEGV)", False)
    assert systemd_exit({"EXIT_CODE": "exited", "EXIT_STATUS": "0", "SERVICE_RESULT": "success"}) == \
        ("exit code 0", True)
    assert systemd_exit({"SERVICE_RESULT": "timeout"}) == ("timeout", False)  # never started, say


@pytest.fixture(scope="module")
def nats():
    with nats_url() as url:
        yield url


@pytest.fixture
def gate_config(tmp_path, nats) -> Path:
    path = tmp_path / "gate.toml"
    path.write_text(f'instance = "gate-7"\nload_interval_s = 0.2\n[bus]\nurl = "{nats}"\nprefix = "exits"\n'
                    '[http]\nport = -1\n[tracing]\nexporter = "none"\n')
    return path


class Listener:
    """The bus as a peer sees it: exit announcements and the gate's load reports."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self.exits: asyncio.Queue[InstanceExited] = asyncio.Queue()
        self.boots: asyncio.Queue[str] = asyncio.Queue()

    @classmethod
    async def start(cls, url: str) -> "Listener":
        lis = cls(await Bus.connect(BusConfig(url=url, prefix="exits"), "test-listener"))

        async def on_exit(msg: InstanceExited, raw) -> None:
            lis.exits.put_nowait(msg)

        async def on_load(msg: LoadReport, raw) -> None:
            lis.boots.put_nowait(msg.boot)

        await lis.bus.subscribe(lis.bus.subjects.exited_all, InstanceExited, on_exit)
        await lis.bus.subscribe(lis.bus.subjects.load("gate", "gate-7"), LoadReport, on_load)
        await lis.bus.nc.flush()
        return lis


def _moorage(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "infra.cli", *args], cwd=ROOT,
                            env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


async def test_systemd_execstoppost_announces_the_unit_s_end(nats, gate_config):
    lis = await Listener.start(nats)
    env = {"EXIT_CODE": "killed", "EXIT_STATUS": "KILL", "SERVICE_RESULT": "signal", "INVOCATION_ID": "9c1d" * 8,
           "MAINPID": "4321"}
    proc = _moorage("exited", "gate", "--config", str(gate_config), env=env)
    assert await asyncio.to_thread(proc.wait, 30) == 0, proc.stderr.read().decode()
    msg = await asyncio.wait_for(lis.exits.get(), 10)
    assert (msg.role, msg.instance, msg.boot, msg.how, msg.clean, msg.pid, msg.source) == \
        ("gate", "gate-7", "9c1d" * 8, "killed by SIGKILL", False, 4321, "systemd")
    await lis.bus.close()


async def test_execstoppost_without_a_bus_still_exits_0(tmp_path):
    path = tmp_path / "gate.toml"
    path.write_text('[bus]\nurl = "nats://127.0.0.1:1"\nconnect_timeout_s = 1.0\n')
    proc = _moorage("exited", "gate", "--config", str(path), env={"EXIT_CODE": "killed", "EXIT_STATUS": "KILL"})
    assert await asyncio.to_thread(proc.wait, 30) == 0  # a unit's stop never fails over the announcement
    assert b"could not announce" in proc.stderr.read()


async def test_watch_announces_a_killed_service_with_the_boot_its_reports_carried(nats, gate_config):
    """`moorage watch` (compose's command): kill -9 the service under it; the announcement names the process
    peers heard from, within a second, and the watcher exits as the service did (128 + 9)."""
    lis = await Listener.start(nats)
    watcher = _moorage("watch", "gate", "--config", str(gate_config))
    try:
        boot = await asyncio.wait_for(lis.boots.get(), 60)
        [child] = _children(watcher.pid)
        killed = time.monotonic()
        os.kill(child, signal.SIGKILL)
        msg = await asyncio.wait_for(lis.exits.get(), 10)
        announced_s = time.monotonic() - killed
        assert (msg.role, msg.instance, msg.boot, msg.how, msg.clean, msg.pid, msg.source) == \
            ("gate", "gate-7", boot, "killed by SIGKILL", False, child, "watch")
        assert announced_s < 1.0, f"announced {announced_s:.2f} s after the kill"
        assert await asyncio.to_thread(watcher.wait, 30) == 128 + 9
    finally:
        if watcher.poll() is None:
            watcher.kill()
        await lis.bus.close()


async def test_watch_forwards_sigterm_and_announces_a_clean_stop(nats, gate_config):
    lis = await Listener.start(nats)
    watcher = _moorage("watch", "gate", "--config", str(gate_config))
    try:
        boot = await asyncio.wait_for(lis.boots.get(), 60)
        watcher.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(watcher.wait, 30) == 0
        msg = await asyncio.wait_for(lis.exits.get(), 10)
        assert (msg.boot, msg.how, msg.clean) == (boot, "exit code 0", True)
    finally:
        if watcher.poll() is None:
            watcher.kill()
        await lis.bus.close()
