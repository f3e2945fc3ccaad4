"""`moorage bench tiers`: agent sessions that pause for tools (seconds to ten minutes) under memory pressure,
against five systems at once, each one tier richer than the last, and a sixth that holds everything (issue 29):

    lru        plain LRU everywhere (router.retention = lru, no prefetch)
    session    retention by expected return: a turn that ended in a tool call is kept (device LRU order,
               Mooncake soft pin sized from observed pauses); an ended task goes first
    prefetch   + prefetch on resume (halfway through the expected pause, back into the device cache)
    disk       + the stores' disk tier (up.disk_bytes: evicted chunks come back from local disk)
    compact    + bfloat16 pool objects (prefill.pool.dtype: twice the chunks per byte of DRAM; lossy)
    unbounded  the ceiling, measured: plain LRU with a device cache that holds every session's KV at once

    python -m bench.agentic.tiers [--quick] [--out bench/results/tiers.json]

Workload: bench.agentic.synth's corpus (subagents included), its sessions starting 10 s apart, replayed with
`tool_turns` (every request carries the tool list, as an agent's does; a turn the trace ended in a tool call
is sent with tool_choice "required", so it ends in a real call) and the recorded think time of every
main-thread request replaced by a draw from a documented tool-pause mixture (PAUSES: 55% 2-30 s, 30% 30 s-5 min,
15% 5-10 min, log-uniform within each), waited for real, uncapped. Memory: each system's prefill device cache
and DRAM pool together hold a third of the sessions' distinct KV (the working set, in the tiny model's float32
KV) or less; decode keeps no history (decode reuse off); the disk holds it all. The sixth system, `unbounded`,
holds everything in its device cache: its hit share is the ceiling, measured with the same prompts and blocks.

The systems run side by side on this host, each replaying the same corpus at the same moments: they share the
CPU equally, so their differences are the tiers', not the hour's. Per system: the returning turns' share of
prompt tokens served from cache, against the measured ceiling and the trace's own (trace tokens: without the
chat template and tool list every prompt starts with); TTFT p50/p90 of returning turns split by the pause
before them (< 30 s, 30 s-5 min, > 5 min); each session's job completion time (first send to last answer) and
model wait (the time after its first turn that a request of it was in flight: JCT less the tool pauses); bytes
restored from the pool, written to and read from disk; prefetches used and wasted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from bench._util import LoadWatcher, machine_info, md_table, percentile, write_result
from bench.agentic.replay import ReplayConfig, bench_synth_params, replay
from bench.agentic.trace import iter_requests

# (share, low s, high s): the tool-pause mixture every main-thread request's think time is drawn from
PAUSES = ((0.55, 2.0, 30.0), (0.30, 30.0, 300.0), (0.15, 300.0, 600.0))
BUCKETS = (("<30s", 0.0, 30.0), ("30s-5min", 30.0, 300.0), (">5min", 300.0, math.inf))
KV_BYTES_PER_TOKEN = 4096  # the tiny model's float32 KV
MODES = {
    "lru": ["router.router.retention=lru", "prefill.pool.prefetch=false"],
    "session": ["router.router.retention=session", "prefill.pool.prefetch=false"],
    "prefetch": ["router.router.retention=session"],
    "disk": ["router.router.retention=session", "@disk"],
    "compact": ["router.router.retention=session", "@disk", "prefill.pool.dtype=bfloat16"],
    "unbounded": ["router.router.retention=lru", "prefill.pool.prefetch=false", "@unbounded"],
}
CEILING_MODE = "unbounded"  # its hit share is the measured ceiling; the trace's own counts trace tokens, without the
                            # chat template and tool list every prompt starts with, and in the trace's blocks, not ours


@dataclass(frozen=True)
class Size:
    sessions: int = 16
    turns: int = 4
    pause_scale: float = 1.0   # every drawn pause x this (the quick size shortens them; the full size is real)
    cache_share: float = 0.33  # device caches + DRAM pool hold at most this share of the working set
    start_stagger_s: float = 10.0  # session k starts k x this after the first (not 16 cold prompts in one second)


QUICK = Size(sessions=3, turns=4, pause_scale=0.01, start_stagger_s=1.0)
FULL = Size()


def corpus(size: Size, seed: int = 0) -> list:
    from bench.agentic.synth import synthesize

    params = bench_synth_params(False, sessions=size.sessions, turns=size.turns, min_turns=min(4, size.turns),
                                seed=seed, fanout_prob=0.1)
    sessions = synthesize(params)
    rng = random.Random(seed)
    for s in sessions:
        for thread, req in iter_requests(s):
            if thread == "main" and req.think_time > 0:
                u, acc = rng.random(), 0.0
                for share, lo, hi in PAUSES:
                    acc += share
                    if u <= acc:
                        break
                req.think_time = round(math.exp(rng.uniform(math.log(lo), math.log(hi))) * size.pause_scale, 3)
    return sessions


def sizing(sessions: list, size: Size) -> dict:
    """Blocks and bytes per system: the prefill's device cache two of the longest requests (a restore needs
    free blocks beside a prompt in flight), the pool the rest of `cache_share` of the working set (it evicts
    at 90% full). Decode keeps no history (decode reuse off: it would be a third cache) and holds six of the
    longest requests, so that admission never waits on it."""
    seen, distinct, longest = set(), 0, 0
    for s in sessions:
        for _, r in iter_requests(s):
            longest = max(longest, r.in_tokens + r.out_tokens + 256)  # + template, salt and tool
            for h in r.hash_ids:
                if (s.id, h) not in seen:
                    seen.add((s.id, h))
                    distinct += s.block_size
    working = distinct * KV_BYTES_PER_TOKEN
    device_blocks = math.ceil(2 * longest / 16)
    decode_blocks = math.ceil(6 * longest / 16)
    cached = device_blocks * 16 * KV_BYTES_PER_TOKEN
    store = max(16 << 20, int(size.cache_share * working - cached))  # Mooncake's smallest segment: 16 MiB
    requests = sum(1 for s in sessions for _ in iter_requests(s))
    unbounded = math.ceil((distinct + 256 * requests) / 16) + device_blocks  # + every prompt's own template
    return {"distinct_tokens": distinct, "working_set_bytes": working, "longest_tokens": longest,
            "device_blocks": device_blocks, "decode_blocks": decode_blocks, "store_bytes": store,
            "unbounded_blocks": unbounded,
            "cache_to_working_set": round((cached + store) / working, 3), "disk_bytes": 2 * working}


def overrides(mode: str, sz: dict, run_dir: str) -> list[str]:
    base = ["up.model=tiny", "up.stores=1", f"up.store_bytes={sz['store_bytes']}", f"up.run_dir={run_dir}/{mode}",
            f"prefill.engine.num_blocks={sz['device_blocks']}", f"decode.engine.num_blocks={sz['decode_blocks']}",
            "prefill.engine.chunk_tokens=64", "prefill.pool.restore_batch_chunks=16", "up.port=0",
            "decode.transfer.decode_reuse=false",
            "up.ready_timeout_s=300", "up.disk_bytes=0"]  # DRAM only unless the mode says @disk
    sub = {"@disk": [f"up.disk_bytes={sz['disk_bytes']}", f"up.disk_dir={Path(run_dir) / mode / 'disk'}"],
           "@unbounded": [f"prefill.engine.num_blocks={sz['unbounded_blocks']}"]}
    return base + [x for o in MODES[mode] for x in sub.get(o, [o])]


def fresh_disk(run_dir: str, mode: str) -> Path:
    """Empties the disk tier a system of an earlier run left in its run directory: every run replays the same
    prompts, so its files would be hits this run never earned (a rerun read 630 MB from disk and wrote 0)."""
    path = Path(run_dir) / mode / "disk"
    shutil.rmtree(path, ignore_errors=True)
    return path


def offline_bounds(sessions: list, records: list[dict], sz: dict) -> dict:
    """What LRU and the offline optimum (Belady, bench/agentic/offline.py) would reuse of the replay's blocks with
    the systems' memory: the DRAM pool alone (up to its 90% eviction watermark) and the device cache with it, in
    trace blocks, replaying the requests in the trace's own time order and in the order this system served them
    (queueing reorders: what that costs is told apart from what the policy loses). Shares of the blocks of the
    returning main-thread turns, as the summary counts them (the other requests fill the cache as in the run,
    uncounted), in trace tokens: they compare with the trace ceiling (`ceiling` here), not with the measured hit
    share, which counts the template every prompt repeats."""
    from bench.agentic.offline import policies
    from bench.agentic.trace import scope_namespace

    bs = sessions[0].block_size
    dram_tokens = int(0.9 * sz["store_bytes"] / KV_BYTES_PER_TOKEN)
    caps = {"dram": dram_tokens // bs, "device+dram": (sz["device_blocks"] * 16 + dram_tokens) // bs}
    # counted as summarize_mode counts: the returning main-thread turns that were answered
    count = {(r["session"], r["thread"], r["index"]): not r["warmup"] and r["thread"] == "main" and r["status"] == 200
             for r in records}
    trace, by_key = [], {}
    for si, sess in enumerate(sessions):
        counts: dict[str, int] = {}
        for order, (thread, r) in enumerate(iter_requests(sess)):
            key = (sess.id, thread, counts.setdefault(thread, -1) + 1)
            counts[thread] = key[2]
            by_key[key] = (scope_namespace(sess), r.hash_ids)
            trace.append((r.t, si, order, key))
    trace.sort(key=lambda e: e[:3])
    served = [k for k in ((r["session"], r["thread"], r["index"]) for r in sorted(records, key=lambda r: r["t_start"]))
              if k in by_key]
    out = {}
    for name, keys in (("trace_order", [e[3] for e in trace if e[3] in count]), ("served_order", served)):
        out[name] = policies([by_key[k] for k in keys], caps, [count[k] for k in keys])
    return out


def bucket_of(pause: float) -> str:
    return next(name for name, lo, hi in BUCKETS if lo <= pause < hi)


def model_wait_s(records: list[dict]) -> dict[str, float]:
    """Per session, the time after its first (cold, warm-up) turn that it waited on the model: the union of its
    requests' send-to-last-token intervals (subagents overlap). A session's JCT is this plus its tool pauses, which
    no cache shortens."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for r in records:
        if not r["warmup"]:
            spans.setdefault(r["session"], []).append((r["t_start"], r["t_end"]))
    out = {}
    for sid, iv in spans.items():
        total, lo, hi = 0.0, None, None
        for a, b in sorted(iv):
            if hi is None or a > hi:
                total += 0.0 if hi is None else hi - lo
                lo, hi = a, b
            else:
                hi = max(hi, b)
        out[sid] = round(total + hi - lo, 2)
    return out


