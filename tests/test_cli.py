"""`moorage generate` as a user runs it: a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_tiny_is_deterministic():
    a = run_cli("generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "8", "--show-tokens")
    b = run_cli("generate", "--model", "tiny", "--prompt", "hello", "--max-tokens", "8", "--show-tokens")
    assert a.returncode == 0, a.stderr
    assert "output_ids=" in a.stderr
    assert a.stdout == b.stdout and a.stderr == b.stderr


def test_generate_rejects_bad_arguments():
    r = run_cli("generate", "--model", "tiny", "--prompt", "x", "--max-tokens", "0")
    assert r.returncode == 2 and "max_tokens" in r.stderr
    r = run_cli("generate", "--model", "no-such-model", "--prompt", "x")
    assert r.returncode == 2 and "smollm2-135m" in r.stderr


@pytest.mark.slow
def test_generate_chat_answers_paris():
    r = run_cli("generate", "--model", "smollm2-135m", "--chat", "--prompt", "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


# --- help and status -------------------------------------------------------------------------------

def _main(argv: list[str]) -> int:
    """infra.cli.main in-process; a sub-parser's --help exits through SystemExit."""
    from infra.cli import main

    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


@pytest.mark.parametrize("argv, expect", [
    (["trace", "--help"], "usage: moorage trace"),
    (["trace", "synth", "--help"], "--sessions"),
    (["bench", "--help"], "aiperf"),
    (["bench", "-h"], "sweep"),
    (["bench", "agentic", "--help"], "--real-think"),
    (["bench", "aiperf", "--help"], "--request-count"),
    (["serve", "--help"], "master"),
    (["serve", "gate", "--help"], "--print-config"),
])
def test_help_prints_help(argv, expect, capsys):
    assert _main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and expect in out


def test_help_as_a_user_runs_it():
    for cmd in (["trace", "--help"], ["bench", "--help"], ["serve", "--help"]):
        r = run_cli(*cmd, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("usage: moorage " + cmd[0]), (cmd, r.stderr)


def test_missing_or_unknown_names_fail_with_the_listing(capsys):
    assert _main(["bench"]) == 2
    assert "agentic" in capsys.readouterr().err
    assert _main(["serve", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown name 'nope'" in err and "prefill" in err


def test_status_says_when_no_system_is_there(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert _main(["status", "--run-dir", str(missing)]) == 1
    err = capsys.readouterr().err
    assert "no system found" in err and str(missing) in err
    assert _main(["status", "--run-dir", str(tmp_path)]) == 1  # exists, but no up.json
    err = capsys.readouterr().err
    assert "no system found in" in err and "up.json" in err
    # a stale up.json: the launcher was killed, every recorded process is gone
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "up.json").write_text(json.dumps({"nats_url": "nats://127.0.0.1:9", "router_url": "http://x",
                                                  "pids": {"router-0": gone.pid}}))
    assert _main(["status", "--run-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "no system running" in err and "stale" in err


def test_status_says_when_the_bus_is_not_there(tmp_path, capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert _main(["status", "--nats-url", f"nats://127.0.0.1:{port}", "--run-dir", str(tmp_path)]) == 1
    assert "cannot reach the bus" in capsys.readouterr().err


def _run_status(tmp_path, nats_url: str) -> tuple[subprocess.CompletedProcess, float]:
    import os
    import time

    from infra.procs import ProcId

    me = ProcId.of(os.getpid())  # a live process, so the state is not stale
    (tmp_path / "up.json").write_text(json.dumps({"nats_url": nats_url, "router_url": "http://127.0.0.1:9",
                                                  "launcher": me.to_json(), "procs": {"router-0": me.to_json()}}))
    t0 = time.monotonic()
    r = run_cli("status", "--run-dir", str(tmp_path), timeout=60)
    return r, time.monotonic() - t0


def test_status_with_the_bus_down_is_one_line_not_a_hang(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on: the nats-server is down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r, took = _run_status(tmp_path, f"nats://127.0.0.1:{port}")
    assert r.returncode == 1 and took < 30
    assert r.stderr.count("\n") == 1 and "NATS is unreachable" in r.stderr and "Traceback" not in r.stderr
    # a server that takes the connection but never speaks (stopped, or not NATS): bounded as well
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        r, took = _run_status(tmp_path, f"nats://127.0.0.1:{mute.getsockname()[1]}")
    assert r.returncode == 1 and took < 30
    assert r.stderr.count("\n") == 1 and "NATS is unreachable" in r.stderr and "Traceback" not in r.stderr


def test_status_table_shows_restarts():
    from infra.status import _restarts_line, format_table
    from shared.messages import LoadReport

    reports = {("store", "store-0"): (LoadReport(instance="store-0", role="store", ready=True, capacity_tokens=0), 0.0)}
    table = format_table(reports, {"store-0": 2})
    assert "RESTARTS" in table.splitlines()[0] and table.splitlines()[1].split()[8] == "2"
    line = _restarts_line({"restarts": {"nats-server": 1, "store-0": 0}, "last_exit": {"nats-server": "killed by SIGKILL"}})
    assert line == "restarts: nats-server 1 (last: killed by SIGKILL), store-0 0"
