"""Router + gate overhead, and where it goes: the overhead part of bench/handoff.py, also runnable alone.

    .venv/bin/python -m bench.overhead --n 200 --out bench/results/overhead.json

On a launched system (tiny model; nats + gate + prefill + decode + router as processes), ~32-token
prompts, max_tokens=1 (the request ends at prefill, no handoff):
(a) POST /v1/completions through the router (one keep-alive connection, non-streaming) vs (b) PrefillSubmit
straight to prefill-0 on the bus and wait for the final TokenChunk (no gate, no HTTP). Interleaved, order
alternating per iteration, after a warm-up; distinct random prompts. (c), after each pair: the same POST
for an unknown model (404 before anything reaches the bus): the floor of the HTTP stack and this client.

The HTTP client is aiohttp by default (`--client httpx` for the one the openai package uses): measured
here against the same FastAPI app, httpx's own work is ~1.1-1.3 ms per request and aiohttp's ~0.2 ms
above a bare socket, which would otherwise count as the router's overhead.

The breakdown of (a) comes from each request's trace: the `router.request` span's stage events
(prepared, routed, admitted, subscribed, acked, assigned, first_chunk, responding), the `gate.admit` span and
the prefill's spans, on the one machine clock (time.time_ns), plus the client's own send / receive times.
Requests admitted overlapped (the default when the gate has room: the submit goes out while the gate
decides) have stages of their own; `--set router.router.overlap_admission=false` measures the sequential path.
(b) is timed by the client at the same points (subscribed, acked, final chunk). Every stage is reported
as its median and p90 over requests; "overhead" rows are (a) - (b) of the p50s and the per-iteration
paired difference.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import torch

from bench._util import machine_info, md_table, percentile, write_result
from shared.bus import Bus, BusConfig
from shared.config import load_config
from shared.engine.models import load_tokenizer
from shared.engine.sampling import SamplingParams
from shared.messages import Ack, PrefillSubmit, TokenChunk
from shared.tracing import read_spans
from infra.up import Launcher, UpConfig

SEED = 20240601
# (stage, from mark, to mark): marks are router.request events, span start/end, the client's send/recv,
# and the gate / prefill spans' edges. Consecutive, so the stages add up to the client's latency.
ROUTER_STAGES = (
    ("http in: client send -> router.request start", "client_send", "span_start"),
    ("prepare: body, pydantic, tokenize, checks", "span_start", "prepared"),
    ("route: Dispatch, prefill pick", "prepared", "routed"),
    ("admit: router -> gate (bus)", "routed", "gate_start"),
    ("admit: gate handler, up to its reply (gate.admit span)", "gate_start", "gate_end"),
    ("admit: gate -> router reply", "gate_end", "admitted"),
    ("subscribe token subject", "admitted", "subscribed"),
    ("submit + Ack round trip", "subscribed", "acked"),
    ("Ack -> first chunk (prefill work + relay)", "acked", "first_chunk"),
    ("collect + shape body", "first_chunk", "responding"),
    ("http out: response -> client", "responding", "client_recv"),
)
# Overlapped admission (router.overlap_admission, the default when the gate has room): the submit goes out
# while the gate decides; `started` = whichever of the gate's reply and prefill's Ack came last.
OVERLAP_STAGES = ROUTER_STAGES[:3] + (
    ("subscribe token subject", "routed", "subscribed"),
    ("admit || submit: until both the gate's reply and the Ack are in", "subscribed", "started"),
    ("DecodeAssign to prefill (publish)", "started", "assigned"),
    ("assigned -> first chunk (rest of prefill work + relay)", "assigned", "first_chunk"),
) + ROUTER_STAGES[-2:]
# Beside the overlapped path (not in its sum): the two round trips it runs at once.
BESIDE_STAGES = (
    ("(beside) admit: router -> gate -> router", "subscribed", "admitted"),
    ("(beside) submit + Ack round trip", "subscribed", "acked"),
)
# After the response went out (off the request's latency, not in the sum): unsubscribe, Release, metrics, span end.
AFTER_STAGES = (("after the response: unsubscribe, Release, metrics, span end, log", "responding", "span_end"),)
DIRECT_STAGES = (
    ("subscribe token subject", "client_send", "subscribed"),
    ("submit + Ack round trip", "subscribed", "acked"),
    ("Ack -> final chunk (prefill work + relay)", "acked", "client_recv"),
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def summary(xs: list[float]) -> dict:
    return {"p50_ms": percentile(xs, 50), "p90_ms": percentile(xs, 90), "p99_ms": percentile(xs, 99),
            "mean_ms": statistics.fmean(xs), "min_ms": min(xs), "max_ms": max(xs)}


class HttpClient:
    """POST JSON on one keep-alive connection: aiohttp (default) or httpx. -> (status, request id, body)."""

    def __init__(self, base: str, kind: str = "aiohttp"):
        self.base, self.kind = base, kind

    async def __aenter__(self) -> "HttpClient":
        self.c = (aiohttp.ClientSession(self.base, connector=aiohttp.TCPConnector(limit=1)) if self.kind == "aiohttp"
                  else httpx.AsyncClient(base_url=self.base, timeout=60))
        await self.c.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.c.__aexit__(*exc)

    async def post(self, path: str, body: dict) -> tuple[int, str, dict]:
        if self.kind == "httpx":
            r = await self.c.post(path, json=body)
            return r.status_code, r.headers.get("x-request-id", ""), r.json()
        async with self.c.post(path, json=body) as r:
            return r.status, r.headers.get("x-request-id", ""), await r.json()


async def bench_overhead(base: str, nats_url: str, model: str, vocab: int, p: dict, g: torch.Generator) -> dict:
    """(a) via router vs (b) direct, interleaved; p: overhead_n, overhead_warm, client. Marks for the breakdown."""
    bus = await Bus.connect(BusConfig(url=nats_url), "bench-overhead")
    subjects, router_ms, direct_ms, router_marks, direct_marks, floor_ms = bus.subjects, [], [], [], [], []
    sampling = SamplingParams(max_tokens=1, ignore_eos=True)
    prompt = lambda: torch.randint(0, vocab, (32,), generator=g).tolist()  # noqa: E731

    async def via_router(client: HttpClient) -> tuple[float, dict]:
        body = {"model": model, "prompt": prompt(), "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        send, t0 = time.time_ns(), time.perf_counter()
        status, rid, out = await client.post("/v1/completions", body)
        assert status == 200, out
        dt, recv = time.perf_counter() - t0, time.time_ns()
        return dt, {"rid": rid, "client_send": send, "client_recv": recv}

    async def http_floor(client: HttpClient) -> float:
        """(c) the same POST, but for an unknown model: HTTP both ways, body parse + validation, a 404 error
        body, and nothing on the bus: the router's HTTP stack and this client, without gate or prefill."""
        body = {"model": "no-such-model", "prompt": prompt(), "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        t0 = time.perf_counter()
        status, _, out = await client.post("/v1/completions", body)
        assert status == 404, out
        return time.perf_counter() - t0

    async def direct() -> tuple[float, dict]:
        rid, ids = f"bench-{uuid.uuid4().hex}", prompt()
        done: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_chunk(raw) -> None:
            chunk = TokenChunk.decode(raw.data)
            if chunk.finished and not done.done():
                done.set_result(chunk)

        marks = {"rid": rid, "client_send": time.time_ns()}
        t0 = time.perf_counter()
        sub = await bus.nc.subscribe(subjects.request_out(rid), cb=on_chunk)
        marks["subscribed"] = time.time_ns()
        ack = await bus.request(subjects.prefill_submit("prefill-0"),
                                PrefillSubmit(rid, ids, sampling, "decode-0"), Ack, timeout=10)
        marks["acked"] = time.time_ns()
        assert ack.ok, ack.error
        chunk = await asyncio.wait_for(done, timeout=30)
        dt = time.perf_counter() - t0
        marks["client_recv"] = time.time_ns()
        await sub.unsubscribe()
        assert chunk.error is None and chunk.finish_reason == "length", chunk
        return dt, marks

    try:
        async with HttpClient(base, p.get("client", "aiohttp")) as client:
            for i in range(p["overhead_warm"] + p["overhead_n"]):
                order = (0, 1, 2) if i % 2 == 0 else (1, 0, 2)  # alternate which of (a), (b) goes first
                for which in order:
                    if which == 2:
                        dt = await http_floor(client)
                        if i >= p["overhead_warm"]:
                            floor_ms.append(dt * 1e3)
                        continue
                    dt, marks = await via_router(client) if which == 0 else await direct()
                    if i >= p["overhead_warm"]:
                        (router_ms if which == 0 else direct_ms).append(dt * 1e3)
                        (router_marks if which == 0 else direct_marks).append(marks)
    finally:
        await bus.close()
    r, d = summary(router_ms), summary(direct_ms)
    return {"model": model, "prompt_tokens": 32, "max_tokens": 1, "n": len(router_ms), "client": p.get("client", "aiohttp"),
            "router": r, "direct": d,
            "overhead_p50_ms": r["p50_ms"] - d["p50_ms"], "overhead_p90_ms": r["p90_ms"] - d["p90_ms"],
            "overhead_p99_ms": r["p99_ms"] - d["p99_ms"],
            "paired_diff": summary([a - b for a, b in zip(router_ms, direct_ms)]),
            "http_floor": summary(floor_ms), "http_floor_ms": floor_ms,
            "router_ms": router_ms, "direct_ms": direct_ms, "router_marks": router_marks,
            "direct_marks": direct_marks}


def wait_router_spans(path: Path, rids: set[str], timeout: float = 30.0) -> dict[str, dict]:
    """{request id: {"router": span, "gate": span}} once every rid has both (spans are exported in batches)."""
    deadline = time.monotonic() + timeout
    while True:
        by_trace, router = {}, {}
        for s in read_spans(path):
            rid = s["attributes"].get("request_id")
            if s["name"] == "router.request" and rid in rids:
                router[rid] = s
            elif s["name"] == "gate.admit":
                by_trace[s["trace_id"]] = s
        got = {rid: {"router": sp, "gate": by_trace.get(sp["trace_id"])} for rid, sp in router.items()}
        if len(got) == len(rids) and all(v["gate"] for v in got.values()):
            return got
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(got)} of {len(rids)} router.request spans (with gate.admit) in {path}")
        time.sleep(0.5)