def summarize_mode(mode: str, stats: dict, reports: dict) -> dict:
    recs = [r for r in stats["records"] if not r["warmup"]]
    returning = [r for r in recs if r["thread"] == "main" and r["status"] == 200]
    ttft = {}
    for name, _, _ in BUCKETS:
        xs = [r["ttft_s"] for r in returning if r["ttft_s"] is not None and bucket_of(r["think_s"]) == name]
        ttft[name] = {"n": len(xs), "p50": percentile(xs, 50) if xs else None,
                      "p90": percentile(xs, 90) if xs else None}
    prompt = sum(r["prompt_tokens"] for r in returning)
    reused = sum(r["device"] + r["store"] for r in returning)
    ceiling = sum(r.get("ceiling_tokens", 0) for r in returning)
    jct = {}
    for r in stats["records"]:
        lo, hi = jct.get(r["session"], (math.inf, 0.0))
        jct[r["session"]] = (min(lo, r["t_start"]), max(hi, r["t_end"]))
    jct_s = {s: round(hi - lo, 2) for s, (lo, hi) in jct.items()}
    wait_s = model_wait_s(stats["records"])
    prefill = next((r.detail for r in reports.values() if r.role == "prefill"), {})
    pool = prefill.get("pool") or {}
    disk = next((r.detail.get("disk") for r in reports.values() if r.role == "store" and r.detail.get("disk")), {})
    sessions = next((r.detail.get("sessions") for r in reports.values() if r.role == "router"), None) or {}
    return {
        "mode": mode, "returning_turns": len(returning), "errors": stats["errors"]["total"],
        "hit_share": round(reused / prompt, 4) if prompt else None,
        "ceiling_share": round(ceiling / prompt, 4) if prompt else None,
        "sources": {k: sum(r[k] for r in returning) for k in ("device", "store", "computed")},
        "ttft_s": ttft,
        "jct_s": jct_s, "jct_mean_s": round(sum(jct_s.values()) / len(jct_s), 2) if jct_s else None,
        "wait_s": wait_s, "wait_mean_s": round(sum(wait_s.values()) / len(wait_s), 2) if wait_s else None,
        "pool": {k: pool.get(k) for k in ("restored_chunks", "restored_bytes", "saved_chunks", "saved_pinned_chunks",
                                          "prefetches", "prefetched_chunks", "prefetch_used", "prefetch_wasted",
                                          "prefetch_lost",
                                          "disk_loads", "disk_loaded_chunks", "disk_load_failures", "verify_failures")},
        "disk": {k: disk.get(k) for k in ("written", "written_bytes", "read", "read_bytes", "evicted",
                                          "verify_failures", "spill_missed", "objects", "bytes")} if disk else None,
        "pin": {k: sessions.get(k) for k in ("pin_s", "pool_turnover_s", "pauses_seen", "pause_p50_s", "pause_p95_s")},
    }


