"""Shared-pool benchmark on the real system (infra.up.Launcher: nats, master, 2 stores, gate, decode,
prefill, router as processes): TTFT by where a session's history is, restore GB/s vs raw Mooncake reads,
and what saving costs when sessions never return.

Run from the repository root (full: ~20 minutes on 2 CPU cores, mostly computing the 8K SmolLM2 and 32K
tiny histories; --quick: tiny 2K only, fewer repeats, < 2 minutes):

    .venv/bin/python -m bench.restore --out bench/results/restore.json
    .venv/bin/python -m bench.restore --quick --out bench/results/restore-quick.json

1. TTFT (streamed, greedy, max_tokens 2, ignore_eos: time to the response headers, which the router sends
   once the first token reached it) of a prompt = history H (N tokens) + 32 new tokens, H being (a) device:
   in the prefill's device prefix cache, (b) pool: only in the pool, (c) recompute: nowhere (a fresh random
   N+32-token prompt, pool on). One system per (model, N); the prefill gets just enough KV blocks for one
   such prompt, so each long prompt evicts the previous one from device memory. Per size: k fresh prompts
   C_1..C_k (case c; each saves its full chunks); E = C_1[:N], H = C_k[:N]; then per turn t: H + y_t (a),
   E + z_t (restores E from the pool, evicting H), H + y_t again (b). usage.moorage is checked per request.
2. Restore GB/s: the (b) requests' `store.restore` spans (bytes / ms; read ms = ms - the verify+unpack stage
   ms) vs a PoolClient in this process reading H's objects (same keys and bytes) into a registered buffer, in
   batches of restore_batch_chunks chunks like the restore, and in one call; interleaved with the turns.
3. Cost of saving: two tiny systems up at once, pool on and pool off; rounds of distinct random 2K prompts
   from 4 client threads, alternating which system goes first; round throughput until the last response.
Writes the JSON (ms = milliseconds, GB = 1e9 B), a PNG with the same stem, and prints markdown tables.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from bench._util import LoadWatcher, machine_info, md_table, stream_completion, write_result
from bench.handoff import wait_spans
from shared.config import load_config
from shared.engine.models import load_tokenizer, smollm2_gguf_path
from shared.hashing import BLOCK_TOKENS, CHUNK_TOKENS, chunk_hashes, namespace_seed
from shared.kv_layout import KVLayout
from shared.kv_object import HEADER_BYTES, object_key
from shared.pool import PoolClient, PoolConfig
from shared.tracing import read_spans
from infra.up import Launcher, UpConfig

SEED, SMOL, NEW, MAX_TOKENS = 20240607, "smollm2-135m", 32, 2
CASES = ("device", "pool", "recompute")
FULL = dict(sizes=[[SMOL, 2048, 3], [SMOL, 7936, 2], ["tiny", 16384, 3], ["tiny", 32768, 2]], turns=3,
            raw_per_turn=3, tput_rounds=6, tput_requests=16, tput_threads=4, tput_prompt=2048)
QUICK = dict(sizes=[["tiny", 2048, 2]], turns=2, raw_per_turn=3, tput_rounds=2, tput_requests=6, tput_threads=4,
             tput_prompt=2048)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def chunk_bytes(model: str) -> int:
    """Bytes of one pool object: one 256-token chunk of fp32 KV (1 stage) plus its header."""
    if model == "tiny":
        from shared.engine.tiny import tiny_config
        mc = tiny_config()
    else:
        from gguf import GGUFReader

        from shared.engine.gguf_loader import read_config
        mc = read_config(GGUFReader(str(smollm2_gguf_path())), model)
    return HEADER_BYTES + KVLayout(mc.num_layers, mc.num_kv_heads, mc.head_dim).chunk_payload_bytes(0)


class System:
    """A launched system (with block): its router client, load watcher and run dir; always stopped."""
    extra: list[str] = []  # --set overrides, applied to every system after the bench's own

    def __init__(self, tag: str, model: str, overrides: list[str]):
        self.tag, self.model, self.http, self.watch = tag, model, None, None
        self.tmp = tempfile.TemporaryDirectory(prefix=f"bench-restore-{tag}-")
        self.launcher = Launcher(load_config(UpConfig, overrides=[
            f"up.model={model}", "up.port=0", f"up.run_dir={self.tmp.name}", "up.ready_timeout_s=600",
            "router.router.request_timeout_s=3600", *overrides, *System.extra]))
        self.traces = Path(self.tmp.name) / "traces.jsonl"

    def __enter__(self) -> "System":
        try:
            base = self.launcher.start()
            self.launcher.wait_ready(base)
            self.watch = LoadWatcher(self.launcher.nats.url, f"bench-restore-{self.tag}")
            self.http = httpx.Client(base_url=base, timeout=1800)
            self.report = self.watch.wait_idle("prefill-0", 0.0)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        log(f"{self.tag}: system ready at {base}")
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:  # the run dir goes away with the temp dir: keep what says why
            keep = Path("runs") / f"failed-{self.tag}-{time.strftime('%Y%m%d-%H%M%S')}"
            shutil.copytree(self.tmp.name, keep, ignore=shutil.ignore_patterns("*.sock"), dirs_exist_ok=True)
            log(f"{self.tag}: failed ({exc[0].__name__}); its run dir is kept in {keep}")
            for name in self.launcher.dead():
                log(f"{name} log tail:\n" + (Path(self.tmp.name) / f"{name}.log").read_text()[-3000:])
        for x in (self.http, self.watch):
            if x is not None:
                x.close()
        self.launcher.stop()
        self.tmp.cleanup()

    def request(self, prompt: list[int], session: str) -> dict:
        """A streamed request, then wait until the prefill is idle again (its pool save done, blocks free)."""
        r = stream_completion(self.http, self.model, prompt, MAX_TOKENS, session)
        self.report = self.watch.wait_idle("prefill-0", time.monotonic())
        return r


class RawReads:
    """PoolClient reads of the same objects a restore reads, into registered buffers."""

    def __init__(self, pc: PoolClient, keys: list[str], obj: int, batch: int):
        self.pc, self.keys, self.obj, self.batch = pc, keys, obj, batch
        self.full = torch.zeros(len(keys) * obj, dtype=torch.uint8)
        self.small = torch.zeros(batch * obj, dtype=torch.uint8)
        pc.register(self.full), pc.register(self.small)
        self.times = {"batched": [], "one_call": []}

    def _get(self, keys: list[str], base: int) -> None:
        got = self.pc.get_into(keys, [base + i * self.obj for i in range(len(keys))], [self.obj] * len(keys))
        assert got == [self.obj] * len(keys), got

    def run(self) -> None:
        t0 = time.perf_counter()
        for b0 in range(0, len(self.keys), self.batch):  # like the restore: one batch after the other
            self._get(self.keys[b0:b0 + self.batch], self.small.data_ptr())
        t1 = time.perf_counter()
        self._get(self.keys, self.full.data_ptr())
        self.times["batched"].append((t1 - t0) * 1e3)
        self.times["one_call"].append((time.perf_counter() - t1) * 1e3)


def rand(g: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def bench_size(model: str, n: int, k: int, p: dict, g: torch.Generator) -> dict:
    vocab, obj, nch = load_tokenizer(model)[0].vocab_size, chunk_bytes(model), n // CHUNK_TOKENS
    blocks = -(-(n + NEW + MAX_TOKENS) // BLOCK_TOKENS)  # one prompt's worth: the next one evicts it
    store = int((k * nch + 2) * obj / 0.85) + (64 << 20)  # each store could hold every history alone
    overrides = [f"prefill.engine.num_blocks={blocks}", f"up.store_bytes={store}",
                 f"decode.engine.num_blocks={-(-(n + NEW + MAX_TOKENS) * 10 // 9 // BLOCK_TOKENS) + 16}"]
    samples: dict[str, list[dict]] = {c: [] for c in (*CASES, "pool_other_history")}
    with System(f"{model}-{n}", model, overrides) as s:
        pc = PoolClient(PoolConfig(master_addr=s.launcher.configs["prefill-0"].pool.master_addr))
        try:
            s.request(rand(g, vocab, 300), "warm-up")
            cs = [rand(g, vocab, n + NEW) for _ in range(k)]
            for j, c in enumerate(cs):
                samples["recompute"].append(s.request(c, f"fresh-{j}"))
                log(f"{model} {n}: recompute {samples['recompute'][-1]['ttft_ms']:.0f} ms")
            E, H = cs[0][:n], cs[-1][:n]
            ns = s.report.detail["kv_namespace"]
            keys = [object_key(ns, 0, 1, d) for d in chunk_hashes(H, namespace_seed(ns))[:nch]]
            assert all(pc.exists(keys)), "H was not saved to the pool"
            raw = RawReads(pc, keys, obj, s.launcher.configs["prefill-0"].pool.restore_batch_chunks)
            for t in range(p["turns"]):
                y, z = rand(g, vocab, NEW), rand(g, vocab, NEW)
                samples["device"].append(s.request(H + y, "H"))
                samples["pool_other_history"].append(s.request(E + z, "E"))
                samples["pool"].append(s.request(H + y, "H"))
                for _ in range(p["raw_per_turn"]):
                    raw.run()
                log(f"{model} {n} turn {t}: device {samples['device'][-1]['ttft_ms']:.0f} ms, pool "
                    f"{samples['pool'][-1]['ttft_ms']:.0f} ms, raw read {raw.times['batched'][-1]:.0f} ms")
        finally:
            pc.close()
        rids = {x["request_id"] for xs in samples.values() for x in xs}
        spans = wait_spans(s.traces, ("store.lookup", "router.request"), rids)
        restores = {x["trace_id"]: x for x in read_spans(s.traces) if x["name"] == "store.restore"}
    expect = {"device": (n, 0, NEW), "pool": (0, n, NEW), "pool_other_history": (0, n, NEW),
              "recompute": (0, 0, n + NEW)}
    out = {"model": model, "prefix_tokens": n, "prompt_tokens": n + NEW, "prefill_num_blocks": blocks,
           "store_bytes_each": store, "object_bytes": obj, "chunks": nch, "cases": {}}
    for case, xs in samples.items():
        for x in xs:
            m = x["usage"]["moorage"]
            x["usage_ok"] = (m["device"], m["store"], m["computed"]) == expect[case]
            x["server_ttft_ms"] = spans["router.request"][x["request_id"]]["attributes"].get("ttft_ms")
            tid = spans["store.lookup"][x["request_id"]]["trace_id"]
            x["restore"] = restores[tid]["attributes"] if tid in restores else None
        out["cases"][case] = {"ttft_ms": summary([x["ttft_ms"] for x in xs]), "usage_expected": dict(zip(
            ("device", "store", "computed"), expect[case])), "usage_ok": all(x["usage_ok"] for x in xs), "samples": xs}
    rs = [x["restore"] for c in ("pool", "pool_other_history") for x in samples[c] if x["restore"]]
    nbytes = nch * obj
    ms = statistics.median(r["ms"] for r in rs)
    # pipelined restores report the time they waited for reads; before, reads and stages were serial
    read_ms = statistics.median(r["read_wait_ms"] if "read_wait_ms" in r else
                                r["ms"] - sum(v for k_, v in r.items() if k_.startswith("stage")) for r in rs)
    rb, r1 = statistics.median(raw.times["batched"]), statistics.median(raw.times["one_call"])
    out["restore"] = {"bytes": nbytes, "MB": nbytes / 1e6, "n_spans": len(rs), "all_bytes_match": all(
        r["bytes"] == nbytes for r in rs), "median_ms": ms, "median_read_ms": read_ms, "GBps": nbytes / ms / 1e6,
        "read_GBps": nbytes / read_ms / 1e6, "raw_batched_ms": raw.times["batched"],
        "raw_one_call_ms": raw.times["one_call"],
        "raw_batch_chunks": raw.batch, "raw_batched_GBps": nbytes / rb / 1e6, "raw_one_call_GBps": nbytes / r1 / 1e6,
        "ratio_restore_vs_raw_batched": rb / ms, "ratio_read_vs_raw_batched": rb / read_ms,
        "ratio_restore_vs_raw_one_call": r1 / ms, "spans": rs}
    return out


def bench_throughput(p: dict, g: torch.Generator) -> dict:
    m, n, vocab = p["tput_requests"], p["tput_prompt"], load_tokenizer("tiny")[0].vocab_size
    total = (p["tput_rounds"] * m + 4) * (n // CHUNK_TOKENS) * chunk_bytes("tiny")
    rounds: dict[str, list[dict]] = {"on": [], "off": []}
    with System("pool-on", "tiny", [f"up.store_bytes={int(total * 0.75 / 0.85) + (64 << 20)}"]) as on, \
            System("pool-off", "tiny", ["up.pool=false"]) as off:
        systems = {"on": on, "off": off}

        def one_round(s: System, count: int) -> dict:
            prompts = [rand(g, vocab, n) for _ in range(count)]
            lat = []

            def one(prompt):
                t = time.perf_counter()
                r = s.http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                         "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                lat.append((time.perf_counter() - t) * 1e3)

            t0 = time.perf_counter()
            with ThreadPoolExecutor(p["tput_threads"]) as ex:
                list(ex.map(one, prompts))
            wall, t_end = time.perf_counter() - t0, time.monotonic()
            s.report = s.watch.wait_idle("prefill-0", t_end)
            return {"requests": count, "wall_s": wall, "req_per_s": count / wall, "prompt_tok_per_s": count * n / wall,
                    "p50_latency_ms": statistics.median(lat), "idle_seen_after_s": time.monotonic() - t_end}

        for s in systems.values():
            one_round(s, p["tput_threads"])  # warm-up
        for r in range(p["tput_rounds"]):
            for key in (("on", "off") if r % 2 == 0 else ("off", "on")):
                rounds[key].append(one_round(systems[key], m))
                log(f"throughput round {r} pool {key}: {rounds[key][-1]['req_per_s']:.2f} req/s")
        pool_counters = on.report.detail["pool"]
    med = {k: {x: statistics.median(rr[x] for rr in v) for x in ("req_per_s", "prompt_tok_per_s", "p50_latency_ms")}
           for k, v in rounds.items()}
    return {"model": "tiny", "prompt_tokens": n, "requests_per_round": m, "threads": p["tput_threads"],
            "rounds": rounds, "median": med,
            "ratio_on_vs_off_req_per_s": med["on"]["req_per_s"] / med["off"]["req_per_s"],
            "pool_on_counters": pool_counters, "pool_on_store_bytes_each": int(total * 0.75 / 0.85) + (64 << 20)}


def report(r: dict) -> str:
    m, t, sz = r["machine"], r["throughput"], r["ttft"]
    med = lambda s, c: s["cases"][c]["ttft_ms"]["median"]  # noqa: E731
    use = lambda s, c: "/".join(str(s["cases"][c]["usage_expected"][k]) for k in ("device", "store", "computed")) + (
        "" if s["cases"][c]["usage_ok"] else " NOT OK")  # noqa: E731
    return "\n".join([
        f"## moorage pool restore benchmark ({'quick' if r['params']['quick'] else 'full'})\n\ntorch {m['torch']}, "
        f"{m['cpu_count']} CPUs, {m['date']}; load avg start {m['loadavg_1m_5m_15m'][0]:.2f} / end "
        f"{m['loadavg_at_end'][0]:.2f}; matmul calibration start {m['calibration_matmul_GFLOPs_at_start']:.1f} / end "
        f"{m['calibration_matmul_GFLOPs_at_end']:.1f} GFLOP/s; Mooncake Store over tcp loopback, 2 stores\n",
        md_table(["model", "prefix + new tok", "n (a/b/c)", "TTFT device ms", "TTFT pool ms", "TTFT recompute ms",
                  "pool / device", "recompute / pool", "usage d/s/c: device; pool; recompute"],
                 [[s["model"], f"{s['prefix_tokens']} + {NEW}",
                   "/".join(str(s["cases"][c]["ttft_ms"]["n"]) for c in CASES),
                   *(med(s, c) for c in CASES), med(s, "pool") / med(s, "device"), med(s, "recompute") / med(s, "pool"),
                   "; ".join(use(s, c) for c in CASES)] for s in sz]), "",
        md_table(["model", "prefix tok", "MB", "spans", "restore ms", "read ms", "restore GB/s", "read GB/s",
                  "raw batched GB/s", "raw one-call GB/s", "restore / raw batched", "read / raw batched"],
                 [[s["model"], s["prefix_tokens"], x["MB"], x["n_spans"], x["median_ms"], x["median_read_ms"],
                   x["GBps"], x["read_GBps"], x["raw_batched_GBps"], x["raw_one_call_GBps"],
                   x["ratio_restore_vs_raw_batched"], x["ratio_read_vs_raw_batched"]]
                  for s in sz for x in [s["restore"]]]), "",
        *([] if t is None else [md_table(
            ["pool (tiny, 2K prompts)", "rounds x requests", "median req/s", "median prompt tok/s",
             "median p50 latency ms", "req/s per round"],
            [[k, f"{len(t['rounds'][k])} x {t['requests_per_round']}",
              *(t["median"][k][x] for x in ("req_per_s", "prompt_tok_per_s", "p50_latency_ms")),
              ", ".join(f"{x['req_per_s']:.2f}" for x in t["rounds"][k])] for k in ("on", "off")]),
            f"\npool on / off (median req/s): {t['ratio_on_vs_off_req_per_s']:.3f}; pool-on prefill counters "
            f"{t['pool_on_counters']}\n"]), "Notes: " + "; ".join(r["notes"])])


def plot(r: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(19, 6.5), gridspec_kw={"width_ratios": [2.2, 1.4, 1]})
    fig.suptitle(f"moorage shared-pool restore ({'quick' if r['params']['quick'] else 'full'}) - "
                 f"{r['machine']['date']}, {r['machine']['cpu_count']} CPUs, Mooncake Store over tcp loopback",
                 fontsize=11)
    sz, t = r["ttft"], r["throughput"]
    ticks = [f"{s['model']}\n{s['prefix_tokens']} + {NEW} tok" for s in sz]
    for j, (c, label) in enumerate(zip(CASES, ("history in device memory", "history only in the pool",
                                              "history nowhere (recompute)"))):
        st = [s["cases"][c]["ttft_ms"] for s in sz]
        bars = ax.bar([i + (j - 1) * 0.27 for i in range(len(sz))], [x["median"] for x in st], 0.27, label=label,
                      yerr=[[x["median"] - x["min"] for x in st], [x["max"] - x["median"] for x in st]], capsize=3)
        ax.bar_label(bars, labels=[f"{x['median'] / 1e3:.2f} s" if x["median"] >= 1e3 else f"{x['median']:.0f} ms"
                                   for x in st], fontsize=7)
    ax.set(yscale="log", ylabel="TTFT, ms (median, min-max bars; log)", title="TTFT by where the history is")
    ax.set_xticks(range(len(sz)), ticks, fontsize=8)
    ax.legend(fontsize=8)
    for j, (key, label) in enumerate((("GBps", "restore (whole span)"), ("read_GBps", "restore, read part"),
                                      ("raw_batched_GBps", "raw get_into, same batches"),
                                      ("raw_one_call_GBps", "raw get_into, one call"))):
        bars = bx.bar([i + (j - 1.5) * 0.2 for i in range(len(sz))], [s["restore"][key] for s in sz], 0.2, label=label)
        bx.bar_label(bars, fmt="%.2f", fontsize=7)
    bx.set(ylabel="GB/s (1e9 B / median time)", title="Restore vs raw Mooncake reads of the same objects")
    bx.set_xticks(range(len(sz)), [f"{x}\n{s['restore']['MB']:.0f} MB" for x, s in zip(ticks, sz)], fontsize=8)
    bx.legend(fontsize=7)
    if t is None:
        cx.axis("off")
        cx.text(0.05, 0.5, "pool on/off throughput:\nbench/results/zero_hit.json", fontsize=9)
    else:
        for i, k in enumerate(("on", "off")):
            x = t["median"][k]
            cx.bar_label(cx.bar(i, x["req_per_s"], 0.6, color=f"C{i + 4}"), fontsize=8,
                         labels=[f"{x['req_per_s']:.2f} req/s\n{x['prompt_tok_per_s']:.0f} tok/s"])
            cx.plot([i] * len(t["rounds"][k]), [x["req_per_s"] for x in t["rounds"][k]], "k.",
                    label="rounds" if i else None)
        cx.set_xticks([0, 1], ["pool on (saves)", "pool off"])
        cx.set(ylabel="requests/s (median of rounds)", ylim=(0, 1.3 * max(x["req_per_s"] for v in t["rounds"].values()
                                                                              for x in v)))
        cx.set_title(f"No-reuse {t['prompt_tokens']}-tok prompts, tiny, {t['threads']} threads: on/off "
                     f"{t['ratio_on_vs_off_req_per_s']:.3f}", fontsize=9)
        cx.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny 2K only, fewer repeats (< 2 minutes)")
    ap.add_argument("--sizes", default=None, help="only these of the full sizes, e.g. smollm2-135m:2048,smollm2-135m:7936")
    ap.add_argument("--turns", type=int, default=None, help="turns per size (default: full 3, quick 2)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="config override for every system (repeatable), e.g. prefill.pool.restore_batch_chunks=2")
    ap.add_argument("--no-throughput", action="store_true", help="skip part 3 (bench/zero_hit.py measures it properly)")
    ap.add_argument("--out", default=None, help="JSON result, PNG beside it (default runs/restore-<time>/restore.json, "
                                                "gitignored; pass bench/results/restore.json to update the committed one)")
    args = ap.parse_args(argv)
    args.out = args.out or f"runs/restore-{time.strftime('%Y%m%d-%H%M%S')}/restore.json"
    p, info, t_start = dict(QUICK if args.quick else FULL), machine_info(), time.perf_counter()
    if args.sizes:
        want = [tuple(x.rsplit(":", 1)) for x in args.sizes.split(",")]
        p["sizes"] = [sz for sz in p["sizes"] if (sz[0], str(sz[1])) in want]
        if len(p["sizes"]) != len(want):
            raise SystemExit(f"--sizes {args.sizes}: not all of them are in {p['sizes']}")
    if args.turns:
        p["turns"] = args.turns
    p["set"] = System.extra = list(args.set)
    g = torch.Generator().manual_seed(SEED)
    ttft = [bench_size(model, n, k, p, g) for model, n, k in p["sizes"]]
    bad = [f"{s['model']} {s['prefix_tokens']} {c}" for s in ttft for c, v in s["cases"].items() if not v["usage_ok"]]
    r = {"command": " ".join(["python -m bench.restore", *(argv if argv is not None else sys.argv[1:])]),
         "machine": info,
         "params": {"quick": args.quick, "seed": SEED, "new_tokens": NEW, "max_tokens": MAX_TOKENS, **p,
                    "sizes_fields": "[model, prefix tokens N, fresh prompts k = recompute samples]"},
         "units": {"*_ms": "milliseconds", "*_s": "seconds", "bytes": "bytes", "MB": "1e6 bytes",
                   "*GBps": "1e9 bytes/second", "*req_per_s": "requests/second", "*tok_per_s": "prompt tokens/second"},
         "notes": ["TTFT = client time to the streamed response's headers (the router sends them with the first token "
                   "in hand); server_ttft_ms (router span) and first_event_ms per sample in the JSON",
                   "pool = H + y_t after E + z_t evicted H from device (the prefill has blocks for one prompt); "
                   "pool_other_history = those E + z_t requests, in the JSON, their spans in the restore GB/s",
                   "read ms = the restore span's read_wait_ms (time waiting for batched reads; reads are pipelined "
                   "with verify + unpack) where the span has it, else store.restore ms - stage ms (verify + unpack)",
                   "restore in place (pool.restore_in_place, the default): each object's payload is read straight "
                   "into its blocks and its CRC computed there (stage ms = verify only); false: read whole into a "
                   "registered buffer, then unpacked (stage ms = unpack + CRC in one pass)",
                   "throughput: both systems up at once, rounds alternate which goes first; a round ends at its last "
                   "response (then waits for an idle prefill, so saves never overlap the other system's round)",
                   f"usage NOT as expected for: {', '.join(bad)}" if bad else "usage.moorage as expected everywhere"],
         "ttft": ttft, "throughput": None if args.no_throughput else bench_throughput(p, g)}
    if args.no_throughput:
        r["notes"].append("throughput (part 3) not run here: bench/results/zero_hit.json measures it with a CI")
    write_result(r, args.out, t_start, plot, report)


if __name__ == "__main__":
    main()