def breakdown(over: dict, traces: Path) -> dict:
    """Per-stage p50 / p90 (ms) of the router path (from its traces) and of the direct path."""
    """Per-stage p50 / p90 (ms) of the router path (from its traces) and of the direct path. Requests admitted
    sequentially and overlapped have stages of their own (`modes` counts each); "(beside)" rows are not in the sum."""
    spans = wait_router_spans(traces, {m["rid"] for m in over["router_marks"]})
    rows: dict[str, list[float]] = {}
    modes = {"sequential": 0, "overlapped": 0}
    for m in over["router_marks"]:
        sp = spans[m["rid"]]
        marks = {**m, "span_start": sp["router"]["start_ns"], "span_end": sp["router"]["end_ns"],
                 "gate_start": sp["gate"]["start_ns"],
                 "gate_end": next((e["time_ns"] for e in sp["gate"]["events"] if e["name"] == "replied"),
                                  sp["gate"]["end_ns"]),
                 **{e["name"]: e["time_ns"] for e in sp["router"]["events"]}}
        marks.setdefault("responding", marks["span_end"])  # a router that answered after ending its span
        mode = sp["router"]["attributes"].get("admission", "sequential")
        modes[mode] += 1
        if mode == "overlapped":
            marks["started"] = max(marks["admitted"], marks["acked"])
            stages = OVERLAP_STAGES + BESIDE_STAGES + AFTER_STAGES
        else:
            stages = ROUTER_STAGES + AFTER_STAGES
        for name, a, b in stages:
            rows.setdefault(name, []).append((marks[b] - marks[a]) / 1e6)
    direct = {name: [(m[b] - m[a]) / 1e6 for m in over["direct_marks"]] for name, a, b in DIRECT_STAGES}

    def stats(xs: list[float]) -> dict:
        return {"p50_ms": float(np.percentile(xs, 50)), "p90_ms": float(np.percentile(xs, 90)),
                "mean_ms": float(np.mean(xs))}

    return {"modes": modes, "router": {k: stats(v) for k, v in rows.items()},
            "direct": {k: stats(v) for k, v in direct.items()}}


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """User + system CPU seconds so far of each process (gone: left out)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
    return out


def cpu_per_request(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    """ms of CPU per measured iteration (one (a), one (b), one (c)) of each process."""
    return {k: (after[k] - before[k]) * 1e3 / n for k in before if k in after}


def settle(pids: dict[str, int], quiet_ms_per_s: float = 50.0, window_s: float = 0.5, timeout_s: float = 60.0) -> None:
    """Wait until the services are quiet: prefill and decode keep warming up for a few seconds after they
    report ready (~0.4 s of CPU per second each, measured), which would load the first measured requests."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        a = cpu_seconds(pids)
        time.sleep(window_s)
        busy = sum(cpu_per_request(a, cpu_seconds(pids), window_s).values())
        if busy < quiet_ms_per_s:
            return
    log(f"the system did not go quiet within {timeout_s:.0f} s")


