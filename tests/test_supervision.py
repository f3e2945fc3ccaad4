"""`moorage up` heals itself: Restart=on-failure for every service and the nats-server, and a launcher
killed with kill -9 takes every child along and leaves nothing the next start cannot clean.

The first tests drive the Supervisor with small real processes; the rest run the real system on the tiny
model, kill -9 one process at a time and measure the time from the kill to the first request that
succeeds again (printed; run with -s to see it)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from infra.procs import ProcId, wait_gone
from infra.runstate import clean_stale, read_state, write_state
from infra.supervise import RestartPolicy, Supervisor, describe_exit
from infra.up import NATS_CHILD, UpConfig, launched
from shared.config import ConfigError, load_config
from shared.sockets import free_port, listen
from tests.natsbus import latest_reports

FAST = RestartPolicy(backoff_s=0.05, backoff_max_s=0.2, reset_after_s=60)


# --- the policy and the supervisor, with small processes ---------------------------------------------

def test_backoff_doubles_to_its_cap():
    p = RestartPolicy()
    assert [p.delay(n) for n in range(1, 8)] == [0.5, 1, 2, 4, 8, 10, 10]
    assert p.restarts(1) and p.restarts(-9) and not p.restarts(0)
    assert not RestartPolicy(mode="no").restarts(-9)
    with pytest.raises(ConfigError):
        RestartPolicy(mode="always")
    with pytest.raises(ConfigError, match="restart"):
        load_config(UpConfig, overrides=["up.restart_backoff_s=0"], env={})
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(3) == "exit code 3"


class Events:
    """Collects the supervisor's console lines; wait_for blocks until one matches (no polling)."""

    def __init__(self):
        self.lines: list[str] = []
        self.cond = threading.Condition()

    def say(self, line: str) -> None:
        with self.cond:
            self.lines.append(line)
            self.cond.notify_all()

    def wait_for(self, text: str, count: int = 1, timeout: float = 10.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: sum(text in x for x in self.lines) >= count, timeout), self.lines


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_a_crashed_child_is_restarted_with_backoff_and_the_others_keep_running():
    ev = Events()
    sup = Supervisor(FAST, say=ev.say)
    try:
        a, b = sup.add("a", sleeper), sup.add("b", sleeper)
        sup.arm()
        a.kill()
        ev.wait_for("a restarted")
        first = sup.children["a"].process
        assert first.pid != a.pid and first.poll() is None
        assert b.poll() is None and sup.children["b"].restarts == 0  # untouched
        first.kill()
        ev.wait_for("a restarted", 2)
        assert sup.children["a"].restarts == 2 and sup.children["a"].failures == 2
        assert any("restarting in 0.1 s" in x for x in ev.lines)  # the second crash in a row waits twice as long
    finally:
        sup.stop(5)
    assert all(c.process.poll() is not None for c in sup.children.values())


def test_a_clean_exit_is_not_restarted_and_a_start_up_crash_is_reported():
    ev = Events()
    sup = Supervisor(FAST, say=ev.say)
    try:
        sup.add("early", lambda: subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]))
        assert sup.failed_event.wait(10) and sup.failed == ["early"]
        assert sup.children["early"].last_exit == "exit code 3" and sup.children["early"].restarts == 0
        sup.arm()
        done = sup.add("done", lambda: subprocess.Popen([sys.executable, "-c", "pass"]))
        ev.wait_for("done stopped (exit code 0); not restarted")
        assert done.returncode == 0 and sup.children["done"].restarts == 0
    finally:
        sup.stop(5)


