"""The zero-hit tax: what saving every chunk to the pool costs traffic that never comes back, with a 95%
confidence interval.

    .venv/bin/python -m bench.zero_hit --pairs 20 --out bench/results/zero_hit.json

Two tiny systems up at once (bench.restore.System: nats, master, 2 stores, gate, decode, prefill, router
as processes), pool on and pool off (`up.pool=false`). Rounds of distinct random 2K-token prompts
(max_tokens 2, greedy) from `threads` client threads; a round's throughput is its requests over the time to
its last response, then the bench waits for an idle prefill (its saves done) so one system's saves never
overlap the other's round. Rounds alternate ABBA (on, off, off, on, ...): each adjacent (on, off) pair saw
about the same machine load.

Each round also counts the CPU seconds (user + system, /proc) of every process of its system, services,
nats-server and mooncake_master, from its start to the idle report (so its saves are in): requests per
CPU-second is the cost measure that the other load on a shared machine disturbs least.

With `--compare OVERRIDE` (repeatable) a third system runs: a second pool-on configuration ("on_b"), in
the same blocks, the three systems in every order in turn. E.g. the old save policy (at once, one put per
chunk) against the default (deferred to idle time, one batched put):

    .venv/bin/python -m bench.zero_hit --pairs 30 --requests 8 --compare prefill.pool.save_when_idle=false \
        --compare prefill.pool.save_batch_chunks=1 --out bench/results/zero_hit.json

Statistics: per pair the ratio on/off of requests/s (and of requests per CPU-second); the ratio of the means over pairs (and the geometric
mean of the per-pair ratios) with 95% intervals from a bootstrap over pairs (numpy, 20,000 resamples,
percentile interval). Goal (issue 11): >= 0.98 of pool-off throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from bench._util import machine_info, md_table, write_result
from bench.restore import MAX_TOKENS, System, chunk_bytes, rand
from shared.engine.models import load_tokenizer
from shared.hashing import CHUNK_TOKENS

SEED = 20240611
BOOT = 20000


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def system_cpu_s(s: System) -> float:
    """CPU seconds (user + system) used so far by every process of the system: its services, nats-server
    and whatever they spawned (mooncake_master). Rounds compare CPU per request, which other load on the
    machine changes far less than wall time."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    roots = [c.process.pid for c in s.launcher.supervisor.children.values() if c.process]
    for pid in {d for r in roots for d in _descendants(r)}:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
        except (OSError, IndexError):
            pass
    return total / tick


def one_round(s: System, prompts: list[list[int]], threads: int) -> dict:
    lat: list[float] = []
    cpu0 = system_cpu_s(s)

    def one(prompt: list[int]) -> None:
        t = time.perf_counter()
        r = s.http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                 "temperature": 0, "ignore_eos": True})
        if r.status_code != 200:
            raise RuntimeError(f"{s.tag}: HTTP {r.status_code}: {r.text[:500]}")
        lat.append((time.perf_counter() - t) * 1e3)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, prompts))
    wall, t_end = time.perf_counter() - t0, time.monotonic()
    s.report = s.watch.wait_idle("prefill-0", t_end)
    cpu = system_cpu_s(s) - cpu0  # to the idle report: the round's saves included
    return {"requests": len(prompts), "wall_s": wall, "req_per_s": len(prompts) / wall,
            "cpu_s": cpu, "cpu_ms_per_request": cpu / len(prompts) * 1e3,
            "p50_latency_ms": statistics.median(lat), "idle_seen_after_s": time.monotonic() - t_end}


