"""The replay's plots: TTFT distribution, token sources per load against the ceiling, throughput per load."""

from __future__ import annotations

import os


def plot(runs: list[dict], path: str | os.PathLike, title: str = "moorage agentic replay") -> None:
    """runs: [{"topology", "concurrency", "stats"}]: TTFT distribution (CDF per run), token sources per load
    (stacked shares with the ceiling), token throughput per load (one line per topology)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    topologies = list(dict.fromkeys(r["topology"] for r in runs))
    color = {t: f"C{i}" for i, t in enumerate(topologies)}
    loads = sorted({r["concurrency"] for r in runs})
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.8))
    fig.suptitle(title, fontsize=11)

    ax = axes[0]
    for r in runs:
        xs = sorted(r["stats"].get("samples", {}).get("ttft_s", []))
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", color=color[r["topology"]],
                    linestyle=styles[loads.index(r["concurrency"]) % len(styles)],
                    label=f"{r['topology']} c={r['concurrency']}")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log)")
    ax.set_ylabel("fraction of measured requests")
    ax.set_title("TTFT distribution (CDF)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)

    ax = axes[1]
    labels, x = [], 0
    for r in runs:
        sh = r["stats"]["tokens"]["shares"]
        d, p, c = (sh.get(k) or 0.0 for k in ("device", "pool", "computed"))
        ax.bar(x, d, color="C2", label="device" if x == 0 else None)
        ax.bar(x, p, bottom=d, color="C0", label="pool" if x == 0 else None)
        ax.bar(x, c, bottom=d + p, color="C7", label="computed" if x == 0 else None)
        ceil = (r["stats"].get("ceiling") or {}).get("measured", {}).get("ratio")
        if ceil is not None:
            ax.plot([x - 0.4, x + 0.4], [ceil, ceil], color="k", lw=2, label="ceiling" if x == 0 else None)
        ax.annotate(f"{d + p:.0%}", (x, min(d + p, 0.97)), ha="center", va="bottom", fontsize=7)
        labels.append(f"{r['topology']}\nc={r['concurrency']}")
        x += 1
    ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=45 if len(labels) > 6 else 0)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("share of prompt tokens")
    ax.set_title("Token sources per load (line: perfect-cache ceiling)")
    ax.legend(fontsize=7, loc="lower right")

    ax = axes[2]
    width = 0.8 / max(1, len(topologies))
    for i, t in enumerate(topologies):
        rs = sorted((r for r in runs if r["topology"] == t), key=lambda r: r["concurrency"])
        xs = [loads.index(r["concurrency"]) + (i - (len(topologies) - 1) / 2) * width for r in rs]
        ys = [r["stats"]["throughput"]["tokens_per_s"] or 0.0 for r in rs]
        bars = ax.bar(xs, ys, width, color=color[t], label=t)
        ax.bar_label(bars, fmt="%.0f", fontsize=6)
    ax.set_xticks(range(len(loads)), [f"c={c}" for c in loads])
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("tokens/s (prompt incl. cached + generated)")
    ax.set_title("Token throughput per load")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