def test_stop_takes_a_wave_at_a_time_in_reverse_start_order(tmp_path):
    """Children in the same stop wave get SIGTERM together, and the next wave only once all of them exited:
    each child logs the SIGTERM, lingers 0.5 s and logs its exit, so a stop one child at a time would put an
    exit between the two engines' SIGTERMs."""
    log = tmp_path / "log"
    child = ("import os, signal, sys, time\n"
             "name, log = sys.argv[1], sys.argv[2]\n"
             "def say(w):\n"
             "    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)\n"
             "    os.write(fd, f'{w} {name}\\n'.encode())\n"
             "    os.close(fd)\n"
             "def term(*_):\n"
             "    say('term')\n"
             "    time.sleep(0.5)\n"
             "    say('exit')\n"
             "    sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, term)\n"
             "say('ready')\n"
             "time.sleep(600)\n")
    waves = {"master": 2, "prefill": 1, "decode": 1, "router": 0}
    sup = Supervisor(FAST, stop_wave=lambda name: waves[name])
    try:
        for name in waves:  # start order: master first, router last
            sup.add(name, lambda name=name: subprocess.Popen([sys.executable, "-c", child, name, str(log)]))
        deadline = time.monotonic() + 30
        while not log.exists() or log.read_text().count("ready") < 4:
            assert time.monotonic() < deadline, "children did not start"
            time.sleep(0.05)
    finally:
        sup.stop(10)
    lines = [x for x in log.read_text().splitlines() if not x.startswith("ready")]
    assert lines[:2] == ["term router", "exit router"]
    assert sorted(lines[2:4]) == ["term decode", "term prefill"]  # together: neither exited before both heard it
    assert sorted(lines[4:6]) == ["exit decode", "exit prefill"]
    assert lines[6:] == ["term master", "exit master"]  # after the whole wave before it
    assert all(c.process.returncode == 0 for c in sup.children.values())


def test_children_die_with_the_supervisor_thread_owner(tmp_path):
    """PR_SET_PDEATHSIG set by a child spawned on the supervisor thread: the process that runs the supervisor,
    killed with kill -9, takes the child along (the thread that spawned it lived until then)."""
    script = tmp_path / "owner.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "from infra.procs import die_with_parent\n"
        "from infra.supervise import Supervisor\n"
        "s = Supervisor()\n"
        "p = s.add('x', lambda: subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
        "                                        preexec_fn=die_with_parent()))\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(600)\n")
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parent.parent)
    child = ProcId.of(int(owner.stdout.readline()))
    assert child is not None and child.alive()
    owner.kill()
    owner.wait()
    assert wait_gone([child], 10) == []


def test_clean_stale_stops_only_our_leftovers_and_refuses_a_live_launcher(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "nats").mkdir()
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", str(run)])  # names the run dir
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])           # does not
    try:
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        write_state(run, {"launcher": [gone.pid, 1], "procs": {
            "store-0": ProcId.of(ours.pid).to_json(), "gate-0": ProcId.of(other.pid).to_json()}})
        cleaned = clean_stale(run)
        assert ours.wait(10) == -signal.SIGTERM
        assert other.poll() is None  # not ours: left alone
        assert not (run / "up.json").exists() and not (run / "nats").exists()
        assert any("store-0" in line for line in cleaned)
        write_state(run, {"launcher": ProcId.of(os.getpid()).to_json()})  # a launcher that is alive
        with pytest.raises(RuntimeError, match="is running"):
            clean_stale(run)
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()


def test_a_second_up_on_a_running_run_dir_refuses_and_leaves_its_files(tmp_path):
    from infra.up import Launcher

    run = tmp_path / "run"
    run.mkdir()
    write_state(run, {"launcher": ProcId.of(os.getpid()).to_json(), "nats_url": "nats://127.0.0.1:1"})
    (run / "nats-credential.json").write_text("{}")
    launcher = Launcher(load_config(UpConfig, overrides=[f"up.run_dir={run}", "up.model=tiny"], env={}),
                        say=lambda line: None)
    with pytest.raises(RuntimeError, match="is running"):
        launcher.start()
    launcher.stop()
    assert read_state(run)["nats_url"] == "nats://127.0.0.1:1" and (run / "nats-credential.json").exists()


def test_a_router_port_in_use_fails_the_start_before_anything_runs(tmp_path):
    from infra.up import Launcher

    with listen("127.0.0.1", 0, "squatter") as taken:
        port = taken.getsockname()[1]
        launcher = Launcher(load_config(UpConfig, overrides=[f"up.run_dir={tmp_path / 'run'}", "up.model=tiny",
                                                             f"up.port={port}"], env={}), say=lambda line: None)
        try:
            with pytest.raises(OSError, match=f"router cannot listen on 127.0.0.1:{port}"):
                launcher.start()
            assert launcher.supervisor.children == {} and launcher.nats is None
        finally:
            launcher.stop()


