"""Fault injection under load: per fault, what the requests in flight got, the time to the first success
after it, wrong tokens against the greedy reference, and budget or KV left held.

    python -m bench.faults [--quick] [--out runs/faults-<time>/faults.json] [--only kill]

Starts `moorage up` through infra.up.Launcher (tiny model, KV pool on, 2 prefills so that one can be
lost, 1 decode, the gate's budget small enough to overrun), drives multi-turn clients (half streaming,
greedy), and injects one fault at a time (bench/faults_inject.py): a disconnect storm, an overload burst,
kill -9 of each role (store, master, prefill, decode, gate, router, nats-server), and a NATS restart.
Before the next fault the killed process is back and every instance reports ready. Writes JSON, a PNG
beside it, and prints the table. `--quick` is the size tests/test_faults.py runs in `make test`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

from bench._util import machine_info, md_table, write_result
from bench.faults_inject import FAULTS, Fault, FaultSize
from bench.faults_load import OUTCOMES, LoadShape
from bench.faults_run import FaultResult, Harness, Size, unclean

GOAL_S = 10.0  # the goal: new requests succeed again within this after any one fault

QUICK = Size(LoadShape(clients=4, max_tokens=16), FaultSize(storm_streams=50, burst_requests=24), warm_ok=4)
FULL = Size(LoadShape(clients=8, max_tokens=32), FaultSize(storm_streams=100, burst_requests=48), warm_ok=8,
            after_s=3.0)


def system_overrides(run_dir: str) -> list[str]:
    """The system every fault runs against (tiny model, pool on, 2 prefills, a small decode budget)."""
    return ["up.model=tiny", "up.port=0", f"up.run_dir={run_dir}", "up.ready_timeout_s=300",
            "up.prefills=2", "up.pool=true", "up.stores=2", "up.store_bytes=67108864",
            # 512 blocks of 16: a budget of 0.9 x 8192 tokens, which the burst overruns
            "decode.engine.num_blocks=512", "prefill.engine.num_blocks=512",
            "gate.gate.admission_wait_s=2"]  # what waits longer for budget is a 429


@contextlib.contextmanager
def harness(run_dir: str, size: Size, extra: list[str] = (), reference: bool = True) -> Iterator[Harness]:
    from bench.faults_reference import Reference
    from shared.config import load_config
    from infra.up import UpConfig, launched

    cfg = load_config(UpConfig, overrides=[*system_overrides(run_dir), *extra], env={})
    ref = Reference() if reference else None
    with launched(cfg) as (launcher, url):
        yield Harness(launcher, url, size, ref)


def table(results: list[dict]) -> str:
    def outcomes(d: dict) -> str:
        return " ".join(f"{k} {d[k]}" for k in OUTCOMES if d.get(k)) or "-"

    def s(x) -> str:
        return "none" if x is None else f"{x:.2f}"
    return md_table(
        ["fault", "in flight got", "errors ended by (s)", "new requests until first success",
         "first success (s)", "process back (s)", "wrong tokens (answers)", "leaked budget / KV tokens",
         "quiet (s)"],
        [[r["fault"], outcomes(r["in_flight"]), s(r["error_end_s"]), outcomes(r["during"]),
          s(r["first_success_s"]), s(r["back_s"]) if r["victim"] else "-",
          f"{r['wrong_tokens']} ({r['wrong_answers']}/{r['compared']})",
          f"{r['leaked_budget_tokens']} / {r['leaked_kv_tokens']}" + ("" if r["clean"] else " (not clean)"),
          s(r["quiet_s"])] for r in results])


def report(result: dict) -> str:
    m = result["machine"]
    head = (f"## moorage faults ({'quick' if result['params']['quick'] else 'full'}): {result['params']['load']}\n"
            f"load avg start {m['loadavg_1m_5m_15m'][0]:.1f} / end {m['loadavg_at_end'][0]:.1f} on "
            f"{m['cpu_count']} CPUs; system up in {result['startup_s']:.0f} s\n")
    notes = [f"{r['fault']}: {'; '.join(r['others'])}" for r in result["faults"] if r["others"]]
    notes += [f"{r['fault']}: not clean in flight: {r['unclean']}" for r in result["faults"] if r["unclean"]]
    notes += [f"{r['fault']}: wrong: {'; '.join(r['wrong_examples'])}" for r in result["faults"]
              if r["wrong_examples"]]
    return "\n".join([head, table(result["faults"]), "", *result["notes"], *notes])


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["faults"]
    names = [r["fault"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(16, 6))
    x = range(len(rows))
    w = 0.4
    a.bar([i - w / 2 for i in x], [r["first_success_s"] or 0 for r in rows], w, label="first success after the fault")
    a.bar([i + w / 2 for i in x], [r["back_s"] or 0 for r in rows], w, label="killed process back, ready")
    a.axhline(GOAL_S, color="red", ls="--", lw=1, label=f"goal {GOAL_S:g} s")
    a.set_xticks(list(x), names, rotation=40, ha="right", fontsize=8)
    a.set_ylabel("seconds after the fault")
    a.set_title("Recovery")
    a.legend(fontsize=8)
    bottom = [0] * len(rows)
    for k, outcome in enumerate(OUTCOMES):
        vals = [r["in_flight"].get(outcome, 0) for r in rows]
        if any(vals):
            b.bar(list(x), vals, bottom=bottom, label=outcome, color=f"C{k}")
            bottom = [p + v for p, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
        b.annotate(f"wrong {r['wrong_tokens']}\nleak {r['leaked_budget_tokens']}/{r['leaked_kv_tokens']}",
                   (i, bottom[i]), ha="center", va="bottom", fontsize=7)
    b.set_ylim(0, max(bottom + [1]) * 1.25)
    b.set_xticks(list(x), names, rotation=40, ha="right", fontsize=8)
    b.set_ylabel("requests in flight at the fault")
    b.set_title("What in-flight requests got (annotated: wrong tokens, leaked budget/KV tokens)")
    b.legend(fontsize=8)
    fig.suptitle(f"moorage faults ({'quick' if result['params']['quick'] else 'full'}), {result['machine']['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(faults: list[Fault], size: Size, run_dir: str, quick: bool, extra: list[str] = ()) -> dict:
    result = {"machine": machine_info(), "params": {
        "quick": quick, "load": f"{size.load.clients} multi-turn clients (half streaming), greedy, "
                                f"{size.load.max_tokens} tokens per turn",
        "size": dataclasses.asdict(size), "system": [*system_overrides(run_dir), *extra]},
        "notes": ["in flight got: requests in flight at the fault (for a burst, its own); dropped = the "
                  "connection closed (only a killed router may do that)",
                  "first success: fault -> end of the first new request answered 200; process back: fault -> "
                  "the restarted process (NATS: every instance) ready on the bus",
                  "leaked: gate reserved tokens / prefill+decode KV tokens not free, after the load stopped"],
        "faults": []}
    t0 = time.monotonic()
    with harness(run_dir, size, list(extra)) as h:
        result["startup_s"] = time.monotonic() - t0
        for fault in faults:
            r: FaultResult = h.run(fault)
            row = dataclasses.asdict(r)
            row["unclean"] = unclean(r)
            result["faults"].append(row)
            print(f"{fault.name}: {row}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the smaller size tests/test_faults.py runs")
    p.add_argument("--out", default="", help="JSON path (default runs/faults-<time>/faults.json); PNG beside it")
    p.add_argument("--only", action="append", default=[], help="faults whose name contains this (repeatable)")
    p.add_argument("--run-dir", default="", help="the system's run dir (default: beside --out)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra UpConfig override")
    args = p.parse_args(argv)
    out = Path(args.out or f"runs/faults-{time.strftime('%Y%m%d-%H%M%S')}/faults.json")
    faults = [f for f in FAULTS if not args.only or any(o in f.name for o in args.only)]
    t_start = time.perf_counter()
    result = run(faults, QUICK if args.quick else FULL, args.run_dir or str(out.parent / "run"), args.quick,
                 args.set)
    write_result(result, out, t_start, plot, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