def run(model: str, p: dict) -> dict:
    g = torch.Generator().manual_seed(SEED)
    with tempfile.TemporaryDirectory(prefix=f"bench-overhead-{model}-") as run_dir:
        cfg = load_config(UpConfig, overrides=[f"up.model={model}", "up.port=0", f"up.run_dir={run_dir}",
                                               "up.ready_timeout_s=600", *p.get("set", [])])
        launcher = Launcher(cfg)
        try:
            base = launcher.start()
            launcher.wait_ready(base)
            log(f"{model}: system ready at {base}")
            vocab = load_tokenizer(model)[0].vocab_size
            pids = {k: v.pid for k, v in launcher.procs.items()}
            if launcher.nats is not None and getattr(launcher.nats, "process", None) is not None:
                pids["nats-server"] = launcher.nats.process.pid
            settle(pids)
            pids["bench"] = os.getpid()
            idle0 = cpu_seconds(pids)
            time.sleep(2.0)  # what the system burns with no request at all
            cpu0 = cpu_seconds(pids)
            over = asyncio.run(bench_overhead(base, launcher.nats.url, model, vocab, p, g))
            cpu1 = cpu_seconds(pids)
            over["cpu_ms_per_iteration"] = cpu_per_request(cpu0, cpu1, p["overhead_warm"] + p["overhead_n"])
            over["idle_cpu_ms_per_s"] = cpu_per_request(idle0, cpu0, 2)
            over["breakdown"] = breakdown(over, launcher.run_dir / "traces.jsonl")
            return over
        finally:
            launcher.stop()