def test_a_service_that_dies_starting_is_named_with_the_end_of_its_log(tmp_path):
    """The router cannot open its ops port (taken): the start fails at once, and the error carries why."""
    with listen("127.0.0.1", 0, "squatter") as taken:
        port = taken.getsockname()[1]
        cfg = load_config(UpConfig, overrides=[
            "up.model=tiny", "up.port=0", f"up.run_dir={tmp_path / 'run'}", "up.pool=false",
            "up.kv_memory=256MiB", f"router.http.port={port}"], env={})
        with pytest.raises(RuntimeError) as failed, launched(cfg):
            pass
    message = str(failed.value)
    assert "router-0 exited during start-up" in message and "--- router-0 (exit code" in message
    assert f"cannot listen on 127.0.0.1:{port}" in message, message


def test_a_start_that_times_out_names_who_is_missing_with_the_end_of_their_logs(tmp_path):
    """Not ready in time (here: a 1 s limit no engine meets): the error lists the instances the router has
    not seen ready, with each one's last log lines and the router's, since CI keeps no run directory."""
    cfg = load_config(UpConfig, overrides=[
        "up.model=tiny", "up.port=0", f"up.run_dir={tmp_path / 'run'}", "up.pool=false",
        "up.kv_memory=256MiB", "up.ready_timeout_s=1"], env={})
    with pytest.raises(TimeoutError) as failed, launched(cfg):
        pass
    message = str(failed.value)
    assert "not ready after 1 s (not reported ready: " in message and "prefill-0" in message, message
    assert "--- prefill-0 (running), last lines of its log:" in message and "--- router-0 (" in message


def test_systems_side_by_side_start_together_serve_apart_and_all_stop(tmp_path):
    """launched_side_by_side (bench.agentic.tiers' six systems): each answers on its own URL and bus, and
    after the block no process of either is left."""
    from infra.up import launched_side_by_side

    cfgs = {name: load_config(UpConfig, overrides=[
        "up.model=tiny", "up.port=0", f"up.run_dir={tmp_path / name}", "up.pool=false", "up.kv_memory=256MiB"],
        env={}) for name in ("a", "b")}
    with launched_side_by_side(cfgs) as systems:
        assert list(systems) == ["a", "b"]
        (la, ua), (lb, ub) = systems["a"], systems["b"]
        assert ua != ub and la.nats.url != lb.nats.url
        assert complete(ua) and complete(ub)
        procs = [ProcId.of(p.pid) for launcher in (la, lb) for p in launcher.procs.values()]
        assert len(procs) == 2 * len(la.procs) and all(p is not None and p.alive() for p in procs)
    assert wait_gone(procs, 1) == []  # stop() waited for every child


# --- the real system --------------------------------------------------------------------------------

def complete(base: str, timeout: float = 5.0) -> bool:
    try:
        r = httpx.post(base + "/v1/completions", timeout=timeout,
                       json={"model": "tiny", "prompt": "The sea is", "max_tokens": 4, "ignore_eos": True})
        return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def first_success(base: str, since: float, within: float) -> float | None:
    """Seconds from `since` to the first request that completes, or None if none did within `within`."""
    while time.monotonic() - since < within:
        if complete(base, timeout=min(5.0, max(0.5, within - (time.monotonic() - since)))):
            return time.monotonic() - since
        time.sleep(0.2)  # a failed try: the next one a moment later
    return None


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("heal")
    cfg = load_config(UpConfig, overrides=[
        "up.model=tiny", "up.port=0", f"up.run_dir={run_dir}", "up.ready_timeout_s=180",
        "up.kv_memory=256MiB", "up.store_bytes=67108864", "gate.gate.admission_wait_s=2"], env={})
    events = Events()
    with launched(cfg) as (launcher, base):
        launcher._say = events.say
        yield launcher, base, events


