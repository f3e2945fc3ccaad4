"""Helpers for bench/engine.py: machine info, timing, markdown tables and the PNG plot."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable

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
                       for x in r["kernels"]])]
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
