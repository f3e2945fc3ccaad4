"""AIPerf's profile_export_aiperf.json -> one summary row per (pool, concurrency); the table and the plot.

Fields read (AIPerf 0.13; each metric is {"unit", "avg", "p50", "p90", "p99", ...}, absent when it had no
data): `request_count` (successful requests), `error_request_count`, `error_summary` ([{"error_details":
{"code", "type", "message"}, "count"}]), `time_to_first_token` and `inter_token_latency` (ms),
`overall_usage_prompt_cache_read_pct` (cached prompt tokens / prompt tokens, from the server's
`usage.prompt_tokens_details.cached_tokens`), `theoretical_prefix_cache_hit` (the traces' own ceiling for
the requests sent, %), `request_throughput`, `output_token_throughput`, `benchmark_duration`.
"""

from __future__ import annotations

import os
from collections import Counter

REJECT_STATUSES = ("429", "503")  # admission rejections: the gate said busy / nothing to run it on


def _metric(d: dict, name: str, stat: str = "avg") -> float | None:
    m = d.get(name)
    if not isinstance(m, dict):
        return None
    v = m.get(stat)
    return float(v) if isinstance(v, (int, float)) else None


def _ms_to_s(x: float | None) -> float | None:
    return None if x is None else x / 1000.0


def error_statuses(d: dict) -> dict[str, int]:
    """{status: count} from error_summary: the HTTP code when there is one, else the error type."""
    out: Counter[str] = Counter()
    for item in d.get("error_summary") or []:
        det = item.get("error_details") or {}
        key = str(det["code"]) if det.get("code") is not None else (det.get("type") or "error")
        out[key] += int(item.get("count") or 0)
    return dict(out)


def summarize_export(d: dict) -> dict:
    """The summary row of one AIPerf run (times in seconds, except ITL in ms; shares as fractions)."""
    statuses = error_statuses(d)
    ok = int(_metric(d, "request_count") or 0)
    errors = int(_metric(d, "error_request_count") or 0) or sum(statuses.values())
    cache = _metric(d, "overall_usage_prompt_cache_read_pct")
    ceiling = _metric(d, "theoretical_prefix_cache_hit")
    return {
        "ok": ok,
        "errors": errors,
        "rejected": sum(n for s, n in statuses.items() if s in REJECT_STATUSES),
        "error_statuses": statuses,
        "error_messages": sorted({str((i.get("error_details") or {}).get("message", ""))[:200]
                                  for i in d.get("error_summary") or []})[:5],
        "cache_read": None if cache is None else cache / 100.0,
        "ceiling": None if ceiling is None else ceiling / 100.0,
        "ttft_s": {p: _ms_to_s(_metric(d, "time_to_first_token", p)) for p in ("p50", "p90", "p99")},
        "itl_ms": {"p50": _metric(d, "inter_token_latency", "p50")},
        "request_latency_s": {"p50": _ms_to_s(_metric(d, "request_latency", "p50"))},
        "requests_per_s": _metric(d, "request_throughput"),
        "output_tokens_per_s": _metric(d, "output_token_throughput"),
        "prompt_tokens": _metric(d, "total_usage_prompt_tokens"),
        "cached_prompt_tokens": _metric(d, "total_usage_prompt_cache_read_tokens"),
        "duration_s": _metric(d, "benchmark_duration"),
        "aiperf_version": d.get("aiperf_version"),
        "complete": d.get("is_complete"),
    }