def table(o: dict) -> str:
    t = md_table(["path (tiny, 32 tok, max_tokens=1)", "N", "p50 ms", "p90 ms", "p99 ms", "mean ms"],
                 [["(a) router: HTTP + gate + prefill", o["n"], o["router"]["p50_ms"], o["router"]["p90_ms"],
                   o["router"]["p99_ms"], o["router"]["mean_ms"]],
                  ["(b) direct PrefillSubmit on the bus", o["n"], o["direct"]["p50_ms"], o["direct"]["p90_ms"],
                   o["direct"]["p99_ms"], o["direct"]["mean_ms"]],
                  ["(c) router HTTP only: same POST, unknown model (404), no bus", len(o["http_floor_ms"]),
                   o["http_floor"]["p50_ms"], o["http_floor"]["p90_ms"], o["http_floor"]["p99_ms"],
                   o["http_floor"]["mean_ms"]],
                  ["overhead (a) - (b) of percentiles", o["n"], o["overhead_p50_ms"], o.get("overhead_p90_ms", ""),
                   o["overhead_p99_ms"], ""],
                  ["overhead, paired per-iteration a - b", o["n"], o["paired_diff"]["p50_ms"],
                   o["paired_diff"].get("p90_ms", ""), o["paired_diff"]["p99_ms"], o["paired_diff"]["mean_ms"]]])
    if o.get("cpu_ms_per_iteration"):
        cpu, idle = o["cpu_ms_per_iteration"], o.get("idle_cpu_ms_per_s", {})
        t += ("\n\nCPU per process (/proc user+system): ms per iteration of (a)+(b)+(c), and ms per second idle "
              "before:\n\n") + md_table(["process", "ms / iteration", "idle ms / s"], [[k, v, idle.get(k, "")] for k, v in cpu.items()])
    b = o.get("breakdown")
    if not b:
        return t
    rows = [[f"(a) {k}", v["p50_ms"], v["p90_ms"], v["mean_ms"]] for k, v in b["router"].items()]
    rows += [["(b) " + k, v["p50_ms"], v["p90_ms"], v["mean_ms"]] for k, v in b["direct"].items()]
    modes = ", ".join(f"{k} {v}" for k, v in b.get("modes", {}).items())
    return t + (f"\n\nBreakdown (per stage over requests; stages of a path add up to its latency, \"(beside)\" rows "
                f"run inside them; router admissions: {modes}):\n\n") + md_table(
        ["stage", "p50 ms", "p90 ms", "mean ms"], rows)


