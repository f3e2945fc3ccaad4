"""`moorage status`: every service's health and load, as they report it on the bus, and how often
`moorage up` restarted each. Never hangs: an unreachable or refusing bus is one line and exit 1 within a
few seconds. The bus credential of the embedded server is read from the run directory."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

from infra.natsd import CREDENTIAL_FILE, NatsCredential
from infra.runstate import STATE_FILE, read_state, recorded_processes
from shared.bus import Bus, BusConfig
from shared.messages import LoadReport


class BusUnreachable(RuntimeError):
    """The bus did not take our connection in time; the message says why, in one line."""


async def collect_reports(nats_url: str, prefix: str = "moorage", seconds: float = 1.5,
                          connect_timeout_s: float = 3.0, credential: NatsCredential | None = None) -> dict:
    last: list[Exception] = []

    async def quiet(e: Exception) -> None:  # the bus client would print a traceback per failed try
        last[:] = [e]

    auth = {"user": credential.user, "password": credential.password} if credential else {}
    config = BusConfig(url=nats_url, prefix=prefix, connect_timeout_s=connect_timeout_s, **auth)
    try:  # bounded: the bus client retries a refused first connect for as long as it is let
        bus = await asyncio.wait_for(Bus.connect(config, "moorage-status", error_cb=quiet), connect_timeout_s)
    except asyncio.TimeoutError:
        why = f"{type(last[0]).__name__}: {last[0]}" if last else f"no answer in {connect_timeout_s:g} s"
        raise BusUnreachable(why) from None
    reports: dict[tuple[str, str], tuple[LoadReport, float]] = {}

    async def on_load(msg: LoadReport, raw) -> None:
        reports[(msg.role, msg.instance)] = (msg, time.time())

    await bus.subscribe(bus.subjects.load_all, LoadReport, on_load)
    await asyncio.sleep(seconds)
    await bus.close()
    return reports


def router_health(url: str) -> str:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return f"{r.status} {r.read().decode()[:80]}"
    except urllib.error.HTTPError as e:
        return f"{e.code} {e.read().decode()[:120]}"
    except OSError as e:
        return f"unreachable ({e})"


def _detail(r: LoadReport) -> str:
    d, mib = r.detail or {}, 1 << 20
    if r.role == "master":
        return (f"pool {d.get('used_bytes', 0) // mib}/{d.get('capacity_bytes', 0) // mib} MiB, "
                f"{d.get('objects', 0)} objects, {d.get('evictions', 0)} evicted, {d.get('restarts', 0)} restarts")
    if r.role == "store":
        disk = d.get("disk")
        tier = (f", disk {disk.get('bytes', 0) // mib}/{disk.get('capacity', 0) // mib} MiB, {disk.get('objects', 0)} "
                f"objects{'' if disk.get('writable', True) else ' (writes off: ' + str(disk.get('off_reason')) + ')'}"
                if disk else ", no disk tier")
        return f"segment {d.get('segment_bytes', 0) // mib} MiB{' (huge pages)' if d.get('hugepages') else ''}{tier}"
    if r.role == "prefill":
        parts = []
        if d.get("ranks"):  # prefill.pp > 1: each rank's layers and process
            parts.append("ranks: " + ", ".join(
                f"{k['rank']}:L{k['layers'][0]}-{k['layers'][1]} pid {k['pid']}{'' if k['alive'] else ' (dead)'}"
                for k in d["ranks"]) + f" (bubble {d.get('pipeline', {}).get('bubble', 0):.0%})")
        if d.get("pool"):
            p = d["pool"]
            parts.append(f"pool: {p.get('restored_chunks', 0)} chunks restored, {p.get('saved_chunks', 0)} saved, "
                         f"{p.get('verify_failures', 0)} rejected")
        return "; ".join(parts)
    if r.role == "decode":
        ranks = "; ranks: " + ", ".join(f"{k['rank']}:{k['tokens']} pid {k['pid']}{'' if k['alive'] else ' (dead)'}"
                                        for k in d["ranks"]) if d.get("ranks") else ""
        return f"{d.get('landing', 0)} landing, {d.get('preemptions', 0)} preemptions{ranks}"
    return ""


def format_table(reports: dict, restarts: dict[str, int] | None = None) -> str:
    restarts = restarts or {}
    rows = [("ROLE", "INSTANCE", "READY", "KV CAPACITY", "KV FREE", "RUNNING", "WAITING", "QUEUED TOK", "RESTARTS",
             "DETAIL")]
    order = {"router": 0, "gate": 1, "prefill": 2, "decode": 3, "master": 4, "store": 5}
    for (role, inst), (r, _) in sorted(reports.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1])):
        rows.append((role, inst, "yes" if r.ready else "no", str(r.capacity_tokens), str(r.free_tokens),
                     str(r.running), str(r.waiting), str(r.queued_tokens), str(restarts.get(inst, "-")),
                     _detail(r)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def _refused(nats_url: str) -> str:
    """Why the bus's first address does not take a TCP connection ("" if it does, or cannot be told)."""
    import socket
    from urllib.parse import urlparse

    try:
        u = urlparse(nats_url.split(",")[0].strip())
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 4222), timeout=2):
            return ""
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def _fail(message: str) -> int:
    print(f"moorage status: {message}", file=sys.stderr)
    return 1