def _f(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


HEAD = ["pool", "conc", "ok", "errors (rejected)", "error statuses", "cache read / ceiling",
        "TTFT p50 s", "TTFT p90 s", "TTFT p99 s", "ITL p50 ms", "req/s", "duration s"]


def table(runs: list[dict]) -> str:
    """Markdown, side by side: for each concurrency, the pool-on row next to the pool-off row."""
    order = {"on": 0, "off": 1}
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for r in sorted(runs, key=lambda r: (r["concurrency"], order.get(r["pool"], 2), r["pool"])):
        s = r.get("summary")
        if not s:
            lines.append(f"| {r['pool']} | {r['concurrency']} | failed: {r.get('error', '?')} |"
                         + " |" * (len(HEAD) - 3))
            continue
        statuses = ", ".join(f"{k} x{v}" for k, v in sorted(s["error_statuses"].items())) or "-"
        row = [r["pool"], r["concurrency"], s["ok"], f"{s['errors']} ({s['rejected']})", statuses,
               f"{_f(s['cache_read'], '.1%')} / {_f(s['ceiling'], '.1%')}",
               _f(s["ttft_s"]["p50"]), _f(s["ttft_s"]["p90"]), _f(s["ttft_s"]["p99"]), _f(s["itl_ms"]["p50"]),
               _f(s["requests_per_s"]), _f(s["duration_s"], ".0f")]
        lines.append("| " + " | ".join(str(x) for x in row) + " |")
    return "\n".join(lines)


def plot(runs: list[dict], path: str | os.PathLike, title: str) -> None:
    """Three panels per concurrency, pool on vs off: TTFT p50/p90/p99, cache read vs the traces' ceiling,
    ITL p50."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in runs if r.get("summary")]
    pools = list(dict.fromkeys(r["pool"] for r in sorted(ok, key=lambda r: r["pool"] != "on")))
    loads = sorted({r["concurrency"] for r in ok})
    by = {(r["pool"], r["concurrency"]): r["summary"] for r in ok}
    width = 0.8 / max(1, len(pools))
    color = {p: f"C{i}" for i, p in enumerate(pools)}
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    fig.suptitle(title, fontsize=11)

    def xs(i):
        return [loads.index(c) + (i - (len(pools) - 1) / 2) * width for c in loads]

    ax = axes[0]
    for i, p in enumerate(pools):
        for q, alpha in (("p99", 0.3), ("p90", 0.55), ("p50", 1.0)):
            vals = [(by.get((p, c)) or {}).get("ttft_s", {}).get(q) or 0.0 for c in loads]
            bars = ax.bar(xs(i), vals, width, color=color[p], alpha=alpha,
                          label=f"pool {p} {q}")
            if q == "p50":
                ax.bar_label(bars, fmt="%.2g", fontsize=7)
    ax.set_xticks(range(len(loads)), [f"c={c}" for c in loads])
    ax.set_ylabel("TTFT (s)")
    ax.set_title("TTFT p50 (solid), p90, p99 (lighter)")
    ax.legend(fontsize=7, ncol=2)

    ax = axes[1]
    for i, p in enumerate(pools):
        vals = [(by.get((p, c)) or {}).get("cache_read") or 0.0 for c in loads]
        bars = ax.bar(xs(i), vals, width, color=color[p], label=f"pool {p}")
        ax.bar_label(bars, labels=[f"{v:.0%}" for v in vals], fontsize=7)
        for x, c in zip(xs(i), loads):
            ceil = (by.get((p, c)) or {}).get("ceiling")
            if ceil is not None:
                ax.plot([x - width / 2, x + width / 2], [ceil, ceil], color="k", lw=2,
                        label="traces' ceiling" if (i, c) == (0, loads[0]) else None)
    ax.set_xticks(range(len(loads)), [f"c={c}" for c in loads])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("cached share of prompt tokens")
    ax.set_title("Cache read (server usage) vs theoretical prefix-cache hit")
    ax.legend(fontsize=7, loc="lower right")

    ax = axes[2]
    for i, p in enumerate(pools):
        vals = [(by.get((p, c)) or {}).get("itl_ms", {}).get("p50") or 0.0 for c in loads]
        bars = ax.bar(xs(i), vals, width, color=color[p], label=f"pool {p}")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(loads)), [f"c={c}" for c in loads])
    ax.set_ylabel("ITL p50 (ms)")
    ax.set_title("Inter-token latency p50")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