async def _replay_all(urls: dict[str, str], sessions: list, tag_seed: int, stagger_s: float) -> dict[str, dict]:
    async def one(mode: str, url: str) -> dict:
        cfg = ReplayConfig(base_url=url, model="tiny", concurrency=len(sessions), think_time_scale=1.0,
                           think_time_cap_s=None, warmup_turns=1, tool_turns=True, tag=f"t{tag_seed}",
                           request_timeout_s=600.0, start_stagger_s=stagger_s)
        return await replay(sessions, cfg, progress=False)

    done = await asyncio.gather(*(one(m, u) for m, u in urls.items()))
    return dict(zip(urls, done))


def run(size: Size, run_dir: str, extra: list[str] = (), modes: list[str] | None = None) -> dict:
    from infra.up import UpConfig, launched_side_by_side
    from shared.config import load_config

    sessions = corpus(size)
    sz = sizing(sessions, size)
    modes = modes or list(MODES)
    watchers, sets = {}, {mode: overrides(mode, sz, run_dir) + list(extra) for mode in modes}
    for mode in modes:
        fresh_disk(run_dir, mode)
    with contextlib.ExitStack() as stack:
        systems = stack.enter_context(launched_side_by_side(
            {mode: load_config(UpConfig, overrides=sets[mode], env={}) for mode in modes}))
        urls = {mode: url for mode, (_, url) in systems.items()}
        for mode, (launcher, _) in systems.items():
            watchers[mode] = LoadWatcher(launcher.nats.url, f"bench-tiers-{mode}")
            stack.callback(watchers[mode].close)
        t0 = time.perf_counter()
        stats = asyncio.run(_replay_all(urls, sessions, 0, size.start_stagger_s))
        wall = time.perf_counter() - t0
        time.sleep(2.5)  # one more load report from every instance
        reports = {m: {i: r for i, (_, r) in w.latest.items()} for m, w in watchers.items()}
    summary = [summarize_mode(m, stats[m], reports[m]) for m in modes]
    base = next((s for s in summary if s["mode"] == "lru"), None)
    top = next((s["hit_share"] for s in summary if s["mode"] == CEILING_MODE), None)
    for s in summary:
        s["measured_ceiling"] = top
        s["below_measured_ceiling"] = round(top - s["hit_share"], 4) if None not in (top, s["hit_share"]) else None
        for k in ("jct", "wait"):
            mean = s[f"{k}_mean_s"]
            s[f"{k}_vs_lru"] = round(base[f"{k}_mean_s"] / mean, 3) if base and base[f"{k}_mean_s"] and mean else None
    for s in summary:
        s["offline"] = offline_bounds(sessions, stats[s["mode"]]["records"], sz)
    pauses = [r.think_time for s in sessions for t, r in iter_requests(s) if t == "main" and r.think_time > 0]
    return {"params": {"size": dataclasses.asdict(size), "quick": size != FULL, "pauses": PAUSES, "sizing": sz,
                       "pause_counts": {name: sum(lo <= p < hi for p in pauses) for name, lo, hi in BUCKETS},
                       "requests": sum(1 for s in sessions for _ in iter_requests(s))},
            "wall_s": round(wall, 1), "overrides": sets, "summary": summary,
            "records": {m: stats[m]["records"] for m in modes}}