def find_system(run_dir: str | os.PathLike) -> tuple[dict | None, str]:
    """(the state `moorage up` left in run_dir, "") while that system runs, else (None, why not)."""
    run = Path(run_dir)
    state_file = run / STATE_FILE
    if not run.is_dir():
        return None, (f"no system found: {run} does not exist (start one with `moorage up`, or pass the "
                      f"--run-dir it uses (up.run_dir), or --nats-url)")
    if not state_file.exists():
        return None, (f"no system found in {run}: no {STATE_FILE} there (a running `moorage up` writes it and "
                      f"removes it when it stops); pass the --run-dir of a running one, or --nats-url")
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError) as e:
        return None, f"no system found in {run}: {state_file} is unreadable ({e})"
    procs = recorded_processes(state)
    if (state.get("pids") or state.get("procs")) and not any(p.alive() for p in procs.values()):
        return None, (f"no system running in {run}: none of the processes recorded in {state_file} "
                      f"is alive (a `moorage up` that did not stop cleanly; the file is stale)")
    if not state.get("nats_url"):
        return None, f"no system found in {run}: {state_file} names no bus (nats_url); pass --nats-url"
    return state, ""


def _restarts_line(state: dict) -> str:
    """"restarts: store-0 1 (last: killed by SIGKILL), nats-server 0, ..." from the launcher's state."""
    restarts, last = state.get("restarts") or {}, state.get("last_exit") or {}
    if not restarts:
        return ""
    return "restarts: " + ", ".join(f"{n} {k}" + (f" (last: {last[n]})" if k and last.get(n) else "")
                                    for n, k in restarts.items())


def run_status(nats_url: str | None, run_dir: str, prefix: str) -> int:
    state: dict = {}
    if not nats_url:
        found, why = find_system(run_dir)
        if found is None:
            return _fail(why)
        state = found
    else:
        state = read_state(Path(run_dir)) or {}
    url = nats_url or state["nats_url"]
    credential = NatsCredential.load(Path(run_dir) / (state.get("credential_file") or CREDENTIAL_FILE))
    refused = _refused(url)
    if refused:
        return _fail(f"NATS is unreachable: cannot reach the bus at {url} ({refused})"
                     + ("" if nats_url else f"; is the system in {run_dir} restarting, starting or stopping?"))
    try:
        reports = asyncio.run(collect_reports(url, prefix, credential=credential))
    except Exception as e:  # timeout, auth, protocol: the bus does not take us
        return _fail(f"NATS is unreachable: cannot reach the bus at {url} ({type(e).__name__}: {e})")
    print(f"bus: {url}" + ("  (user/password from the run directory)" if credential else ""))
    if state.get("router_url"):
        print(f"router: {state['router_url']}/v1  health: {router_health(state['router_url'])}")
    if line := _restarts_line(state):
        print(line)
    if not reports:
        return _fail(f"no service reported on the bus at {url} in 1.5 s")
    print(format_table(reports, state.get("restarts") or {}))
    return 0 if all(r.ready for r, _ in reports.values()) else 1
