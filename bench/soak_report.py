"""The restore soak's text report and plot (bench/soak.py writes both beside its JSON)."""

from __future__ import annotations


def report(r: dict) -> str:
    c = r["counts"]
    lines = [f"soak: {c['cycles']} cycles ({r['params']['sessions']} sessions)",
             *(f"  {k}: {v}" for k, v in c.items() if k != "outcomes"),
             "  outcomes: " + ", ".join(f"{k} {v}" for k, v in c["outcomes"].items())]
    return "\n".join(lines)


def plot(r: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [x for x in r["records"] if "outcome" in x]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    for outcome in r["counts"]["outcomes"]:
        xs = [x["cycle"] for x in recs]
        a.plot(xs, [sum(y["outcome"] == outcome for y in recs[:i + 1]) for i in range(len(recs))], label=outcome)
    for e in (x for x in r["records"] if "event" in x):
        a.axvline(e["cycle"], color="k", ls=":", lw=1)
        a.text(e["cycle"], 0, " " + e["event"], rotation=90, fontsize=7, va="bottom")
    a.set(xlabel="cycle", ylabel="turns (cumulative)", title=f"turn outcomes; mismatches {r['counts']['mismatches']}")
    a.legend(fontsize=8)
    b.scatter([x["expected"] for x in recs], [x["store"] for x in recs], s=6, alpha=0.4,
              c=["tab:red" if not x["ok"] else "tab:blue" for x in recs])
    b.set(xlabel="reusable history tokens", ylabel="tokens restored from the pool", title="restored vs reusable")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
