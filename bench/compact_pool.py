"""What compact pool objects cost in accuracy (issue 29): restored turns with their history's KV rounded to
bfloat16 or float8 e4m3fn, against the from-scratch output, for SmolLM2 and Gemma 3 270M in float32.

    python -m bench.compact_pool [--quick] [--out bench/results/compact-pool.json]

A restored turn here is a prompt whose leading full chunks (the history) come from the device prefix cache
holding exactly what a `pool.dtype = "bfloat16"` (or `"float8_e4m3fn"`) restore leaves in its blocks: the
history's float32 KV rounded to that type (tests/test_pool_connector.py proves a restore leaves bit for bit
that), and whose last tokens (< one chunk + 16) are computed. Each prompt runs four ways on the same engine
and weights:
- scratch: no prefix cache, everything computed;
- lossless: the history from the cache as computed (pool.dtype = "", the default): must equal scratch;
- bfloat16, float8_e4m3fn: the history rounded (e4m3fn: to nearest even, saturating at +-448, unscaled).
Reported per prompt: the first generated token's max |logit difference| against scratch, whether its
argmax moved, and the first position where the greedy output diverges (None: all `tokens` identical).
Prompts are this repository's own source and docs (code and prose), 1-2K tokens each.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench._util import machine_info, md_table, write_result

MODELS = ("smollm2-135m", "gemma3-270m")
COMPACT = ("bfloat16", "float8_e4m3fn")
MODES = ("lossless",) + COMPACT
SOURCES = ("shared/engine/model.py", "services/router/prepare.py", "README.md", "docs/protocol.md",
           "shared/kv_object.py", "bench/_util.py", "services/prefill/pool_save.py", "docs/DESIGN.md")
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Size:
    prompts: int = 8
    tokens: int = 64
    prompt_tokens: tuple[int, int] = (1100, 2000)


QUICK = Size(prompts=2, tokens=16, prompt_tokens=(600, 800))
FULL = Size()


def prompts_for(tokenizer, size: Size) -> list[list[int]]:
    lo, hi = size.prompt_tokens
    out = []
    for i, src in enumerate(SOURCES[:size.prompts]):
        ids = tokenizer.encode((ROOT / src).read_text())
        out.append(ids[:lo + (hi - lo) * i // max(1, size.prompts - 1)])
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)


def run_model(model: str, size: Size) -> list[dict]:
    import torch

    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.models import load_model
    from shared.engine.sampling import SamplingParams

    loaded = load_model(model)
    blocks = 2 * size.prompt_tokens[1] // 16 + 32
    scratch = Engine(loaded, EngineConfig(num_blocks=blocks, enable_prefix_cache=False, record_prompt_logits=True))
    cached = Engine(loaded, EngineConfig(num_blocks=blocks, record_prompt_logits=True))
    chunk = cached.layout.chunk_tokens
    params = SamplingParams(max_tokens=size.tokens, ignore_eos=True)
    rows = []
    for i, ids in enumerate(prompts_for(loaded.tokenizer, size)):
        history = (len(ids) - 16) // chunk * chunk
        [ref] = scratch.generate([ids], params)
        for mode in MODES:
            assert cached.block_manager.reset_prefix_cache() >= 0
            cached.generate([ids[:history]], SamplingParams(max_tokens=1, ignore_eos=True))
            if mode != "lossless":  # what a restore of compact objects leaves in the history's blocks
                held = cached.block_manager.match_prefix(ids[:history]).block_ids
                for pages in cached.pages:
                    pages[held] = pages[held].to(getattr(torch, mode)).to(pages.dtype)
            t0 = time.perf_counter()
            [seq] = cached.generate([ids], params)
            assert seq.num_device_cached == history, (seq.num_device_cached, history)
            diff = (seq.prompt_logits.float() - ref.prompt_logits.float()).abs()
            rows.append({"model": model, "prompt": i, "source": SOURCES[i], "prompt_tokens": len(ids),
                         "history_tokens": history, "mode": mode,
                         "first_token_max_logit_diff": float(diff.max()),
                         "first_token_argmax_moved": int(seq.prompt_logits.argmax()) != int(ref.prompt_logits.argmax()),
                         "first_divergence": first_divergence(seq.output_ids, ref.output_ids),
                         "tokens_compared": len(ref.output_ids), "turn_s": time.perf_counter() - t0})
            print(f"{model} prompt {i} ({len(ids)} tokens, {history} from cache) {mode}: "
                  f"max |dlogit| {rows[-1]['first_token_max_logit_diff']:.3g}, "
                  f"diverges at {rows[-1]['first_divergence']}", flush=True)
    kv = cached.layout
    amax = max(float(p.abs().max()) for p in cached.pages)  # e4m3fn saturates past 448
    return rows, {"kv_bytes_per_token": kv.bytes_per_token, "pool_bytes_per_token_bfloat16": kv.bytes_per_token // 2,
                  "pool_bytes_per_token_float8_e4m3fn": kv.bytes_per_token // 4,
                  "kv_dtype": str(kv.dtype).removeprefix("torch."), "kv_abs_max_seen": amax}


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for mode in MODES:
            rs = [r for r in rows if r["model"] == model and r["mode"] == mode]
            if not rs:
                continue
            div = [r["first_divergence"] for r in rs if r["first_divergence"] is not None]
            diffs = [r["first_token_max_logit_diff"] for r in rs]
            out.append({"model": model, "mode": mode, "prompts": len(rs),
                        "identical_outputs": sum(r["first_divergence"] is None for r in rs),
                        "tokens_compared": rs[0]["tokens_compared"],
                        "first_divergence_min": min(div) if div else None,
                        "first_divergence_median": statistics.median(div) if div else None,
                        "first_token_argmax_moved": sum(r["first_token_argmax_moved"] for r in rs),
                        "max_logit_diff_median": statistics.median(diffs), "max_logit_diff_max": max(diffs)})
    return out


def report(result: dict) -> str:
    rows = [[s["model"], s["mode"], f"{s['identical_outputs']}/{s['prompts']}", s["tokens_compared"],
             s["first_divergence_min"], s["first_divergence_median"], s["first_token_argmax_moved"],
             f"{s['max_logit_diff_median']:.3g}", f"{s['max_logit_diff_max']:.3g}"] for s in result["summary"]]
    sizes = [[m, v["kv_dtype"], v["kv_bytes_per_token"], v["pool_bytes_per_token_bfloat16"],
              v.get("pool_bytes_per_token_float8_e4m3fn"), f"{v.get('kv_abs_max_seen', float('nan')):.3g}"]
             for m, v in result["bytes"].items()]
    return (md_table(["model", "pool objects", "identical outputs", "tokens", "first divergence (min)",
                      "(median)", "first token moved", "max abs dlogit, median", "max"], rows) + "\n\n"
            + md_table(["model", "KV dtype", "KV bytes/token", "bfloat16 pool bytes/token",
                        "float8_e4m3fn pool bytes/token", "largest |KV| seen"], sizes))


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, model in enumerate(dict.fromkeys(r["model"] for r in result["rows"])):
        for j, (mode, marker) in enumerate(zip(COMPACT, "ox")):
            rs = [r for r in result["rows"] if r["model"] == model and r["mode"] == mode]
            ax.scatter([r["prompt"] + 0.15 * k + 0.3 * j for r in rs], [r["first_token_max_logit_diff"] for r in rs],
                       marker=marker, label=f"{model} {mode}")
    ax.set_yscale("log")
    ax.set_xlabel("prompt")
    ax.set_ylabel("first token: max |logit diff| vs scratch")
    ax.set_title("history restored from compact pool objects (lossless: 0)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default="bench/results/compact-pool.json")
    args = ap.parse_args(argv)
    size = QUICK if args.quick else FULL
    t0 = time.perf_counter()
    rows, sizes = [], {}
    for model in args.models.split(","):
        got, sizes[model] = run_model(model, size)
        rows += got
    result = {"params": {"quick": args.quick, "size": asdict(size), "models": args.models.split(",")},
              "rows": rows, "summary": summarize(rows), "bytes": sizes, "machine": machine_info()}
    write_result(result, args.out, t0, plot, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
