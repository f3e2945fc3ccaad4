"""KV handoff and router/gate overhead benchmark, on the real system (nats + gate + decode + prefill +
router as processes, started with infra.up.Launcher; one system per model, default 8 MiB slots).

Run from the repository root (full run: ~9 minutes on 2 CPU cores, mostly SmolLM2's cold 8K
prefill, once per mode; --quick: tiny, 2K, direct only, R=1, N=10, ~30 s):

    .venv/bin/python -m bench.handoff --out bench/results/handoff.json
    .venv/bin/python -m bench.handoff --quick --out bench/results/handoff-quick.json

Handoff modes: `direct` (the default: prefill's blocks straight into decode's pages, every write verified
by decode at HandoffDone over tcp), `direct-early` (the same with transfer.early_verify=on: decode verifies
the writes prefill reports landed while the rest are on the wire, the default over rdma) and `slots` (the
staged path: gather, landing slots, scatter); a full run starts one system per model and mode, one
after the other, with the same prompts, so all are measured against the same raw baseline in one run.

1. Handoff: each prompt (random token ids, seeded) goes through the router once to warm (computes the
   prefill) and then R more times (the prefix cache makes prefill nearly free; the handoff still moves
   every byte). From <run_dir>/traces.jsonl each request's `kv.handoff` span gives bytes, writes,
   rounds, gather/write/scatter ms and its duration (the whole handoff). handoff GB/s = bytes / duration,
   write GB/s = bytes / write_ms. Baseline: a raw Transfer Engine write of the same bytes, in the same
   pieces, in one `write` call, between two KVTransports in this process; its writes are interleaved with
   the handoff repeats (median of 2 per repeat) so both see the same machine load. Second baseline, the
   floor (bench/handoff_floor.py): the same write into a child process, then a HandoffDone of the request's
   shape on the system's bus and its Ack, sent once the child has checked every piece's CRC-32C; what any
   checksummed push handoff between two processes pays here, with nothing of moorage's (the floor less the
   child's check is reported as the unchecked floor). handoff/floor is moorage's own cost; floor/raw the
   machine's. Each ratio comes with a 95% bootstrap interval over the repeats (`ci95`: a repeat is one
   handoff with the raw and floor writes just before it, drawn together): the raw write alone spreads
   2-3x within a case on this box, so one run's ratio is an estimate, and the interval says how good.
2. Overhead (tiny, ~32-token prompts, max_tokens=1 so the request ends at prefill): (a) POST
   /v1/completions through the router (httpx keep-alive) vs (b) PrefillSubmit straight to the prefill on
   the bus and wait for the final TokenChunk (no gate, no HTTP). Interleaved, order alternating. The code
   and its per-stage breakdown live in bench/overhead.py (`python -m bench.overhead` runs it alone).
Writes the JSON (GB = 1e9 B, ms = milliseconds), a PNG with the same stem, and prints markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch

from bench._util import machine_info, md_table, percentile, write_result
from bench.handoff_floor import FloorTE
from bench.overhead import bench_overhead, breakdown
from shared.config import load_config
from shared.engine.models import load_tokenizer
from shared.engine.sampling import SamplingParams
from shared.messages import HandoffDone
from shared.tracing import read_spans
from shared.transfer import DEFAULT_MAX_BATCH as MAX_BATCH
from shared.transfer import DEFAULT_SLOT_BYTES, KVTransport, plan_writes
from infra.up import Launcher, UpConfig

SEED = 20240601
SMOL = "smollm2-135m"
BLOCKS = 1024  # per engine: 16384 tokens, so a cached 2K and an 8K prompt fit on prefill (gate: 90% of decode's)
TRACE_NAMES = ("router.request", "prefill.queue", "prefill.compute", "kv.handoff", "decode.generate")
FULL = dict(models=["tiny", SMOL], prompts=[2048, 8190], repeats=16, raw_per_repeat=2, overhead_n=50,
            overhead_warm=5, modes=["direct", "direct-early", "slots"])
QUICK = dict(models=["tiny"], prompts=[2048], repeats=1, raw_per_repeat=3, overhead_n=10,
             overhead_warm=3, modes=["direct"])
MODE_SET = {"direct": ("prefill.transfer.direct=true",),
            "direct-early": ("prefill.transfer.direct=true", "prefill.transfer.early_verify=on"),
            "slots": ("prefill.transfer.direct=false",)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def complete(client: httpx.Client, model: str, prompt: list[int]) -> tuple[str, float]:
    """(request id, seconds) of one non-streaming greedy completion of 2 tokens through the router."""
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2,
                                             "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return r.headers["x-request-id"], time.perf_counter() - t0


def wait_spans(path: Path, names: tuple[str, ...], rids: set[str], timeout: float = 30.0) -> dict:
    """{name: {request_id: span}} for every name and rid (services export spans in batches every few s)."""
    deadline = time.monotonic() + timeout
    while True:
        got = {n: {} for n in names}
        for s in read_spans(path):
            if s["name"] in got:
                got[s["name"]][s["attributes"].get("request_id")] = s
        missing = [n for n in names if not rids <= got[n].keys()]
        if not missing:
            return got
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {', '.join(missing)} span for some requests in {path}")
        time.sleep(0.5)


class RawTE:
    """Two KVTransports in this process; `write()` times one batched write of `lengths` pieces from one
    source buffer to one destination buffer (both registered, pages touched), like one handoff's bytes."""

    def __init__(self, lengths: list[int]):
        self.lengths, total, offs = lengths, sum(lengths), [sum(lengths[:i]) for i in range(len(lengths))]
        self.a, self.b = KVTransport(), KVTransport()
        self.src, self.dst = torch.ones(total, dtype=torch.uint8), torch.zeros(total, dtype=torch.uint8)
        self.a.register(self.src), self.b.register(self.dst)
        self.s_addr, self.d_addr = [self.src.data_ptr() + o for o in offs], [self.dst.data_ptr() + o for o in offs]
        self.write()  # warm-up: connection set-up
        assert bool(self.dst[-1] == 1)

    def write(self) -> float:
        t0 = time.perf_counter()
        self.a.write(self.b.endpoint, self.s_addr, self.d_addr, self.lengths)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.a.close(), self.b.close()