def ratio_ci(on: np.ndarray, off: np.ndarray, seed: int = SEED) -> dict:
    """Ratio of means and geometric mean of per-pair ratios, each with a 95% bootstrap interval over pairs."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(on), size=(BOOT, len(on)))
    rom = on[idx].mean(axis=1) / off[idx].mean(axis=1)
    logr = np.log(on / off)
    gm = np.exp(logr[idx].mean(axis=1))
    return {"pairs": int(len(on)), "ratio_of_means": float(on.mean() / off.mean()),
            "ratio_of_means_ci95": [float(x) for x in np.percentile(rom, [2.5, 97.5])],
            "geomean_pair_ratio": float(np.exp(logr.mean())),
            "geomean_pair_ratio_ci95": [float(x) for x in np.percentile(gm, [2.5, 97.5])],
            "pair_ratios": [float(x) for x in on / off]}


ORDERS3 = [("on", "off", "on_b"), ("on_b", "off", "on"), ("off", "on_b", "on"), ("on", "on_b", "off"),
           ("on_b", "on", "off"), ("off", "on", "on_b")]  # every order once per 6 blocks


def bench(pairs: int, requests: int, threads: int, prompt: int, extra_on: list[str],
          extra_b: list[str] | None = None) -> dict:
    """Blocks of one round per system: (on, off) in ABBA order, or with `extra_b` a third system (a
    second pool-on configuration, "on_b") and the three in every order in turn."""
    g = torch.Generator().manual_seed(SEED)
    vocab = load_tokenizer("tiny")[0].vocab_size
    total = (2 * pairs * requests + 4) * (prompt // CHUNK_TOKENS) * chunk_bytes("tiny")
    store_bytes = int(total * 0.75 / 0.85) + (64 << 20)  # every chunk saved fits: no eviction in the measurement
    keys = ("on", "off") if extra_b is None else ("on", "off", "on_b")
    rounds: dict[str, list[dict]] = {k: [] for k in keys}
    with contextlib.ExitStack() as stack:
        systems = {"on": stack.enter_context(System("pool-on", "tiny", [f"up.store_bytes={store_bytes}", *extra_on])),
                   "off": stack.enter_context(System("pool-off", "tiny", ["up.pool=false"]))}
        if extra_b is not None:
            systems["on_b"] = stack.enter_context(System("pool-on-b", "tiny", [f"up.store_bytes={store_bytes}",
                                                                                *extra_b]))
        for s in systems.values():
            one_round(s, [rand(g, vocab, prompt) for _ in range(threads)], threads)  # warm-up
        for i in range(pairs):
            order = ORDERS3[i % 6] if extra_b is not None else (("on", "off") if i % 2 == 0 else ("off", "on"))
            for key in order:
                rounds[key].append(one_round(systems[key], [rand(g, vocab, prompt) for _ in range(requests)], threads))
            log(f"block {i}: " + " / ".join(f"{k} {rounds[k][-1]['req_per_s']:.2f}" for k in keys) + " req/s")
        counters = {k: systems[k].report.detail.get("pool") for k in keys if k != "off"}
    tput = {k: np.array([r["req_per_s"] for r in v]) for k, v in rounds.items()}
    # CPU: requests per CPU-second, so that on/off < 1 means the pool costs, like the throughput ratio
    cpu = {k: np.array([1e3 / r["cpu_ms_per_request"] for r in v]) for k, v in rounds.items()}
    out = {"model": "tiny", "prompt_tokens": prompt, "requests_per_round": requests, "threads": threads,
           "store_bytes": store_bytes, "pool_on_extra": extra_on, "rounds": rounds,
           "median_req_per_s": {k: float(np.median(v)) for k, v in tput.items()},
           "ratio": ratio_ci(tput["on"], tput["off"]), "cpu_ratio": ratio_ci(cpu["on"], cpu["off"]),
           "median_cpu_ms_per_request": {k: float(np.median([r["cpu_ms_per_request"] for r in v]))
                                         for k, v in rounds.items()},
           "pool_on_counters": counters["on"]}
    if extra_b is not None:
        out.update(pool_on_b_extra=extra_b, pool_on_b_counters=counters["on_b"],
                   ratio_b=ratio_ci(tput["on_b"], tput["off"]), cpu_ratio_b=ratio_ci(cpu["on_b"], cpu["off"]),
                   ratio_on_vs_b=ratio_ci(tput["on"], tput["on_b"]))
    return out


def report(r: dict) -> str:
    m, t = r["machine"], r["result"]
    q, c = t["ratio"], t["cpu_ratio"]
    return "\n".join([
        f"## moorage zero-hit tax (pool on vs off, distinct prompts)\n\n{m['cpu_count']} CPUs, {m['date']}; load avg "
        f"start {m['loadavg_1m_5m_15m'][0]:.2f} / end {m['loadavg_at_end'][0]:.2f}\n",
        md_table(["pool", "rounds x requests", "median req/s", "mean req/s", "median CPU ms/req",
                  "median p50 latency ms"],
                 [[k, f"{len(t['rounds'][k])} x {t['requests_per_round']}", t["median_req_per_s"][k],
                   statistics.fmean(x["req_per_s"] for x in t["rounds"][k]), t["median_cpu_ms_per_request"][k],
                   statistics.median(x["p50_latency_ms"] for x in t["rounds"][k])] for k in t["rounds"]]),
        "",
        f"on/off, ratio of means: {q['ratio_of_means']:.3f} (95% CI {q['ratio_of_means_ci95'][0]:.3f} - "
        f"{q['ratio_of_means_ci95'][1]:.3f}); geometric mean of pair ratios {q['geomean_pair_ratio']:.3f} (95% CI "
        f"{q['geomean_pair_ratio_ci95'][0]:.3f} - {q['geomean_pair_ratio_ci95'][1]:.3f}); {q['pairs']} pairs",
        f"requests per CPU-second of the whole system (services + nats + mooncake, to the idle report), on/off: "
        f"{c['ratio_of_means']:.3f} (95% CI {c['ratio_of_means_ci95'][0]:.3f} - {c['ratio_of_means_ci95'][1]:.3f}); "
        f"median CPU ms/request on {t['median_cpu_ms_per_request']['on']:.1f}, off "
        f"{t['median_cpu_ms_per_request']['off']:.1f}",
        f"pool-on counters: {t['pool_on_counters']}",
        *([] if "ratio_b" not in t else [
            f"\nsecond pool-on system (on_b: {' '.join(t['pool_on_b_extra'])}), on_b/off: "
            f"{t['ratio_b']['ratio_of_means']:.3f} (95% CI {t['ratio_b']['ratio_of_means_ci95'][0]:.3f} - "
            f"{t['ratio_b']['ratio_of_means_ci95'][1]:.3f}); per CPU-second {t['cpu_ratio_b']['ratio_of_means']:.3f} "
            f"(95% CI {t['cpu_ratio_b']['ratio_of_means_ci95'][0]:.3f} - {t['cpu_ratio_b']['ratio_of_means_ci95'][1]:.3f});"
            f" on/on_b {t['ratio_on_vs_b']['ratio_of_means']:.3f} (95% CI "
            f"{t['ratio_on_vs_b']['ratio_of_means_ci95'][0]:.3f} - {t['ratio_on_vs_b']['ratio_of_means_ci95'][1]:.3f})",
            f"on_b counters: {t['pool_on_b_counters']}"])])


def plot(r: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t, q = r["result"], r["result"]["ratio"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for k in t["rounds"]:
        ax.plot([x["req_per_s"] for x in t["rounds"][k]], "o-", label=f"pool {k}")
    ax.set(xlabel="block (alternating order)", ylabel="requests/s", title=f"tiny, {t['prompt_tokens']}-tok distinct prompts, "
                                                                  f"{t['threads']} threads")
    ax.legend()
    bx.hist(q["pair_ratios"], bins=15, alpha=0.6, label="on / off")
    if "ratio_b" in t:
        qb = t["ratio_b"]
        bx.hist(qb["pair_ratios"], bins=15, alpha=0.5, color="C2", label=f"on_b / off ({' '.join(t['pool_on_b_extra'])})")
        lo_b, hi_b = qb["ratio_of_means_ci95"]
        bx.axvspan(lo_b, hi_b, alpha=0.15, color="C2", label=f"on_b: 95% CI [{lo_b:.3f}, {hi_b:.3f}]")
        bx.axvline(qb["ratio_of_means"], color="C2", label=f"on_b ratio of means {qb['ratio_of_means']:.3f}")
    lo, hi = q["ratio_of_means_ci95"]
    bx.axvspan(lo, hi, alpha=0.2, color="C1", label=f"95% CI of ratio of means [{lo:.3f}, {hi:.3f}]")
    bx.axvline(q["ratio_of_means"], color="C1", label=f"ratio of means {q['ratio_of_means']:.3f}")
    bx.axvline(0.98, color="k", ls="--", label="goal 0.98")
    bx.set(xlabel="on / off requests/s, per pair", title="zero-hit tax")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=20, help="blocks of one round per system (alternating order)")
    ap.add_argument("--requests", type=int, default=12, help="requests per round")
    ap.add_argument("--threads", type=int, default=4, help="client threads")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens (distinct random ids)")
    ap.add_argument("--on", action="append", default=[], help="extra config override for the pool-on system")
    ap.add_argument("--compare", action="append", default=None,
                    help="run a second pool-on system (on_b) with this override (repeatable), in the same blocks")
    ap.add_argument("--out", default=None, help="JSON result, PNG beside it (default runs/zero_hit-<time>/zero_hit.json)")
    args = ap.parse_args(argv)
    args.out = args.out or f"runs/zero_hit-{time.strftime('%Y%m%d-%H%M%S')}/zero_hit.json"
    info, t_start = machine_info(), time.perf_counter()
    result = bench(args.pairs, args.requests, args.threads, args.prompt, args.on, args.compare)
    r = {"command": " ".join(["python -m bench.zero_hit", *(argv if argv is not None else sys.argv[1:])]),
         "machine": info, "params": vars(args) | {"seed": SEED, "bootstrap": BOOT, "max_tokens": MAX_TOKENS},
         "result": result}
    write_result(r, args.out, t_start, plot, report)


if __name__ == "__main__":
    main()
