"""Engine + KV kernel benchmark: prefill and decode tokens/s, KV bytes per token, copy-kernel GB/s, and
a peer baseline (Hugging Face transformers on the same GGUF, same prompts, same threads, same process).

Run from the repository root (full run: ~14 minutes on 2 CPU cores, longer with --threads 1, most of it
prefilling the 8 x 4.5K-token decode contexts for both engines; --quick: ~70 s, for CI smoke):

    .venv/bin/python -m bench.engine --out bench/results/engine.json
    .venv/bin/python -m bench.engine --quick --out bench/results/engine-quick.json
    .venv/bin/python -m bench.engine --sections peer --out /tmp/peer.json   # only the peer comparison
    .venv/bin/python -m bench.engine --sections kernels --update bench/results/engine.json  # kernels only,
        # into the committed result (its other sections and their machine info kept, a note says when)

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
- peer (SmolLM2 only): transformers `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` in float32
  with SDPA, use_cache=True, logits_to_keep=1.
  prefill: tok/s of one forward over the prompt vs moorage one-shot (max_batched_tokens = prompt) and
  moorage as the engine runs by default (chunked: long_prefill_tokens 256 per step); repeats interleaved.
  decode: B prompts of C random tokens prefilled (untimed; transformers row by row, caches concatenated
  into one DynamicCache), then one token per sequence per step, timed per step and interleaved:
  moorage (attention backend picked by kernels.get_attention_kernels), moorage with the torch
  reference attention (the same engine, backend switched per step), transformers. Ratios are
  moorage/transformers of ms per step (< 1: moorage faster) and of prefill tok/s (> 1: moorage faster).
  greedy: chat prompts through both engines (ignore EOS); tokens matched position by position.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import statistics
import sys
import time

import torch

from bench._util import machine_info, md_table, plot, report, time_calls, write_result
from kernels import get_attention_kernels, get_kv_kernels
from kernels.reference import rank_num_tokens
from shared.engine.engine import Engine, EngineConfig
from shared.engine.models import load_model, smollm2_gguf_path
from shared.engine.sampling import SamplingParams
from shared.kv_layout import KVLayout, allocate_pages
from shared.kv_object import checksum

SEED = 20240601
SMOL = "smollm2-135m"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# prefill cases: (model, prompt tokens, max_batched_tokens, repeats). SmolLM2's context is 8192, so
# its "8K" prompt is 8191 tokens (prompt + 1 output token must fit).
FULL = dict(prefill=[(SMOL, 2048, 2048, 3), (SMOL, 2048, 512, 3), (SMOL, 8191, 2048, 1),
                     ("tiny", 2048, 2048, 3), ("tiny", 2048, 512, 3), ("tiny", 16384, 2048, 1)],
            decode_batches=[1, 8, 32], decode_prompt_tokens=64, decode_max_tokens=32,
            kernel_tokens=[2048, 8192], kernel_cps=[1, 2, 4], kernel_pool_blocks=512,
            kernel_budget_s=1.0, kernel_min_iters=9, kernel_max_iters=60)
QUICK = dict(prefill=[(SMOL, 256, 256, 1), (SMOL, 256, 128, 1), ("tiny", 512, 512, 1), ("tiny", 512, 128, 1)],
             decode_batches=[1, 4], decode_prompt_tokens=32, decode_max_tokens=5,
             kernel_tokens=[512], kernel_cps=[1, 2], kernel_pool_blocks=64,
             kernel_budget_s=0.05, kernel_min_iters=2, kernel_max_iters=10)
# peer comparison (SmolLM2 vs transformers): prefill (prompt tokens, repeats); decode contexts x batches
FULL["peer"] = dict(prefill=[(2048, 3), (8191, 1)], decode_ctx=[512, 1024, 4608], decode_batches=[1, 8],
                    decode_steps=16, greedy_tokens=48)
QUICK["peer"] = dict(prefill=[(256, 3)], decode_ctx=[128, 512], decode_batches=[1, 2], decode_steps=4,
                     greedy_tokens=12)
GREEDY_CHATS = ["What is the capital of France?",
                "Explain the difference between a process and a thread in two sentences.",
                "Write a Python function that merges two sorted lists.",
                "List three uses of a hash map."]
SECTIONS = ("prefill", "decode", "kernels", "peer")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tok(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def random_ids(g: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def make_engine(loaded, tokens: int, max_batched_tokens: int, max_num_seqs: int = 32, **cfg) -> Engine:
    """long_prefill_tokens=0 unless given: max_batched_tokens alone decides the chunking."""
    cfg = EngineConfig(**{"num_blocks": -(-tokens // 16) + 64, "max_batched_tokens": max_batched_tokens,
                          "max_num_seqs": max_num_seqs, "enable_prefix_cache": False, "long_prefill_tokens": 0,
                          **cfg})
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

    def record(kernel, label, dtype, nbytes, fn, unfused=None, **extra):
        """unfused: the same work as two passes (a copy kernel, then crc32c of the packed bytes), timed too."""
        src = torch.ones(nbytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
        dst = torch.empty_like(src)  # plain contiguous copy of identical byte size, interleaved with the kernel
        k, c, *u = time_calls([fn, lambda: dst.copy_(src)] + ([unfused] if unfused else []), *timing)
        gbps, cgbps = nbytes / k["median_s"] / 1e9, nbytes / c["median_s"] / 1e9
        if u:
            extra.update(unfused_GBps=nbytes / u[0]["median_s"] / 1e9, ratio_vs_unfused=u[0]["median_s"] / k["median_s"])
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
            pages = allocate_pages(lay, p["kernel_pool_blocks"])[0].fill_(1)  # written: real memory, not the zero page
            ids = torch.randperm(p["kernel_pool_blocks"], generator=g)[:16]
            buf = torch.empty(lay.chunk_payload_bytes(0) // lay.elem_bytes, dtype=dtype)
            for name, fn in (("pack_chunk", lambda: K.pack_chunk(pages, ids, out=buf)),
                             ("unpack_chunk", lambda: K.unpack_chunk(buf, pages, ids))):
                record(name, f"{name.split('_')[0]} {short} st{stages}", dtype, lay.chunk_payload_bytes(0), fn,
                       stages=stages, layers_in_stage=len(lay.stage_layers(0)), tokens=256)
            if stages == 1:  # a pool object's payload: copied and checksummed in one pass, vs the two passes
                for name, fn, unfused in (
                        ("pack_chunk_crc", lambda: K.pack_chunk_crc(pages, ids, buf),
                         lambda: checksum(K.pack_chunk(pages, ids, out=buf).view(torch.uint8))),
                        ("unpack_chunk_crc", lambda: K.unpack_chunk_crc(buf, pages, ids),
                         lambda: (K.unpack_chunk(buf, pages, ids), checksum(buf.view(torch.uint8))))):
                    record(name, f"{name.split('_')[0]}+crc {short} st1", dtype, lay.chunk_payload_bytes(0), fn,
                           unfused=unfused, stages=1, layers_in_stage=len(lay.stage_layers(0)), tokens=256)
            del pages, buf
        lay = KVLayout(L, H, D, dtype=dtype)
        row = L * 2 * H * D
        for n in p["kernel_tokens"]:
            nb = -(-n // 16)
            pages = [x.fill_(1) for x in allocate_pages(lay, nb)]  # written, as the copy's source is
            table = torch.randperm(nb, generator=g)
            for cp in p["kernel_cps"]:
                outs = [torch.empty(rank_num_tokens(n, cp, r) * row, dtype=dtype) for r in range(cp)]
                record("gather_for_ranks", f"gather {short} {tok(n)} cp{cp}", dtype, n * lay.bytes_per_token,
                       lambda: K.gather_for_ranks(pages, table, n, cp, lay, outs=outs), tokens=n, cp=cp, stages=1)
                t_r = rank_num_tokens(n, cp, 0)  # rank 0 holds the most tokens
                rpages, rtable = allocate_pages(lay, -(-t_r // 16))[0].fill_(0), torch.randperm(-(-t_r // 16), generator=g)
                record("scatter_from_rank", f"scatter {short} {tok(n)} cp{cp}", dtype, t_r * lay.bytes_per_token,
                       lambda: K.scatter_from_rank(outs[0], rpages, rtable, t_r), tokens=n, cp=cp, rank_tokens=t_r)
                del outs, rpages
            del pages
            gc.collect()
    return K.name, rows


# --- peer baseline: Hugging Face transformers on the same GGUF ---------------------------------

class HFModel:
    """transformers on the GGUF moorage loads (SmolLM2 unless `path`), in `dtype`, SDPA; greedy one step
    at a time."""

    def __init__(self, path=None, dtype: torch.dtype = torch.float32):
        import transformers
        from transformers import AutoModelForCausalLM

        path = path or smollm2_gguf_path()
        dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          **{dtype_kw: dtype}).eval()
        self.version = transformers.__version__
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5
        self.keep_kw = "logits_to_keep" if "logits_to_keep" in params else "num_logits_to_keep"
        self.attn_impl = getattr(self.model.config, "_attn_implementation", None)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache=None):
        """ids [B, T] -> (greedy next ids [B], cache). A new DynamicCache when cache is None."""
        from transformers import DynamicCache

        out = self.model(input_ids=ids, use_cache=True, **{self.cache_kw: cache if cache is not None else DynamicCache(),
                                                          self.keep_kw: 1})
        cache = getattr(out, "cache", None) or out.past_key_values
        return out.logits[:, -1].argmax(-1), cache

    @staticmethod
    def concat(caches: list):
        """Row caches of equal length -> one batched DynamicCache (what a batched prefill would hold)."""
        from transformers import DynamicCache

        def kv(c, i):
            if hasattr(c, "layers"):
                return c.layers[i].keys, c.layers[i].values
            return c.key_cache[i], c.value_cache[i]

        n_layers = len(caches[0].layers) if hasattr(caches[0], "layers") else len(caches[0].key_cache)
        merged = DynamicCache()
        for i in range(n_layers):
            ks, vs = zip(*(kv(c, i) for c in caches))
            merged.update(torch.cat(ks), torch.cat(vs), i)
        return merged

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        nxt, cache = self.forward(torch.tensor([prompt]))
        out = [int(nxt[0])]
        while len(out) < n:
            nxt, cache = self.forward(nxt[:, None], cache)
            out.append(int(nxt[0]))
        return out


def peer_prefill(loaded, hf: HFModel, n: int, repeats: int, g: torch.Generator) -> list[dict]:
    """moorage one-shot, moorage default chunking, transformers: same prompts, repeats interleaved."""
    vocab = loaded.config.vocab_size
    engines = {"moorage one-shot": make_engine(loaded, n + 16, n),
               "moorage chunked (default: 256/step)": make_engine(loaded, n + 16, 2048, long_prefill_tokens=256)}
    times: dict[str, list[float]] = {k: [] for k in [*engines, "transformers"]}
    steps = {}
    warm = random_ids(g, vocab, min(n, 512))  # warm-up: allocator and thread pools at a realistic size
    for name, eng in engines.items():
        eng.generate([warm], SamplingParams(max_tokens=1, ignore_eos=True))
    hf.forward(torch.tensor([warm]))
    for r in range(repeats):
        prompt = random_ids(g, vocab, n)
        for name, eng in engines.items():
            seq = eng.add_request(f"peer-prefill-{r}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
            steps[name] = 0
            t0 = time.perf_counter()
            while not seq.is_finished:
                eng.step()
                steps[name] += 1
            times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hf.forward(torch.tensor([prompt]))
        times["transformers"].append(time.perf_counter() - t0)
        gc.collect()
    hf_med = statistics.median(times["transformers"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"engine": name, "prompt_tokens": n, "repeats": repeats, "steps": steps.get(name, 1), "times_s": ts,
                     "median_s": med, "median_tok_per_s": n / med, "best_tok_per_s": n / min(ts),
                     "ratio_tok_per_s_vs_transformers": hf_med / med})
    return rows


def peer_decode(loaded, hf: HFModel, ctx: int, batch: int, steps: int, g: torch.Generator) -> dict:
    """`steps` timed decode steps per engine (rounds of: moorage, moorage with reference attention,
    transformers)."""
    vocab = loaded.config.vocab_size
    prompts = [random_ids(g, vocab, ctx) for _ in range(batch)]
    eng = make_engine(loaded, batch * (ctx + steps + 2 * 16), max(2048, ctx), max_num_seqs=batch)
    seqs = [eng.add_request(f"peer-dec-{i}", p, SamplingParams(max_tokens=2 * steps + 2, ignore_eos=True))
            for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    while any(not s.output_ids for s in seqs):  # untimed prefill
        eng.step()
    m_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    firsts, caches = [], []
    for p in prompts:  # transformers: row by row (no padding), then one batched cache
        nxt, c = hf.forward(torch.tensor([p]))
        firsts.append(nxt)
        caches.append(c)
    cache = caches[0] if batch == 1 else HFModel.concat(caches)
    del caches
    hf_prefill = time.perf_counter() - t0
    nxt = torch.cat(firsts)
    hf_tokens = [[int(x)] for x in nxt]
    backends = {"moorage": eng.model.attention}
    if eng.model.attention.name != "reference":
        backends["moorage-reference-attention"] = get_attention_kernels_forced("reference")
    times: dict[str, list[float]] = {k: [] for k in [*backends, "transformers"]}
    for _ in range(steps):
        for name, attn in backends.items():
            eng.model.attention = attn
            t0 = time.perf_counter()
            out = eng.step()
            times[name].append(time.perf_counter() - t0)
            assert sum(len(o.new_token_ids) for o in out) == batch and eng.stats.preemptions == 0
        t0 = time.perf_counter()
        nxt, cache = hf.forward(nxt[:, None], cache)
        times["transformers"].append(time.perf_counter() - t0)
        for row, x in zip(hf_tokens, nxt.tolist()):
            row.append(x)
    eng.model.attention = backends["moorage"]
    n = len(times["transformers"])
    matched = sum(sum(a == b for a, b in zip(s.output_ids[:n + 1], h)) for s, h in zip(seqs, hf_tokens))
    hf_ms = 1e3 * statistics.median(times["transformers"])
    row = {"context_tokens": ctx, "batch": batch, "steps_per_engine": n, "moorage_attention": backends["moorage"].name,
           "moorage_prefill_s": m_prefill, "transformers_prefill_s": hf_prefill,
           "greedy_tokens_matched": matched, "greedy_tokens_compared": batch * (n + 1)}
    for name, ts in times.items():
        key = name.replace("-", "_")
        row[f"{key}_ms_per_step"] = 1e3 * statistics.median(ts)
        row[f"{key}_ms_per_step_min"] = 1e3 * min(ts)
        row[f"{key}_ratio_vs_transformers"] = 1e3 * statistics.median(ts) / hf_ms
    del cache, eng
    gc.collect()
    return row


def get_attention_kernels_forced(name: str):
    import os

    from kernels import ATTN_ENV_VAR

    before = os.environ.get(ATTN_ENV_VAR)
    os.environ[ATTN_ENV_VAR] = name
    try:
        return get_attention_kernels("cpu")
    finally:
        if before is None:
            os.environ.pop(ATTN_ENV_VAR)
        else:
            os.environ[ATTN_ENV_VAR] = before


def peer_greedy(loaded, hf: HFModel, n: int, prompts_n: int) -> dict:
    tok = loaded.tokenizer
    prompts = [tok.chat_token_ids([{"role": "user", "content": c}]) for c in GREEDY_CHATS[:prompts_n]]
    eng = make_engine(loaded, sum(len(p) + n for p in prompts) + 64, 2048)
    mine = [s.output_ids for s in eng.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))]
    theirs = [hf.greedy(p, n) for p in prompts]
    rows = []
    for c, p, a, b in zip(GREEDY_CHATS, prompts, mine, theirs):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        rows.append({"prompt": c, "prompt_tokens": len(p), "tokens": n, "identical": a == b,
                     "matched_prefix": n if first is None else first, "moorage_text": tok.decode(a),
                     "transformers_text": tok.decode(b)})
    return {"prompts": len(rows), "identical": sum(r["identical"] for r in rows), "rows": rows}


def bench_peer(loaded, p: dict, g: torch.Generator) -> dict:
    log("peer: loading transformers")
    t0 = time.perf_counter()
    hf = HFModel()
    out = {"transformers": hf.version, "attn_implementation": hf.attn_impl, "load_s": time.perf_counter() - t0,
           "moorage_attention": get_attention_kernels("cpu").name, "prefill": [], "decode": []}
    greedy_prompts = 4 if p["greedy_tokens"] >= 32 else 2
    out["greedy"] = peer_greedy(loaded, hf, p["greedy_tokens"], greedy_prompts)
    log(f"peer greedy: {out['greedy']['identical']}/{out['greedy']['prompts']} prompts token-identical")
    for n, reps in p["prefill"]:
        out["prefill"] += peer_prefill(loaded, hf, n, reps, g)
        log("peer prefill " + ", ".join(f"{r['engine']} {r['median_tok_per_s']:.0f}" for r in out["prefill"][-3:]) + " tok/s")
    for ctx in p["decode_ctx"]:
        for b in p["decode_batches"]:
            row = peer_decode(loaded, hf, ctx, b, p["decode_steps"], g)
            out["decode"].append(row)
            log(f"peer decode ctx {ctx} batch {b}: moorage {row['moorage_ms_per_step']:.1f} ms/step, "
                f"reference attention {row.get('moorage_reference_attention_ms_per_step', float('nan')):.1f}, "
                f"transformers {row['transformers_ms_per_step']:.1f}")
    by = {(r["context_tokens"], r["batch"]): r for r in out["decode"]}
    base = min(p["decode_ctx"])
    for r in out["decode"]:
        r["moorage_ms_vs_smallest_context"] = r["moorage_ms_per_step"] / by[(base, r["batch"])]["moorage_ms_per_step"]
    del hf
    gc.collect()
    return out


def peer_report(r: dict) -> str:
    peer = r.get("peer")
    if not peer:
        return ""
    g = peer["greedy"]
    parts = [f"\n\n## peer: transformers {peer['transformers']} ({peer['attn_implementation']}), same GGUF, same "
             f"{r['machine']['torch_threads']} threads; moorage attention: {peer['moorage_attention']}\n",
             f"greedy: {g['identical']}/{g['prompts']} chat prompts token-identical over {g['rows'][0]['tokens']} tokens "
             f"(matched prefixes {[x['matched_prefix'] for x in g['rows']]})\n",
             md_table(["prompt tok", "engine", "steps", "median tok/s", "best tok/s", "moorage/transformers"],
                      [[x["prompt_tokens"], x["engine"], x["steps"], x["median_tok_per_s"], x["best_tok_per_s"],
                        x["ratio_tok_per_s_vs_transformers"]] for x in peer["prefill"]]), "",
             md_table(["context", "batch", "moorage ms/step", "ref-attention ms/step", "transformers ms/step",
                       "moorage/transformers", "ref/transformers", "moorage vs smallest ctx", "greedy tokens matched"],
                      [[x["context_tokens"], x["batch"], x["moorage_ms_per_step"],
                        x.get("moorage_reference_attention_ms_per_step", float("nan")), x["transformers_ms_per_step"],
                        x["moorage_ratio_vs_transformers"], x.get("moorage_reference_attention_ratio_vs_transformers", float("nan")),
                        x["moorage_ms_vs_smallest_context"], f"{x['greedy_tokens_matched']}/{x['greedy_tokens_compared']}"]
                       for x in peer["decode"]]),
             "prefill ratio: moorage tok/s / transformers tok/s (> 1: moorage faster); decode ratios: ms/step over "
             "transformers' ms/step (< 1: moorage faster); medians of interleaved steps"]
    return "\n".join(parts)


def peer_plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peer = result["peer"]
    fig, axes = plt.subplots(1, 2, figsize=(17, 6))
    fig.suptitle(f"moorage vs transformers {peer['transformers']} (SmolLM2-135M fp32, "
                 f"{result['machine']['torch_threads']} threads, {result['machine']['date']})", fontsize=11)
    ax = axes[0]
    sizes = list(dict.fromkeys(x["prompt_tokens"] for x in peer["prefill"]))
    engines = list(dict.fromkeys(x["engine"] for x in peer["prefill"]))
    w = 0.8 / len(engines)
    for j, e in enumerate(engines):
        vals = [next(x["median_tok_per_s"] for x in peer["prefill"] if x["engine"] == e and x["prompt_tokens"] == n)
                for n in sizes]
        bars = ax.bar([i + (j - (len(engines) - 1) / 2) * w for i in range(len(sizes))], vals, w, label=e)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(sizes)), [f"{n} tokens" for n in sizes])
    ax.set_ylabel("prefill tokens/s (median)")
    ax.set_title("Prefill (1 output token)")
    ax.legend(fontsize=8)
    ax = axes[1]
    rows = peer["decode"]
    keys = [("moorage_ms_per_step", f"moorage ({peer['moorage_attention']} attention)"),
            ("moorage_reference_attention_ms_per_step", "moorage, torch reference attention"),
            ("transformers_ms_per_step", "transformers")]
    keys = [k for k in keys if k[0] in rows[0]]
    w = 0.8 / len(keys)
    for j, (k, label) in enumerate(keys):
        bars = ax.bar([i + (j - (len(keys) - 1) / 2) * w for i in range(len(rows))], [x[k] for x in rows], w, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(rows)), [f"ctx {x['context_tokens']}\nbatch {x['batch']}" for x in rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms per decode step (median, log)")
    ax.set_title("Decode: one token per sequence per step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _merge(path: str, new: dict, sections: list[str]) -> dict:
    """The earlier result at `path` with `sections` replaced by `new`'s. `command` and `machine` become
    this run's; `base_run` keeps the earlier run's, which measured every other section (a note says so)."""
    import json

    with open(path) as f:
        old = json.load(f)
    if "base_run" not in old:
        old["base_run"] = {"command": old["command"], "machine": old["machine"],
                           "total_wall_s": old.get("total_wall_s"), "sections": old["sections"]}
    for name in sections:
        old[name] = new[name]
    if "kernels" in sections:
        old["kernel_backend"] = new["kernel_backend"]
        old["params"].update({k: v for k, v in new["params"].items() if k.startswith("kernel")})
    old["command"], old["machine"] = new["command"], new["machine"]
    kept = [x for x in old["base_run"]["sections"] if x not in sections]
    old["notes"] = [n for n in old["notes"] if not n.startswith("updated:")] + [
        f"updated: {', '.join(sections)} measured {new['machine']['date']} by 'command' on 'machine'; "
        f"{', '.join(kept)} are from the earlier run in 'base_run'"]
    return old


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for CI smoke (a couple of minutes)")
    ap.add_argument("--out", default="bench/results/engine.json")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--update", default=None, metavar="JSON",
                    help="replace only the measured sections of this earlier result (JSON and PNG rewritten in place; "
                         "the other sections, and the machine info they were measured with, are kept)")
    args = ap.parse_args(argv)
    sections = [x for x in args.sections.split(",") if x]
    if unknown := set(sections) - set(SECTIONS):
        ap.error(f"unknown sections {sorted(unknown)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    p, info = (QUICK if args.quick else FULL), machine_info()
    t_start = time.perf_counter()
    log("loading models")
    models = {SMOL: load_model(SMOL), "tiny": load_model("tiny")}
    g = torch.Generator().manual_seed(SEED)
    prefill = []
    for case in p["prefill"] if "prefill" in sections else ():
        prefill.append(bench_prefill(models, *case, g))
        log(f"prefill {case}: {prefill[-1]['median_tok_per_s']:.0f} tok/s ({prefill[-1]['mode']})")
        gc.collect()
    decode = []
    for model in (SMOL, "tiny") if "decode" in sections else ():
        for b in p["decode_batches"]:
            decode.append(bench_decode(models, model, b, p, g))
            log(f"decode {model} batch {b}: {decode[-1]['tok_per_s']:.1f} tok/s")
    backend, kernels = get_kv_kernels("cpu").name, []
    if "kernels" in sections:
        log("kernels")
        backend, kernels = bench_kernels(models[SMOL].config, p)
    peer = bench_peer(models[SMOL], p["peer"], torch.Generator().manual_seed(SEED + 2)) if "peer" in sections else None
    result = {
        "command": " ".join(["python -m bench.engine", *(argv if argv is not None else sys.argv[1:])]),
        "machine": info, "kernel_backend": backend, "attention_backend": get_attention_kernels("cpu").name,
        "sections": sections,
        "params": {"quick": args.quick, "seed": SEED, "compute_dtype": "float32", "engine_kv_dtype": "float32",
                   "enable_prefix_cache": False, "block_size": 16, **p},
        "units": {"*_s": "seconds (time.perf_counter)", "*tok_per_s": "tokens/second", "bytes*": "bytes",
                  "GBps": "1e9 bytes/second of payload", "ratio_vs_copy": "kernel GBps / copy GBps",
                  "ms_per_step": "milliseconds per engine step",
                  "ratio_vs_transformers": "moorage ms/step / transformers ms/step (decode)",
                  "ratio_tok_per_s_vs_transformers": "moorage tok/s / transformers tok/s (prefill)"},
        "notes": [
            "prefill time = add_request until the single output token (max_tokens=1, ignore_eos), after one warm-up request",
            "repeats: 3 for 2K prompts (median and best reported), 1 for 8K/16K; quick: 1",
            "long_prefill_tokens=0 (max_batched_tokens alone sets the chunking): with max_batched_tokens=2048 a "
            "2048-token prompt runs in one step (= one-shot); the 512-token chunk rows show the chunked-prefill cost at 2K",
            "decode tok/s counts tokens of decode steps only (max_tokens-1 per sequence); prompts prefilled untimed",
            "the machine may be shared: compare the matmul calibration at start/end (and load averages); "
            "a 2-thread torch run slows down many-fold when another process holds a core",
            "kernels: SmolLM2 layout; pack/unpack = 16 random blocks of stage 0 in a pool; gather = all "
            "ranks of a stages=1 prefill; scatter = rank 0 buffer into its own pages; out buffers preallocated; "
            "pages written before timing (calloc'd pages never written read as the shared zero page: cache-hot, "
            "which flattered gather and pack before 2026-11-30 21:05)",
            "peer: see the module docstring (bench/engine.py); same process, same threads, steps interleaved",
        ],
        "prefill": prefill, "decode": decode, "kv_bytes_per_token": kv_bytes(models), "kernels": kernels,
        "peer": peer,
    }
    measured = list(sections)
    if args.update:
        result, args.out = _merge(args.update, result, sections), args.update
        sections = result["base_run"]["sections"]
    base = all(x in sections for x in ("prefill", "decode", "kernels"))

    def plots(r: dict, path: str) -> None:
        if base:
            plot(r, path)
        if r["peer"] and "peer" in measured:
            peer_plot(r, path if not base else path.removesuffix(".png") + "-peer.png")

    write_result(result, args.out, t_start, plots, lambda r: (report(r) if base else "") + peer_report(r))


if __name__ == "__main__":
    main()