def bench_handoff(client, launcher, model: str, vocab: int, p: dict, g: torch.Generator) -> list[dict]:
    traces, runs = launcher.run_dir / "traces.jsonl", []
    for n in p["prompts"]:
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        rid, warm_s = complete(client, model, ids)
        log(f"{model} {n} tok: warm request {warm_s:.1f} s")
        warm = wait_spans(traces, ("kv.handoff",), {rid})["kv.handoff"][rid]["attributes"]
        nbytes, writes = warm["bytes"], warm["writes"]
        if warm.get("mode") == "direct":  # spans of consecutive blocks, straight into decode's pages
            pieces = list(warm["entry_bytes"])
            window = max(pieces)
            assert sum(pieces) == nbytes and writes == -(-len(pieces) // MAX_BATCH), (pieces, writes)
        else:
            window = DEFAULT_SLOT_BYTES  # the handoff's windows: exactly one slot each, the last one shorter
            pieces = [length for _, length in plan_writes(nbytes, window)]
            assert len(pieces) == writes == -(-nbytes // DEFAULT_SLOT_BYTES), (pieces, writes)
        done = HandoffDone(rid, ids, [], "", SamplingParams(max_tokens=2), {"device": n},
                           pages=[])  # the request's size on the bus: FloorTE adds a page entry per piece
        raw, floor, raw_s, floor_s, reps = RawTE(pieces), FloorTE(pieces, launcher.nats.url, done), [], [], []
        try:  # raw and floor writes interleaved with the handoff repeats: all see the same machine load
            for _ in range(p["repeats"]):
                for _ in range(p["raw_per_repeat"]):
                    raw_s.append(raw.write())
                    floor_s.append(floor.write())
                reps.append(complete(client, model, ids))
        finally:
            raw.close()
            floor.close()
        med_raw = statistics.median(raw_s)
        raw = {"bytes": nbytes, "pieces": len(pieces), "repeats": len(raw_s), "times_ms": [t * 1e3 for t in raw_s],
               "median_ms": med_raw * 1e3, "GBps": nbytes / med_raw / 1e9, "best_GBps": nbytes / min(raw_s) / 1e9}
        med_floor = statistics.median(t for _, t, _ in floor_s)
        med_unchecked = statistics.median(t - v for _, t, v in floor_s)
        floor = {"repeats": len(floor_s), "write_ms": [w * 1e3 for w, _, _ in floor_s],
                 "times_ms": [t * 1e3 for _, t, _ in floor_s], "verify_ms": [v * 1e3 for _, _, v in floor_s],
                 "done_bytes": len(done.encode()), "median_write_ms": statistics.median(w for w, _, _ in floor_s) * 1e3,
                 "median_verify_ms": statistics.median(v for _, _, v in floor_s) * 1e3, "median_ms": med_floor * 1e3,
                 "GBps": nbytes / med_floor / 1e9, "median_unchecked_ms": med_unchecked * 1e3,
                 "unchecked_GBps": nbytes / med_unchecked / 1e9}
        runs.append((n, rid, warm_s, reps, raw, floor, window))
    rids = {r[1] for r in runs} | {x[0] for r in runs for x in r[3]}
    spans_by = wait_spans(traces, TRACE_NAMES, rids)
    hand, comp = spans_by["kv.handoff"], spans_by["prefill.compute"]
    cases = []
    for n, warm_rid, warm_s, reps, raw, floor, window in runs:
        spans = [hand[rid]["attributes"] | {"duration_ms": hand[rid]["duration_ms"]} for rid, _ in reps]
        med = {k: statistics.median(s.get(k, 0.0) for s in spans) for k in
               ("duration_ms", "gather_ms", "write_ms", "scatter_ms", "crc_ms", "verify_ms", "grant_ms", "done_ms")}
        nbytes, writes, mode = spans[0]["bytes"], spans[0]["writes"], spans[0].get("mode", "slots")
        took, n_rep = [s["duration_ms"] for s in spans], len(spans)
        gbps, wgbps = nbytes / med["duration_ms"] / 1e6, nbytes / med["write_ms"] / 1e6
        case = {"model": model, "prompt_tokens": n, "mode": mode, "bytes": nbytes, "MB": nbytes / 1e6,
                "writes": writes, "entries": raw["pieces"],
                "writes_expected": -(-raw["pieces"] // MAX_BATCH) if mode == "direct" else -(-nbytes // DEFAULT_SLOT_BYTES),
                "rounds": spans[0]["rounds"], "piece_bytes": window, "repeats": len(spans),
                **{f"median_{k}": v for k, v in med.items()},
                "median_other_ms": med["duration_ms"] - med["gather_ms"] - med["write_ms"] - med["scatter_ms"],
                "handoff_GBps": gbps, "write_GBps": wgbps, "raw_te": raw, "raw_GBps": raw["GBps"],
                "ratio_handoff_vs_raw": gbps / raw["GBps"], "ratio_write_vs_raw": wgbps / raw["GBps"],
                "floor": floor, "floor_GBps": floor["GBps"], "ratio_floor_vs_raw": floor["GBps"] / raw["GBps"],
                "ratio_unchecked_floor_vs_raw": floor["unchecked_GBps"] / raw["GBps"],
                "ratio_handoff_vs_floor": gbps / floor["GBps"],
                "ci95": {"handoff_vs_raw": ratio_ci(raw["times_ms"], took, n_rep),
                         "floor_vs_raw": ratio_ci(raw["times_ms"], floor["times_ms"], n_rep),
                         "handoff_vs_floor": ratio_ci(floor["times_ms"], took, n_rep)},
                "spans": spans, "repeat_request_ms": [s * 1e3 for _, s in reps],
                "trace_median_ms": {k: statistics.median(spans_by[k][rid]["duration_ms"] for rid, _ in reps)
                                    for k in TRACE_NAMES},
                "repeat_tokens_reused": [comp[rid]["attributes"]["tokens_reused"] for rid, _ in reps],
                "warm_request_s": warm_s, "warm_handoff_ms": hand[warm_rid]["duration_ms"],
                "warm_prefill_compute_ms": comp[warm_rid]["duration_ms"]}
        log(f"{model} {n} tok, {mode}: handoff {case['median_duration_ms']:.1f} ms = {gbps:.2f} GB/s "
            f"(write-only {wgbps:.2f}), raw TE {raw['GBps']:.2f} GB/s, floor {floor['GBps']:.2f} GB/s")
        cases.append(case)
    return cases


def ratio_ci(base: list[float], times: list[float], repeats: int, seed: int = SEED, boot: int = 4000) -> list[float]:
    """95% bootstrap interval of median(base) / median(times) (the GB/s of `times` as a fraction of `base`'s),
    resampling repeats: each list holds the same number of times per repeat, in repeat order (a handoff
    and the raw and floor writes just before it saw the same load, so they are drawn together)."""
    rng = np.random.default_rng(seed)
    b, t = np.asarray(base).reshape(repeats, -1), np.asarray(times).reshape(repeats, -1)
    idx = rng.integers(0, repeats, size=(boot, repeats))
    ratios = np.median(b[idx].reshape(boot, -1), axis=1) / np.median(t[idx].reshape(boot, -1), axis=1)
    return [float(x) for x in np.percentile(ratios, [2.5, 97.5])]


EXTRA: list[str] = []  # --set overrides, after the bench's own


def run_system(model: str, mode: str, p: dict, overhead: bool) -> tuple[list[dict], dict | None]:
    g = torch.Generator().manual_seed(SEED)  # the same prompts in every mode
    with tempfile.TemporaryDirectory(prefix=f"bench-handoff-{model}-") as run_dir:
        cfg = load_config(UpConfig, overrides=[
            f"up.model={model}", "up.port=0", f"up.run_dir={run_dir}", "up.ready_timeout_s=600",
            f"prefill.engine.num_blocks={BLOCKS}", f"decode.engine.num_blocks={BLOCKS}", *MODE_SET[mode], *EXTRA])
        launcher = Launcher(cfg)
        try:
            base = launcher.start()
            launcher.wait_ready(base)
            log(f"{model}: system ready at {base}")
            vocab = load_tokenizer(model)[0].vocab_size
            with httpx.Client(base_url=base, timeout=1200) as client:
                cases = [c | {"bench_mode": mode} for c in bench_handoff(client, launcher, model, vocab, p, g)]
            over = asyncio.run(bench_overhead(base, launcher.nats.url, model, vocab, p, g)) if overhead else None
            if over is not None:
                over["breakdown"] = breakdown(over, launcher.run_dir / "traces.jsonl")
            return cases, over
        except Exception:
            for name in launcher.dead():  # the run dir goes away with the temp dir: show why it died
                log(f"{name} log tail:\n" + (Path(run_dir) / f"{name}.log").read_text()[-3000:])
            raise
        finally:
            launcher.stop()


def report(r: dict) -> str:
    m, o = r["machine"], r["overhead"]
    head = (f"## moorage KV handoff benchmark ({'quick' if r['params']['quick'] else 'full'})\n\n"
            f"torch {m['torch']}, {m['cpu_count']} CPUs, {m['date']}; load avg start "
            f"{m['loadavg_1m_5m_15m'][0]:.2f} / end {m['loadavg_at_end'][0]:.2f}; matmul calibration start "
            f"{m['calibration_matmul_GFLOPs_at_start']:.1f} / end {m['calibration_matmul_GFLOPs_at_end']:.1f} GFLOP/s; "
            f"slot {r['params']['slot_bytes']} B, Mooncake TE over tcp loopback\n")
    t1 = md_table(["model", "prompt tok", "mode", "MB", "writes", "expected", "spans", "rounds", "handoff ms", "gather ms",
                   "write ms", "scatter ms", "other ms", "handoff GB/s", "write GB/s", "raw TE GB/s", "floor GB/s",
                   "floor verify ms", "handoff/raw", "95% CI", "write/raw", "floor/raw", "95% CI", "unchecked floor/raw",
                   "handoff/floor"],
                  [[c["model"], c["prompt_tokens"], c.get("bench_mode", c.get("mode", "slots")), c["MB"], c["writes"], c["writes_expected"],
                    c.get("entries", c["writes"]), c["rounds"], c["median_duration_ms"],
                    c["median_gather_ms"], c["median_write_ms"], c["median_scatter_ms"], c["median_other_ms"],
                    c["handoff_GBps"], c["write_GBps"], c["raw_GBps"], c["floor_GBps"], c["floor"]["median_verify_ms"],
                    c["ratio_handoff_vs_raw"], _ci(c, "handoff_vs_raw"), c["ratio_write_vs_raw"], c["ratio_floor_vs_raw"],
                    _ci(c, "floor_vs_raw"), c["ratio_unchecked_floor_vs_raw"], c["ratio_handoff_vs_floor"]]
                   for c in r["handoff"]])
    t2 = md_table(["model", "prompt tok", "client ms", *(f"{n} ms" for n in TRACE_NAMES)],
                  [[c["model"], c["prompt_tokens"], statistics.median(c["repeat_request_ms"]),
                    *(c["trace_median_ms"][n] for n in TRACE_NAMES)] for c in r["handoff"]])
    t3 = md_table(["path (tiny, 32 tok, max_tokens=1)", "N", "p50 ms", "p99 ms", "mean ms"],
                  [["(a) router: HTTP + gate + prefill", o["n"], o["router"]["p50_ms"], o["router"]["p99_ms"],
                    o["router"]["mean_ms"]],
                   ["(b) direct PrefillSubmit on the bus", o["n"], o["direct"]["p50_ms"], o["direct"]["p99_ms"],
                    o["direct"]["mean_ms"]],
                   ["overhead (a) - (b) of percentiles", o["n"], o["overhead_p50_ms"], o["overhead_p99_ms"], ""],
                   ["overhead, paired per-iteration a - b", o["n"], o["paired_diff"]["p50_ms"],
                    o["paired_diff"]["p99_ms"], o["paired_diff"]["mean_ms"]]])
    return "\n".join([head, t1, "", "Repeat requests (prefix-cached), median span durations of their traces:", "",
                      t2, "", t3, "", "Notes: " + "; ".join(r["notes"])])


def _ci(case: dict, key: str) -> str:
    lo, hi = case.get("ci95", {}).get(key, (None, None))
    return "" if lo is None else f"{lo:.2f}-{hi:.2f}"


def plot(r: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(18, 6), gridspec_kw={"width_ratios": [1.7, 1]})
    fig.suptitle(f"moorage KV handoff ({'quick' if r['params']['quick'] else 'full'}) - {r['machine']['date']}, "
                 f"{r['machine']['cpu_count']} CPUs, tcp loopback, 8 MiB slots", fontsize=11)
    cs, w = r["handoff"], 0.21
    for j, (key, label) in enumerate((("handoff_GBps", "handoff (whole span)"), ("write_GBps", "handoff write only"),
                                      ("floor_GBps", "floor: write to another process + its CRC check + one bus round trip"),
                                      ("raw_GBps", "raw TE batch write, same bytes"))):
        bars = ax.bar([i + (j - 1.5) * w for i in range(len(cs))], [c[key] for c in cs], w, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(cs)), [f"{c['model'].split('-')[0]} {c['prompt_tokens']}\n{c.get('bench_mode', 'direct')}\n"
                                   f"{c['MB']:.0f} MB, {c['writes']} writes\nhandoff/raw {c['ratio_handoff_vs_raw']:.2f} "
                                   f"({_ci(c, 'handoff_vs_raw')})"
                                   for c in cs], fontsize=8)
    ax.set_ylabel("GB/s (1e9 B / median time)")
    ax.set_title("KV handoff throughput vs raw Transfer Engine")
    ax.legend(fontsize=8)
    o = r["overhead"]
    for xs, label in ((o["router_ms"], "(a) via router (HTTP + gate)"), (o["direct_ms"], "(b) direct on the bus")):
        s = sorted(xs)
        bx.step(s, [(i + 1) / len(s) for i in range(len(s))], where="post",
                label=f"{label}: p50 {percentile(xs, 50):.1f} ms, p99 {percentile(xs, 99):.1f} ms")
    bx.set_xlabel("request latency, ms (tiny, 32-token prompt, max_tokens=1)")
    bx.set_ylabel("CDF")
    bx.set_title(f"Router + gate overhead: p50 {o['overhead_p50_ms']:.1f} ms, p99 {o['overhead_p99_ms']:.1f} ms")
    bx.legend(fontsize=8, loc="lower right")
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny only, 2K only, R=1, N=10 (< 2 minutes)")
    ap.add_argument("--out", default=None, help="JSON result, PNG beside it (default runs/handoff-<time>/handoff.json, "
                                                "gitignored; pass bench/results/handoff.json to update the committed one)")
    ap.add_argument("--modes", default=None, help="handoff modes to run, comma-separated: direct,direct-early,slots "
                                                  "(default: all in a full run, direct in --quick)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="config override for the systems (repeatable), e.g. prefill.transfer.copy_threads=1")
    args = ap.parse_args(argv)
    EXTRA[:] = args.set
    args.out = args.out or f"runs/handoff-{time.strftime('%Y%m%d-%H%M%S')}/handoff.json"
    p, info, t_start = dict(QUICK if args.quick else FULL), machine_info(), time.perf_counter()
    if args.modes:
        p["modes"] = [m for m in args.modes.split(",") if m]
        if not p["modes"] or set(p["modes"]) - set(MODE_SET):
            ap.error(f"--modes takes {', '.join(MODE_SET)}")
    handoff, overhead = [], None
    for model in p["models"]:
        for mode in p["modes"]:  # one system per mode, one after the other: the same prompts, a close machine state
            cases, over = run_system(model, mode, p, overhead=model == "tiny" and mode == p["modes"][0])
            handoff += cases
            overhead = over or overhead
    result = {
        "command": " ".join(["python -m bench.handoff", *(argv if argv is not None else sys.argv[1:])]),
        "machine": info,
        "params": {"quick": args.quick, "seed": SEED, "slot_bytes": DEFAULT_SLOT_BYTES, "engine_num_blocks": BLOCKS,
                   "transfer": "Mooncake TE, tcp, 127.0.0.1", "max_tokens_handoff": 2, "set": EXTRA, **p},
        "units": {"*_ms": "milliseconds", "*_s": "seconds", "bytes": "bytes", "MB": "1e6 bytes",
                  "*GBps": "1e9 bytes/second", "ratio_a_vs_b": "a GBps / b GBps"},
        "notes": [
            "handoff numbers are medians over the R repeats (prefix-cached prefill); warm request's handoff in JSON",
            "ci95: 95% bootstrap intervals (4000 resamples of the repeats, seeded) of handoff/raw, floor/raw and "
            "handoff/floor, each the ratio of medians as in the table",
            "mode direct (the default): prefill's blocks are written straight into decode's pages, as spans of "
            "blocks consecutive on both sides cut every 4 MiB, in one Transfer Engine call (writes = "
            "ceil(spans / 512)); the CRC runs in a second thread during the write (crc_ms), reading only blocks "
            "without a kept CRC register (crc_reused in the spans: full blocks keep theirs until allocated again, "
            "and the repeats are prefix-cached, so they read only their partly filled last block); over tcp decode "
            "verifies every span in place after HandoffDone, in parallel threads, or inline up to 8 MiB (verify_ms), and acks "
            "before its engine adopts the request; no gather, "
            "no scatter; bytes are whole blocks (the last one's unused tail included). Decode's pages are "
            "asked for as the prompt's last step starts (early_grant): grant_ms is what is left of that round "
            "trip when the handoff begins",
            "mode direct-early (--set prefill.transfer.early_verify=on, the default over rdma): as direct, but decode "
            "verifies the spans prefill reports landed while the rest of the write runs (PagesLanded: verified_early "
            "in the spans) and awaits those checks after HandoffDone (verify_ms: its wait for them and the others)",
            "mode slots (--set prefill.transfer.direct=false): windows of exactly one slot (8 MiB) of the rank "
            "buffer, cut at byte offsets: writes = ceil(bytes / slot_bytes) (writes_expected); decode joins "
            "tokens cut by a window edge",
            "slots: gather, write and scatter are pipelined (gather of window i+1 and decode's scatter of window i-1 run "
            "while window i is written; HandoffDone goes out with the last SlotsFilled), so gather + write + "
            "scatter can exceed the handoff span: other ms = span - gather - write - scatter is then negative; "
            "gather_ms is time in the gathering thread (incl. CRC), scatter_ms decode's (incl. verify)",
            "raw TE: one write() of the handoff's pieces (same sizes) from one source to one destination buffer of "
            "the full size, two engines in the bench process; raw_per_repeat writes before each handoff repeat; "
            "write() is the handoff's own (shared/transfer.py: each piece submitted on its own, its status checked "
            "between short naps, not Mooncake's busy-polling sync call)",
            "floor (bench/handoff_floor.py): the same pieces written with the same write() into a child process's "
            "registered buffer, then a HandoffDone of the request's shape (its prompt ids, a page entry per piece with "
            "its CRC-32C) sent over the system's nats-server and the child's Ack awaited, which it sends once it has "
            "checked every piece's CRC (inline, timed: floor verify_ms); no engine, no tracing: what any checksummed "
            "push handoff between two processes pays here; interleaved with raw (one floor write after each raw "
            "write); floor_GBps = bytes / (write + round trip with the check); unchecked_GBps = bytes / (the same "
            "less the child's check)",
            "overhead: (a) and (b) interleaved, order alternating, after warm-up; distinct random 32-token prompts",
        ],
        "handoff": handoff, "overhead": overhead,
    }
    write_result(result, args.out, t_start, plot, report)


if __name__ == "__main__":
    main()