def report(result: dict) -> str:
    def ms(x):
        return "-" if x is None else f"{x * 1e3:.0f}"
    rows = []
    for s in result["summary"]:
        t = s["ttft_s"]
        rows.append([s["mode"], s["hit_share"], s["below_measured_ceiling"], s["ceiling_share"],
                     *(f"{ms(t[b]['p50'])} / {ms(t[b]['p90'])} (n={t[b]['n']})" for b, _, _ in BUCKETS),
                     s["jct_mean_s"], s["jct_vs_lru"], s.get("wait_mean_s"), s.get("wait_vs_lru"),
                     (s["pool"] or {}).get("restored_bytes"),
                     (s["disk"] or {}).get("written_bytes"), (s["disk"] or {}).get("read_bytes"),
                     f"{(s['pool'] or {}).get('prefetch_used')} / {(s['pool'] or {}).get('prefetch_wasted')}",
                     *_offline_cells(s), s["errors"]])
    return md_table(["mode", "returning hit share", f"below {CEILING_MODE}", "trace ceiling",
                     *(f"TTFT ms p50 / p90, pause {b}" for b, _, _ in BUCKETS),
                     "JCT mean s", "JCT vs lru", "model wait mean s", "wait vs lru", "pool bytes restored", "disk bytes written", "disk bytes read",
                     "prefetch used / wasted", "offline lru / optimum, dram (served order)",
                     "offline lru / optimum, device+dram (served order)", "errors"], rows)


