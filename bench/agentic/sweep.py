"""`moorage bench sweep`: the same agentic traces at several loads against several topologies.

For every topology (`<none|split|shared>[-<cache-aware|sticky|p2c>]`: no pool, a pool per group, one pool
shared by every group; the router's routing policy) a fresh system is started with `infra.up.Launcher`
(`--model`, default `tiny`, `--groups` groups, device KV sized so that device memory alone holds well under the
perfect-cache ceiling), the traces are replayed at each concurrency (`bench.agentic.replay`), and the system
is stopped. By default one system serves all loads of a topology, each load under its own run tag (its
prompts and session ids cannot reuse an earlier load's cache or affinity); `--restart-per-load` starts a
fresh system for every load instead. Prints a side-by-side markdown table with ratios to the `shared`
topology at the same load, and writes JSON and PNG (TTFT distribution, token sources per load, throughput
per load).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import sys
import time
from pathlib import Path

from bench.agentic import plots, system
from bench.agentic import replay as rp
from bench.agentic.stats import summary_line

DEFAULT_TOPOLOGIES = "none,split,shared,shared-p2c,shared-sticky"


def _fmt(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def table(runs: list[dict], baseline: str = "shared") -> str:
    """Markdown: one row per topology x concurrency; ratios against `baseline` at the same concurrency."""
    base = {r["concurrency"]: r for r in runs if r["topology"] == baseline and r.get("stats")}
    head = ["topology", "conc", "ok/sent", "err", "rej", "device", "pool", "computed", "reused / ceiling",
            "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "tok/s", "req/s",
            f"tok/s vs {baseline}", f"TTFT p50 vs {baseline}", f"computed vs {baseline}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        st = r.get("stats")
        if not st:
            lines.append(f"| {r['topology']} | {r['concurrency']} | failed: {r.get('error', '?')} |"
                         + " |" * (len(head) - 3))
            continue
        sh, th, tok = st["tokens"]["shares"], st["throughput"], st["tokens"]
        ceil = st.get("ceiling", {}).get("measured", {}).get("ratio")
        b = base.get(r["concurrency"], {}).get("stats")
        row = [r["topology"], r["concurrency"], f"{st['requests']['sent'] - st['errors']['total']}/{st['requests']['sent']}",
               st["errors"]["total"], st["rejections"],
               _fmt(sh["device"], ".1%"), _fmt(sh["pool"], ".1%"), _fmt(sh["computed"], ".1%"),
               f"{_fmt(sh['reused'], '.1%')} / {_fmt(ceil, '.1%')}",
               _fmt(st["ttft_s"]["p50"]), _fmt(st["ttft_s"]["p99"]),
               _fmt(None if st["itl_s"]["p50"] is None else st["itl_s"]["p50"] * 1000),
               _fmt(th["tokens_per_s"], ",.0f"), _fmt(th["requests_per_s"]),
               _fmt(_ratio(th["tokens_per_s"], b and b["throughput"]["tokens_per_s"]), ".2f"),
               _fmt(_ratio(st["ttft_s"]["p50"], b and b["ttft_s"]["p50"]), ".2f"),
               _fmt(_ratio(tok["computed"] / tok["prompt"] if tok["prompt"] else None,
                           b and b["tokens"]["shares"]["computed"]), ".2f")]
        lines.append("| " + " | ".join(str(x) for x in row) + " |")
    return "\n".join(lines)


def _machine() -> dict:
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu_count": os.cpu_count(),
            "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "loadavg_1m_5m_15m": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "python": platform.python_version(), "platform": platform.platform()}


def _slim(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k != "records"}


def sweep(args: argparse.Namespace, sessions: list, topologies: list[str], loads: list[int],
          log=print) -> list[dict]:
    runs: list[dict] = []
    run_dir = Path(args.run_dir)
    for topology in topologies:
        groups = [[c] for c in loads] if args.restart_per_load else [loads]
        for group in groups:
            sets, notes = system.system_overrides(args, topology, sessions, max(group))
            t0 = time.monotonic()
            try:
                with system.running_system(sets, run_dir / topology) as url:
                    startup = round(time.monotonic() - t0, 1)
                    log(f"== {topology}: up in {startup} s ({' '.join(sets)})")
                    for c in group:
                        cfg = rp.replay_config(args, c, args.duration)
                        cfg.base_url = url
                        stats = asyncio.run(rp.replay(sessions, cfg, progress=not args.no_progress))
                        run = {"topology": topology, "concurrency": c,
                               "system": {"overrides": sets, "notes": notes, "startup_s": startup},
                               "stats": _slim(stats)}
                        runs.append(run)
                        log(f"   c={c}: {summary_line(stats)}")
            except (RuntimeError, TimeoutError, OSError, ValueError) as e:
                log(f"== {topology}: failed: {e}")
                runs += [{"topology": topology, "concurrency": c, "error": str(e)[:500],
                          "system": {"overrides": sets, "notes": notes}} for c in group
                         if not any(r["topology"] == topology and r["concurrency"] == c for r in runs)]
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moorage bench sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default=None,
                   help="comma-separated loads (session lanes); default 1,2,4 (--quick: 2)")
    p.add_argument("--topologies", default=None,
                   help=f"comma-separated, each {system.TOPOLOGY_HELP}; default {DEFAULT_TOPOLOGIES} "
                        "(--quick: none,shared)")
    p.add_argument("--duration", type=float, default=60.0,
                   help="per load: stop starting new turns after S s (0 = replay all; default %(default)s)")
    p.add_argument("--restart-per-load", action="store_true", help="a fresh system for every load")
    p.add_argument("--baseline", default="shared", help="the topology the ratios compare with")
    p.add_argument("--out", default=None, help="JSON result (default runs/sweep-<time>/agentic.json, gitignored; "
                                               "pass bench/results/agentic.json to update the committed one)")
    p.add_argument("--png", default=None, help="plots (default: --out with .png)")
    rp.add_replay_args(p)
    system.add_system_args(p)
    p.set_defaults(groups=2)
    args = p.parse_args(argv)
    rp.resolve_think(args, argv)
    if args.out is None:
        args.out = rp.default_out("sweep", "agentic.json")
    args.topologies = args.topologies or ("none,shared" if args.quick else DEFAULT_TOPOLOGIES)
    args.concurrency = args.concurrency or ("2" if args.quick else "1,2,4")
    topologies = [t.strip() for t in args.topologies.split(",") if t.strip()]
    loads = [int(c) for c in args.concurrency.split(",") if c.strip()]
    for t in topologies:
        system.topology_overrides(t)  # fail fast on a typo
    sessions, source = rp.load_sessions(args.traces, args.quick, args.seed)
    sessions = sessions[: args.max_sessions or None]
    if not sessions:
        print("moorage bench sweep: no sessions to replay", file=sys.stderr)
        return 1
    from bench.agentic.trace import summarize as corpus_summary

    corpus = corpus_summary(sessions)
    print(f"moorage bench sweep: {len(sessions)} sessions, {corpus['requests']} requests, ceiling "
          f"{corpus['ceiling']:.1%}; topologies {', '.join(topologies)} x concurrency {loads}, {args.groups} "
          f"groups", flush=True)
    t0 = time.monotonic()
    runs = sweep(args, sessions, topologies, loads, log=lambda m: print(m, flush=True))
    md = table(runs, args.baseline)
    print()
    print(md)
    params = {k: v for k, v in vars(args).items() if k != "api_key"}
    result = {"kind": "moorage-bench-sweep", "params": params, "source": source, "corpus": corpus,
              "machine": _machine(), "elapsed_s": round(time.monotonic() - t0, 1), "table": md, "runs": runs}
    rp.write_json(args.out, result)
    png = args.png or str(Path(args.out).with_suffix(".png"))
    ok = [r for r in runs if r.get("stats")]
    if ok:
        plots.plot(ok, png, f"moorage bench sweep: {len(sessions)} sessions, {args.groups} groups, "
                         f"{corpus['ceiling']:.0%} ceiling over the whole corpus")
    print(f"\nwrote {args.out}" + (f" and {png}" if ok else "") + f" in {result['elapsed_s']:.0f} s")
    failed = len(runs) - len(ok) + sum(r["stats"]["errors"]["total"] > 0 for r in ok)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
