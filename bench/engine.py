"""Engine + KV kernel benchmark: prefill and decode tokens/s, KV bytes per token, copy-kernel GB/s.

Run from the repository root (full run: several minutes on 2 CPU cores; --quick: < 60 s, for CI smoke):

    .venv/bin/python -m bench.engine --out bench/results/engine.json
    .venv/bin/python -m bench.engine --quick --out bench/results/engine-quick.json

On a machine shared with other jobs add `--threads 1`: a 2-thread torch run slows down many-fold
(17x measured for SmolLM2 prefill) whenever another process holds one of the cores.

Writes the JSON (machine info, parameters, every number with its unit in the key name and in
"units"), a PNG plot next to it (same stem) and prints markdown tables. Prompts are random token ids
from a seeded torch.Generator; the prefix cache is off so repeats recompute everything.
- prefill: time from add_request to the single output token (max_tokens=1, ignore_eos) = the prefill;
  one warm-up request per engine first. "one-shot" = whole prompt in one step (max_batched_tokens >=
  prompt), "chunked xN" = N steps of max_batched_tokens.
- decode: all prompts prefilled first (untimed), then only the decode steps are timed.
- kernels: kernels.get_kv_kernels("cpu") vs `dst.copy_(src)` of the same bytes (GB = 1e9 B; payload
  bytes / median time; each payload byte is read once and written once in both cases).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from bench._util import machine_info, plot, report, time_calls, write_result
from kernels import get_kv_kernels
from kernels.reference import rank_num_tokens
from shared.engine.engine import Engine, EngineConfig
from shared.engine.models import load_model
from shared.engine.sampling import SamplingParams
from shared.kv_layout import KVLayout, allocate_pages

SEED = 20240601
SMOL = "smollm2-135m"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# prefill cases: (model, prompt tokens, max_batched_tokens, repeats). SmolLM2's context is 8192, so
# its "8K" prompt is 8191 tokens (prompt + 1 output token must fit).
FULL = dict(prefill=[(SMOL, 2048, 2048, 3), (SMOL, 2048, 512, 3), (SMOL, 8191, 2048, 1),
                     ("tiny", 2048, 2048, 3), ("tiny", 2048, 512, 3), ("tiny", 16384, 2048, 1)],
            decode_batches=[1, 8, 32], decode_prompt_tokens=64, decode_max_tokens=32,
            kernel_tokens=[2048, 8192], kernel_cps=[1, 2, 4], kernel_pool_blocks=512,
            kernel_budget_s=0.5, kernel_min_iters=5, kernel_max_iters=50)
QUICK = dict(prefill=[(SMOL, 256, 256, 1), (SMOL, 256, 128, 1), ("tiny", 512, 512, 1), ("tiny", 512, 128, 1)],
             decode_batches=[1, 4], decode_prompt_tokens=32, decode_max_tokens=5,
             kernel_tokens=[512], kernel_cps=[1, 2], kernel_pool_blocks=64,
             kernel_budget_s=0.05, kernel_min_iters=2, kernel_max_iters=10)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tok(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def random_ids(g: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def make_engine(loaded, tokens: int, max_batched_tokens: int, max_num_seqs: int = 32) -> Engine:
    cfg = EngineConfig(num_blocks=-(-tokens // 16) + 64, max_batched_tokens=max_batched_tokens,
                       max_num_seqs=max_num_seqs, enable_prefix_cache=False)
    eng = Engine(loaded, cfg)
    g = torch.Generator().manual_seed(SEED - 1)
    warm = eng.add_request("warmup", random_ids(g, loaded.config.vocab_size, 32), SamplingParams(max_tokens=2, ignore_eos=True))
    while not warm.is_finished:
        eng.step()
    return eng


def bench_prefill(models: dict, model: str, n: int, mbt: int, repeats: int, g: torch.Generator) -> dict:
    loaded = models[model]
    eng = make_engine(loaded, n + 16, mbt)
    times, steps = [], 0
    for r in range(repeats):
        seq = eng.add_request(f"prefill-{r}", random_ids(g, loaded.config.vocab_size, n), SamplingParams(max_tokens=1, ignore_eos=True))
        steps = 0
        t0 = time.perf_counter()
        while not seq.is_finished:
            eng.step()
            steps += 1
        times.append(time.perf_counter() - t0)
        assert len(seq.output_ids) == 1 and seq.num_device_cached == 0
    med, best = statistics.median(times), min(times)
    return {"model": model, "prompt_tokens": n, "max_batched_tokens": mbt, "steps": steps,
            "mode": "one-shot" if steps == 1 else f"chunked x{steps}", "repeats": repeats, "times_s": times,
            "median_s": med, "best_s": best, "median_tok_per_s": n / med, "best_tok_per_s": n / best}


def bench_decode(models: dict, model: str, batch: int, p: dict, g: torch.Generator) -> dict:
    loaded, n, mt = models[model], p["decode_prompt_tokens"], p["decode_max_tokens"]
    eng = make_engine(loaded, batch * (n + mt), max(2048, batch * n), max_num_seqs=batch)
    params = SamplingParams(max_tokens=mt, ignore_eos=True)
    seqs = [eng.add_request(f"dec-{i}", random_ids(g, loaded.config.vocab_size, n), params) for i in range(batch)]
    prefill_steps = 0
    while any(not s.output_ids for s in seqs):  # untimed: every prompt computed, first token sampled
        eng.step()
        prefill_steps += 1
    steps = tokens = 0
    prefill_steps_before = eng.stats.prefill_steps
    t0 = time.perf_counter()
    while eng.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in eng.step())
        steps += 1
    dt = time.perf_counter() - t0
    assert tokens == batch * (mt - 1) and steps == mt - 1, (tokens, steps)
    assert eng.stats.prefill_steps == prefill_steps_before and eng.stats.preemptions == 0  # pure decode
    return {"model": model, "batch": batch, "prompt_tokens": n, "max_tokens": mt, "prefill_steps": prefill_steps,
            "decode_steps": steps, "generated_tokens": tokens, "time_s": dt, "tok_per_s": tokens / dt,
            "ms_per_step": 1e3 * dt / steps, "tok_per_s_per_seq": tokens / dt / batch}


def kv_bytes(models: dict) -> list[dict]:
    out = []
    for name, m in models.items():
        for dt in DTYPES:
            lay = KVLayout(m.config.num_layers, m.config.num_kv_heads, m.config.head_dim, dtype=DTYPES[dt])
            out.append({"model": name, "kv_dtype": dt, "layers": lay.num_layers, "kv_heads": lay.num_kv_heads,
                        "head_dim": lay.head_dim, "bytes_per_token": lay.bytes_per_token,
                        "KiB_per_token": lay.bytes_per_token / 1024,
                        "MiB_per_8K_tokens": lay.bytes_per_token * 8192 / 2**20})
    return out


def bench_kernels(smol_cfg, p: dict) -> tuple[str, list[dict]]:
    K, g, rows = get_kv_kernels("cpu"), torch.Generator().manual_seed(SEED + 1), []
    timing = (p["kernel_budget_s"], p["kernel_min_iters"], p["kernel_max_iters"])

    def record(kernel, label, dtype, nbytes, fn, **extra):
        src = torch.ones(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
        dst = torch.empty_like(src)  # plain contiguous copy of identical byte size, interleaved with the kernel
        k, c = time_calls([fn, lambda: dst.copy_(src)], *timing)
        gbps, cgbps = nbytes / k["median_s"] / 1e9, nbytes / c["median_s"] / 1e9
        rows.append({"kernel": kernel, "label": label, "kv_dtype": str(dtype).removeprefix("torch."), "bytes": nbytes,
                     "iters": k["iters"], "median_s": k["median_s"], "min_s": k["min_s"], "GBps": gbps,
                     "best_GBps": nbytes / k["min_s"] / 1e9, "copy_median_s": c["median_s"], "copy_GBps": cgbps,
                     "copy_best_GBps": nbytes / c["min_s"] / 1e9, "ratio_vs_copy": gbps / cgbps, **extra})
        log(f"  {label}: {gbps:.2f} GB/s (copy {cgbps:.2f})")

    L, H, D = smol_cfg.num_layers, smol_cfg.num_kv_heads, smol_cfg.head_dim
    for dtype in DTYPES.values():
        short = "f32" if dtype == torch.float32 else "bf16"
        for stages in (1, 2):  # one 256-token chunk (16 blocks) of stage 0, random block ids in a pool
            lay = KVLayout(L, H, D, dtype=dtype, stages=stages)
            pages = allocate_pages(lay, p["kernel_pool_blocks"])[0]
            ids = torch.randperm(p["kernel_pool_blocks"], generator=g)[:16]
            buf = torch.empty(lay.chunk_payload_bytes(0) // lay.elem_bytes, dtype=dtype)
            for name, fn in (("pack_chunk", lambda: K.pack_chunk(pages, ids, out=buf)),
                             ("unpack_chunk", lambda: K.unpack_chunk(buf, pages, ids))):
                record(name, f"{name.split('_')[0]} {short} st{stages}", dtype, lay.chunk_payload_bytes(0), fn,
                       stages=stages, layers_in_stage=len(lay.stage_layers(0)), tokens=256)
            del pages, buf
        lay = KVLayout(L, H, D, dtype=dtype)
        row = L * 2 * H * D
        for n in p["kernel_tokens"]:
            nb = -(-n // 16)
            pages = allocate_pages(lay, nb)
            table = torch.randperm(nb, generator=g)
            for cp in p["kernel_cps"]:
                outs = [torch.empty(rank_num_tokens(n, cp, r) * row, dtype=dtype) for r in range(cp)]
                record("gather_for_ranks", f"gather {short} {tok(n)} cp{cp}", dtype, n * lay.bytes_per_token,
                       lambda: K.gather_for_ranks(pages, table, n, cp, lay, outs=outs), tokens=n, cp=cp, stages=1)
                t_r = rank_num_tokens(n, cp, 0)  # rank 0 holds the most tokens
                rpages, rtable = allocate_pages(lay, -(-t_r // 16))[0], torch.randperm(-(-t_r // 16), generator=g)
                record("scatter_from_rank", f"scatter {short} {tok(n)} cp{cp}", dtype, t_r * lay.bytes_per_token,
                       lambda: K.scatter_from_rank(outs[0], rpages, rtable, t_r), tokens=n, cp=cp, rank_tokens=t_r)
                del outs, rpages
            del pages
            gc.collect()
    return K.name, rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for CI smoke (< 60 s)")
    ap.add_argument("--out", default="bench/results/engine.json")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    p, info = (QUICK if args.quick else FULL), machine_info()
    t_start = time.perf_counter()
    log("loading models")
    models = {SMOL: load_model(SMOL), "tiny": load_model("tiny")}
    g = torch.Generator().manual_seed(SEED)
    prefill = []
    for case in p["prefill"]:
        prefill.append(bench_prefill(models, *case, g))
        log(f"prefill {case}: {prefill[-1]['median_tok_per_s']:.0f} tok/s ({prefill[-1]['mode']})")
        gc.collect()
    decode = []
    for model in (SMOL, "tiny"):
        for b in p["decode_batches"]:
            decode.append(bench_decode(models, model, b, p, g))
            log(f"decode {model} batch {b}: {decode[-1]['tok_per_s']:.1f} tok/s")
    log("kernels")
    backend, kernels = bench_kernels(models[SMOL].config, p)
    result = {
        "command": " ".join(["python -m bench.engine", *(argv if argv is not None else sys.argv[1:])]),
        "machine": info, "kernel_backend": backend,
        "params": {"quick": args.quick, "seed": SEED, "compute_dtype": "float32", "engine_kv_dtype": "float32",
                   "enable_prefix_cache": False, "block_size": 16, **p},
        "units": {"*_s": "seconds (time.perf_counter)", "*tok_per_s": "tokens/second", "bytes*": "bytes",
                  "GBps": "1e9 bytes/second of payload", "ratio_vs_copy": "kernel GBps / copy GBps",
                  "ms_per_step": "milliseconds per engine step"},
        "notes": [
            "prefill time = add_request until the single output token (max_tokens=1, ignore_eos), after one warm-up request",
            "repeats: 3 for 2K prompts (median and best reported), 1 for 8K/16K; quick: 1",
            "with max_batched_tokens=2048 a 2048-token prompt runs in one step (= one-shot); the 512-token "
            "chunk rows show the chunked-prefill cost at 2K",
            "decode tok/s counts tokens of decode steps only (max_tokens-1 per sequence); prompts prefilled untimed",
            "the machine may be shared: compare the matmul calibration at start/end (and load averages); "
            "a 2-thread torch run slows down many-fold when another process holds a core",
            "kernels: SmolLM2 layout; pack/unpack = 16 random blocks of stage 0 in a pool; gather = all "
            "ranks of a stages=1 prefill; scatter = rank 0 buffer into its own pages; out buffers preallocated",
        ],
        "prefill": prefill, "decode": decode, "kv_bytes_per_token": kv_bytes(models), "kernels": kernels,
    }
    write_result(result, args.out, t_start, plot, report)


if __name__ == "__main__":
    main()