def _offline_cells(s: dict) -> list[str]:
    off = (s.get("offline") or {}).get("served_order") or {}
    return [f"{off[k]['lru']:.3f} / {off[k]['optimum']:.3f}" if k in off else "-" for k in ("dram", "device+dram")]


def rewrite_offline(out: str) -> int:
    import json

    path = Path(out)
    result = json.loads(path.read_text())
    size = Size(**result["params"]["size"])
    sessions = corpus(size)
    for s in result["summary"]:
        s["offline"] = offline_bounds(sessions, result["records"][s["mode"]], result["params"]["sizing"])
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))
    return 0


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = range(len(summary))
    a.bar(x, [s["hit_share"] or 0 for s in summary], 0.6, label="served from cache")
    a.plot(x, [s["ceiling_share"] or 0 for s in summary], "k_", markersize=30, label="trace ceiling (trace tokens)")
    if summary[0].get("measured_ceiling") is not None:
        a.axhline(summary[0]["measured_ceiling"], color="tab:red", linestyle="--", label=f"measured ceiling ({CEILING_MODE})")
    a.set_xticks(list(x), [s["mode"] for s in summary])
    a.set_ylabel("returning turns: prompt share from cache")
    a.legend()
    w = 0.8 / len(BUCKETS)
    for i, (name, _, _) in enumerate(BUCKETS):
        b.bar([j + (i - 1) * w for j in x], [(s["ttft_s"][name]["p50"] or 0) * 1e3 for s in summary], w,
              label=f"pause {name}")
    b.set_xticks(list(x), [s["mode"] for s in summary])
    b.set_ylabel("TTFT p50 of returning turns (ms)")
    b.legend()
    fig.suptitle("tool pauses under memory pressure: the tiers side by side")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moorage bench tiers", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 short sessions, pauses x 0.01 (a smoke run)")
    ap.add_argument("--out", default="bench/results/tiers.json")
    ap.add_argument("--run-dir", default="runs/tiers")
    ap.add_argument("--modes", default=",".join(MODES), help="which systems (default: all six)")
    ap.add_argument("--set", action="append", default=[], help="moorage up override for every system (repeatable)")
    ap.add_argument("--offline-only", action="store_true",
                    help="recompute the offline LRU and optimum of the result at --out from its own records (the corpus "
                         "is seeded: the same sessions), and rewrite it; runs no system")
    args = ap.parse_args(argv)
    if args.offline_only:
        return rewrite_offline(args.out)
    t0 = time.perf_counter()
    result = run(QUICK if args.quick else FULL, args.run_dir, args.set, args.modes.split(","))
    result["machine"] = machine_info()
    write_result(result, args.out, t0, plot, report)
    return 0 if not any(s["errors"] for s in result["summary"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
