"""Helpers for the benchmarks: machine info, timing, markdown tables, plots and writing results."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch


def machine_info() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "loadavg_1m_5m_15m": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "calibration_matmul_GFLOPs_at_start": calibrate_gflops(),
    }


def calibrate_gflops(n: int = 512, reps: int = 20) -> float:
    """fp32 matmul GFLOP/s with torch's threads, best of 3: taken at start and end of a run, a drop
    between the two (or vs a quiet run) shows the machine was shared while measuring."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 * reps / best / 1e9


def time_calls(fns: list[Callable[[], object]], budget_s: float, min_iters: int, max_iters: int) -> list[dict]:
    """Time several callables with interleaved iterations (a kernel and its copy baseline then see the same
    machine load): one warm-up call each, then enough rounds to fill ~budget_s (clamped). perf_counter s."""
    t0 = time.perf_counter()
    for fn in fns:
        fn()
    warm = time.perf_counter() - t0
    iters = max(min_iters, min(max_iters, int(budget_s / max(warm, 1e-6))))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [{"iters": iters, "median_s": statistics.median(ts), "min_s": min(ts)} for ts in times]


def md_table(headers: list[str], rows: list[list]) -> str:
    def fmt(x):
        if isinstance(x, float):
            return f"{x:,.3g}" if abs(x) < 100 else f"{x:,.0f}"
        return str(x)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def report(r: dict) -> str:
    m = r["machine"]
    parts = [f"## moorage engine benchmark ({'quick' if r['params']['quick'] else 'full'})\n",
             f"torch {m['torch']}, {m['torch_threads']} threads, {m['cpu_count']} CPUs, {m['date']}, "
             f"kernels: {r['kernel_backend']}; load avg start {m['loadavg_1m_5m_15m'][0]:.2f} / end "
             f"{m['loadavg_at_end'][0]:.2f}; matmul calibration start {m['calibration_matmul_GFLOPs_at_start']:.1f} / end "
             f"{m['calibration_matmul_GFLOPs_at_end']:.1f} GFLOP/s\n",
             md_table(["model", "prompt tok", "max_batched", "mode", "repeats", "median tok/s", "best tok/s", "median s"],
                      [[x["model"], x["prompt_tokens"], x["max_batched_tokens"], x["mode"], x["repeats"],
                        x["median_tok_per_s"], x["best_tok_per_s"], x["median_s"]] for x in r["prefill"]]), "",
             md_table(["model", "batch", "decode steps", "tokens", "tok/s", "ms/step", "tok/s/seq"],
                      [[x["model"], x["batch"], x["decode_steps"], x["generated_tokens"], x["tok_per_s"],
                        x["ms_per_step"], x["tok_per_s_per_seq"]] for x in r["decode"]]), "",
             md_table(["model", "kv dtype", "L x H_kv x D", "bytes/token", "MiB per 8K tokens"],
                      [[x["model"], x["kv_dtype"], f"{x['layers']}x{x['kv_heads']}x{x['head_dim']}",
                        x["bytes_per_token"], x["MiB_per_8K_tokens"]] for x in r["kv_bytes_per_token"]]), "",
             md_table(["kernel case", "MB", "iters", "kernel GB/s median (best)", "copy GB/s median (best)",
                       "ratio (median)"],
                      [[x["label"], x["bytes"] / 1e6, x["iters"], f"{x['GBps']:.3g} ({x['best_GBps']:.3g})",
                        f"{x['copy_GBps']:.3g} ({x['copy_best_GBps']:.3g})", x["ratio_vs_copy"]]
                       for x in r["kernels"]]), "",
             md_table(["one pass (copy + CRC-32C)", "MB", "GB/s", "two passes GB/s", "speed-up"],
                      [[x["label"], x["bytes"] / 1e6, x["GBps"], x["unfused_GBps"], x["ratio_vs_unfused"]]
                       for x in r["kernels"] if "unfused_GBps" in x])]
    return "\n".join(parts + ["", "Notes: " + "; ".join(r["notes"])])


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(17, 11))
    fig.suptitle(f"moorage engine benchmark ({'quick' if result['params']['quick'] else 'full'}) - "
                 f"torch {result['machine']['torch']}, {result['machine']['torch_threads']} threads, "
                 f"{result['machine']['date']}", fontsize=11)

    ax = axes[0][0]
    pre = result["prefill"]
    labels = [f"{p['model']}\n{p['prompt_tokens']} tok\nmbt {p['max_batched_tokens']}\n{p['mode']}" for p in pre]
    vals = [p["median_tok_per_s"] for p in pre]
    bars = ax.bar(range(len(pre)), vals, color=["C0" if p["model"] != "tiny" else "C1" for p in pre])
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(pre)), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("prefill tokens/s (median, log)")
    ax.set_title("Prefill throughput (1 output token)")

    ax = axes[0][1]
    for i, model in enumerate(dict.fromkeys(d["model"] for d in result["decode"])):
        rows = [d for d in result["decode"] if d["model"] == model]
        ax.plot([d["batch"] for d in rows], [d["tok_per_s"] for d in rows], "o-", color=f"C{i}", label=model)
        for d in rows:
            ax.annotate(f"{d['tok_per_s']:.0f}", (d["batch"], d["tok_per_s"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([d["batch"] for d in result["decode"]], [str(d["batch"]) for d in result["decode"]])
    ax.set_xlabel("batch (concurrent sequences)")
    ax.set_ylabel("decode tokens/s (log)")
    ax.set_title("Decode throughput vs batch")
    ax.legend()

    for ax, names, title in ((axes[1][0], ("pack_chunk", "unpack_chunk"), "Chunk pack/unpack (256 tokens of stage 0, stN = N stages)"),
                             (axes[1][1], ("gather_for_ranks", "scatter_from_rank"), "Handoff gather/scatter")):
        ks = [k for k in result["kernels"] if k["kernel"] in names]
        x = range(len(ks))
        w = 0.4
        ax.bar([i - w / 2 for i in x], [k["GBps"] for k in ks], w, label=f"kernel ({result['kernel_backend']})")
        ax.bar([i + w / 2 for i in x], [k["copy_GBps"] for k in ks], w, label="torch copy_ (same bytes)")
        for i, k in zip(x, ks):
            ax.annotate(f"{k['ratio_vs_copy']:.2f}x", (i - w / 2, k["GBps"]), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(x), [k["label"] for k in ks], fontsize=7, rotation=60, ha="right")
        ax.set_ylabel("GB/s (1e9 B, payload bytes / median time)")
        ax.set_title(title + "; label = kernel / copy")
        ax.set_ylim(0, 1.18 * max([k["GBps"] for k in ks] + [k["copy_GBps"] for k in ks] + [1e-9]))
        ax.legend(fontsize=8, ncol=2, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_result(result: dict, out: str | os.PathLike, t_start: float, plot_fn: Callable[[dict, str], None],
                 report_fn: Callable[[dict], str]) -> None:
    """Finish a benchmark: wall time and machine state at the end into `result`, JSON to `out`, the
    plot beside it (.png), and the report on stdout."""
    result["total_wall_s"] = time.perf_counter() - t_start
    result["machine"].update(loadavg_at_end=os.getloadavg(), calibration_matmul_GFLOPs_at_end=calibrate_gflops())
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot_fn(result, str(out.with_suffix(".png")))
    print(report_fn(result))
    print(f"\nwrote {out} and {out.with_suffix('.png')} in {result['total_wall_s']:.0f} s")


def system_bench_main(argv: list[str] | None, doc: str, name: str, run: Callable, quick, full,
                      plot_fn: Callable[[dict, str], None], report_fn: Callable[[dict], str]) -> int:
    """main() of a benchmark that starts `moorage up`: `run(size, run_dir, overrides)` at the `quick` or the
    `full` size, then the result written (bench/results/<name>.json by default) with its plot and report."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=f"bench/results/{name}.json")
    ap.add_argument("--run-dir", default=f"runs/{name}")
    ap.add_argument("--set", action="append", default=[], help="moorage up override (repeatable)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    result = run(quick if args.quick else full, args.run_dir, args.set)
    result["machine"] = machine_info()
    write_result(result, args.out, t0, plot_fn, report_fn)
    return 0


# --- helpers for bench/handoff.py ---------------------------------------------------------------

def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) of a non-empty list: numpy's, linear interpolation, as a float."""
    return float(np.percentile(xs, q))


# --- helpers for bench/restore.py ---------------------------------------------------------------

class LoadWatcher:
    """The latest LoadReport of every instance of a running system (and when it arrived), from a bus
    subscription on an event loop in a background thread, for synchronous benchmark code."""

    def __init__(self, nats_url: str, name: str = "bench"):
        import asyncio
        import threading

        from shared.bus import Bus, BusConfig
        from shared.messages import LoadReport

        self.latest: dict[str, tuple[float, object]] = {}  # instance -> (time.monotonic() on arrival, report)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def on_load(msg, raw) -> None:
            self.latest[msg.instance] = (time.monotonic(), msg)

        async def connect():
            bus = await Bus.connect(BusConfig(url=nats_url), name)
            await bus.subscribe(bus.subjects.load_all, LoadReport, on_load)
            return bus

        self.bus = asyncio.run_coroutine_threadsafe(connect(), self.loop).result(15)

    def wait_idle(self, instance: str, after: float, timeout: float = 120.0):
        """The first report of `instance` that arrived after time.monotonic() `after` (+50 ms) showing
        nothing running or waiting and every KV block free (so its async saves have let go too)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t, r = self.latest.get(instance, (0.0, None))
            if r is not None and t > after + 0.05 and not r.running and not r.waiting \
                    and r.free_tokens == r.capacity_tokens:
                return r
            time.sleep(0.05)
        raise TimeoutError(f"{instance} not idle after {timeout:.0f} s")

    def close(self) -> None:
        import asyncio

        try:
            asyncio.run_coroutine_threadsafe(self.bus.close(), self.loop).result(10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


def stream_completion(client, model: str, prompt: list[int], max_tokens: int, session: str | None = None) -> dict:
    """One streamed greedy completion through the router (httpx.Client with base_url). The router sends
    the response headers once the first token reached it, so ttft_ms = time to headers; first_event_ms =
    time to the first SSE data line (later when the first token decodes to no text yet)."""
    import json

    t0 = time.perf_counter()
    first_event, usage = None, None
    with client.stream("POST", "/v1/completions", headers={"X-Session-ID": session} if session else {}, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        ttft = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            first_event = first_event or time.perf_counter() - t0
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            usage = obj.get("usage") or usage
    return {"request_id": r.headers["x-request-id"], "ttft_ms": ttft * 1e3, "first_event_ms": (first_event or 0) * 1e3,
            "total_ms": (time.perf_counter() - t0) * 1e3, "prompt_tokens": len(prompt), "usage": usage}