def report(r: dict) -> str:
    m = r["machine"]
    return (f"## moorage router + gate overhead\n\n{m['cpu_count']} CPUs, {m['date']}; load avg start "
            f"{m['loadavg_1m_5m_15m'][0]:.2f} / end {m['loadavg_at_end'][0]:.2f}\n\n" + table(r["overhead"]))


def plot(r: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    o = r["overhead"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 6))
    for xs, label in ((o["router_ms"], "(a) via router (HTTP + gate)"), (o["direct_ms"], "(b) direct on the bus")):
        s = sorted(xs)
        ax.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post",
                label=f"{label}: p50 {percentile(xs, 50):.1f} ms, p90 {percentile(xs, 90):.1f} ms")
    ax.set_xlabel("request latency, ms (tiny, 32-token prompt, max_tokens=1)")
    ax.set_ylabel("CDF")
    ax.set_title(f"Router + gate overhead: p50 {o['overhead_p50_ms']:.1f} ms (paired {o['paired_diff']['p50_ms']:.1f})")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    stages = o["breakdown"]["router"]
    names = list(stages)
    bx.barh(range(len(names)), [stages[k]["p50_ms"] for k in names])
    bx.set_yticks(range(len(names)), names, fontsize=7)
    bx.invert_yaxis()
    bx.set_xlabel("p50 ms")
    bx.set_title("(a) router path, per stage (p50)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=200, help="measured iterations (one request per path each)")
    ap.add_argument("--warm", type=int, default=10, help="warm-up iterations, not measured")
    ap.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp", help="the HTTP client of (a) and (c)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a `moorage up --set` override, e.g. gate.gate.budget_fraction=0.5 (repeatable)")
    ap.add_argument("--label", default="", help="a note stored in the JSON (e.g. before / after)")
    ap.add_argument("--out", default=None, help="JSON result, PNG beside it (default runs/overhead-<time>/overhead.json)")
    args = ap.parse_args(argv)
    args.out = args.out or f"runs/overhead-{time.strftime('%Y%m%d-%H%M%S')}/overhead.json"
    info, t_start = machine_info(), time.perf_counter()
    over = run("tiny", {"overhead_n": args.n, "overhead_warm": args.warm, "client": args.client, "set": args.set})
    result = {"command": " ".join(["python -m bench.overhead", *(argv if argv is not None else sys.argv[1:])]),
              "machine": info, "label": args.label, "params": {"seed": SEED, "n": args.n, "warm": args.warm, "client": args.client, "set": args.set},
              "overhead": over}
    write_result(result, args.out, t_start, plot, report)


if __name__ == "__main__":
    main()
