"""`moorage status`: every service's health and load, as they report it on the bus."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

from shared.bus import Bus, BusConfig
from shared.messages import LoadReport


async def collect_reports(nats_url: str, prefix: str = "moorage", seconds: float = 1.5) -> dict:
    bus = await Bus.connect(BusConfig(url=nats_url, prefix=prefix), "moorage-status")
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
        return f"segment {d.get('segment_bytes', 0) // mib} MiB{' (huge pages)' if d.get('hugepages') else ''}"
    if r.role == "prefill" and d.get("pool"):
        p = d["pool"]
        return (f"pool: {p.get('restored_chunks', 0)} chunks restored, {p.get('saved_chunks', 0)} saved, "
                f"{p.get('verify_failures', 0)} rejected")
    if r.role == "decode":
        return f"{d.get('landing', 0)} landing, {d.get('preemptions', 0)} preemptions"
    return ""


def format_table(reports: dict) -> str:
    rows = [("ROLE", "INSTANCE", "READY", "KV CAPACITY", "KV FREE", "RUNNING", "WAITING", "QUEUED TOK", "DETAIL")]
    order = {"router": 0, "gate": 1, "prefill": 2, "decode": 3, "master": 4, "store": 5}
    for (role, inst), (r, _) in sorted(reports.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1])):
        rows.append((role, inst, "yes" if r.ready else "no", str(r.capacity_tokens), str(r.free_tokens),
                     str(r.running), str(r.waiting), str(r.queued_tokens), _detail(r)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def run_status(nats_url: str | None, run_dir: str, prefix: str) -> int:
    state_file = Path(run_dir) / "up.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    url = nats_url or state.get("nats_url")
    if not url:
        print(f"moorage status: no running `moorage up` found in {run_dir}; pass --nats-url")
        return 1
    reports = asyncio.run(collect_reports(url, prefix))
    print(f"bus: {url}")
    if state.get("router_url"):
        print(f"router: {state['router_url']}/v1  health: {router_health(state['router_url'])}")
    if not reports:
        print("no service reported in 1.5 s")
        return 1
    print(format_table(reports))
    return 0 if all(r.ready for r, _ in reports.values()) else 1