def reported_ready(launcher, instances: set[str]) -> bool:
    """Every one of `instances` publishes a ready load report on the bus (waits up to ~20 s for them)."""
    seen = asyncio.run(latest_reports(launcher.nats.url, 0.5,
                                      enough=lambda s: all(i in s and s[i].ready for i in instances)))
    return all(i in seen and seen[i].ready for i in instances)


# roles in the order they are killed; each must be back and serving within the bound
KILLS = ["store-0", NATS_CHILD, "master-0", "gate-0", "router-0", "decode-0", "prefill-0"]
BOUND_S = {"store-0": 10.0, NATS_CHILD: 10.0}  # the goal, asserted; the others are measured
OTHER_BOUND_S = 45.0                             # (restarting an engine loads the model: generous on 2 cores)


@pytest.mark.parametrize("victim", KILLS)
def test_kill_9_is_restarted_and_serving_resumes(system, victim):
    launcher, base, events = system
    assert first_success(base, time.monotonic(), 30) is not None, "not serving before the kill"
    before = dict(launcher.supervisor.pids())
    restarts = launcher.restarts()[victim]
    bound = BOUND_S.get(victim, OTHER_BOUND_S)
    t0 = time.monotonic()
    os.kill(before[victim], signal.SIGKILL)
    took = first_success(base, t0, bound)
    print(f"\nkill -9 {victim}: first success after {took if took is None else round(took, 2)} s", end="")
    assert took is not None, f"no request succeeded within {bound} s of killing {victim}"
    events.wait_for(f"{victim} restarted", restarts + 1, timeout=bound)
    child = launcher.supervisor.children[victim]
    assert launcher.restarts()[victim] == restarts + 1 and child.process.pid != before[victim]
    assert child.last_exit == "killed by SIGKILL"
    # the restarted process (after a nats restart: every service, reconnected) reports ready on the bus
    reporting = {n for n in before if n.split("-")[0] in ("master", "store", "gate", "decode", "prefill")}
    assert reported_ready(launcher, reporting if victim in (NATS_CHILD, "router-0") else {victim})
    print(f"; {victim} restarted and every instance reporting ready after {time.monotonic() - t0:.2f} s")
    assert complete(base, timeout=30)
    after = launcher.supervisor.pids()
    assert {n: p for n, p in after.items() if n != victim} == {n: p for n, p in before.items() if n != victim}
    state = read_state(launcher.run_dir)
    assert state["pids"][victim] == child.process.pid and state["restarts"][victim] == restarts + 1


# --- kill -9 of the launcher -----------------------------------------------------------------------

def start_up(run_dir: Path, port: int) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([sys.executable, "-m", "infra.cli", "up", "--model", "tiny", "--port", str(port),
                             "--set", f"up.run_dir={run_dir}", "--set", "up.ready_timeout_s=180",
                             "--set", "up.kv_memory=256MiB", "--set", "up.store_bytes=67108864"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if "is ready" in line or "stopped" in line:
            break
    assert any("is ready" in x for x in out), "".join(out)
    return proc, out


def test_launcher_killed_with_kill_9_takes_every_child_and_the_next_up_cleans_up(tmp_path):
    run_dir, port = tmp_path / "run", free_port()
    first, _ = start_up(run_dir, port)
    second = None
    try:
        state = json.loads((run_dir / "up.json").read_text())
        children = [ProcId.from_json(v) for v in state["procs"].values()]
        assert NATS_CHILD in state["procs"] and all(p.alive() for p in children)
        t0 = time.monotonic()
        first.kill()
        first.wait()
        assert wait_gone(children, 60) == [], "children outlived the launcher"
        print(f"\nlauncher kill -9: every child gone after {time.monotonic() - t0:.1f} s")
        assert (run_dir / "up.json").exists()  # stale, for the next start to clean
        second, out = start_up(run_dir, port)
        assert any("stale up.json" in x for x in out), "".join(out)
        assert complete(f"http://127.0.0.1:{port}", timeout=30)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(60)
    assert not (run_dir / "up.json").exists()
