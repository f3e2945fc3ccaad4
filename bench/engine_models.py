"""The engine's model axis (issue 28): prefill tok/s, decode ms per step and resident memory for each bundled
model in float32 and bfloat16, against transformers on the same GGUF, the same dtype and the same threads.

    python -m bench.engine_models [--quick] [--out bench/results/engine-models.json]

Speed: both engines in one process per (model, dtype), measured in turns on the same prompts, the order
alternating (process-to-process variance on a shared box is ~10%, more than the differences measured).
Memory: each (engine, model, dtype) in a process of its own, so its resident memory is its own.
- memory: RSS growth from before loading to after the engine is built and `LoadedModel.release_weights`
  ran (what prefill and decode do), against the engine's weights in the compute dtype plus its KV pages
  (goal: at most 1.3x). The same before release_weights is reported too.
- prefill: one prompt of `prefill_tokens` random ids in one step (max_batched_tokens = prompt), median of
  `repeats`, after a warm-up; transformers: one forward over the same ids.
- decode: `batch` prompts of `context` tokens prefilled (untimed), then `steps` steps of one token each,
  median ms per step over two turns of each engine; transformers: row caches concatenated, one batched
  forward per step.
Prompts are random ids from a seeded generator (prefix cache off). bf16 on a CPU with AMX-BF16 runs
oneDNN's bf16 kernels; without it torch emulates them and bf16 is slower.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from bench._util import machine_info, md_table, write_result

MODELS = ("smollm2-135m", "gemma3-270m")
DTYPES = ("float32", "bfloat16")
SEED = 20261204


@dataclass(frozen=True)
class Size:
    prefill_tokens: int = 1024
    repeats: int = 7
    context: int = 256
    batches: tuple[int, ...] = (1, 8)
    steps: int = 16


QUICK = Size(prefill_tokens=256, repeats=2, context=64, batches=(1, 4), steps=4)
FULL = Size()


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _tensor_bytes(model) -> int:
    import torch

    seen, total = set(), 0
    for t in [model.embed, model.lm_head, model.norm, *(v for layer in model.layers for v in layer.values())]:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


class _Moorage:
    """The engine on one bundled model: prefill seconds for a prompt, decode seconds per step."""

    name = "moorage"

    def __init__(self, model: str, dtype: str, size: Size):
        from shared.engine.engine import Engine, EngineConfig
        from shared.engine.models import load_model

        rss0 = _rss()
        loaded = load_model(model)
        self.vocab = loaded.config.vocab_size
        need = max(size.prefill_tokens, max(size.batches) * (size.context + size.steps + 16)) + 64
        self.eng = Engine(loaded, EngineConfig(dtype=dtype, num_blocks=-(-need // 16) + 8, kv_warm_ahead="0",
                                               enable_prefix_cache=False,
                                               max_batched_tokens=max(size.prefill_tokens, 2048),
                                               long_prefill_tokens=0, max_num_seqs=max(size.batches)))
        rss_kept = _rss() - rss0
        loaded.release_weights()
        rss = _rss() - rss0
        weights, kv = _tensor_bytes(self.eng.model), sum(p.untyped_storage().nbytes() for p in self.eng.pages)
        self.memory = {"weights_bytes": weights, "kv_bytes": kv, "rss_growth_bytes": rss,
                       "rss_growth_before_release_bytes": rss_kept, "rss_ratio": rss / (weights + kv),
                       "rss_ratio_before_release": rss_kept / (weights + kv)}

    def _add(self, prompts: list[list[int]], max_tokens: int):
        from shared.engine.sampling import SamplingParams

        return [self.eng.add_request(f"r{time.monotonic_ns()}-{i}", p,
                                     SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                for i, p in enumerate(prompts)]

    def prefill(self, ids: list[int]) -> float:
        [s] = self._add([ids], 1)
        t0 = time.perf_counter()
        while not s.is_finished:
            self.eng.step()
        return time.perf_counter() - t0

    def decode(self, prompts: list[list[int]], steps: int) -> list[float]:
        seqs = self._add(prompts, steps + 2)
        while any(not s.output_ids for s in seqs):  # untimed prefill
            self.eng.step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            self.eng.step()
            times.append(time.perf_counter() - t0)
        for s in seqs:
            self.eng.abort(s.request_id)
        while self.eng.step() is not None and any(not s.is_finished for s in seqs):
            pass
        gc.collect()
        return times


class _Transformers:
    """transformers on the same GGUF and dtype (SDPA): one forward for a prompt; decode with the row caches
    concatenated, one batched forward per step."""

    name = "transformers"

    def __init__(self, model: str, dtype: str, size: Size):
        import torch

        from bench.engine import HFModel
        from shared.engine.models import bundled_path

        rss0 = _rss()
        self.hf = HFModel(bundled_path(model), getattr(torch, dtype))
        self.memory = {"rss_growth_bytes": _rss() - rss0}
        self.vocab = self.hf.model.config.vocab_size

    def prefill(self, ids: list[int]) -> float:
        import torch

        prompt = torch.tensor([ids])
        t0 = time.perf_counter()
        self.hf.forward(prompt)
        return time.perf_counter() - t0

    def decode(self, prompts: list[list[int]], steps: int) -> list[float]:
        import torch

        from bench.engine import HFModel

        firsts, caches = zip(*(self.hf.forward(torch.tensor([p])) for p in prompts))
        cache = caches[0] if len(prompts) == 1 else HFModel.concat(list(caches))
        nxt = torch.cat(firsts)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            nxt, cache = self.hf.forward(nxt[:, None], cache)
            times.append(time.perf_counter() - t0)
        del cache, caches
        gc.collect()
        return times


ENGINES = {"moorage": _Moorage, "transformers": _Transformers}


def child_memory(engine: str, model: str, dtype: str, size: Size) -> dict:
    """Resident memory of one engine alone in this process."""
    return ENGINES[engine](model, dtype, size).memory


def child_speed(model: str, dtype: str, size: Size) -> dict:
    """Both engines in this one process, measured in turns on the same prompts (the order alternates), so a
    noisy neighbour or a slow spell lands on both: median prefill tok/s and median decode ms per step."""
    import torch

    engines = [_Moorage(model, dtype, size), _Transformers(model, dtype, size)]
    g = torch.Generator().manual_seed(SEED)

    def ids(n):
        return torch.randint(0, engines[0].vocab, (n,), generator=g).tolist()

    for e in engines:  # warm-up
        e.prefill(ids(min(size.prefill_tokens, 128)))
    prefill = {e.name: [] for e in engines}
    for r in range(size.repeats):
        prompt = ids(size.prefill_tokens)
        for e in engines if r % 2 == 0 else engines[::-1]:
            prefill[e.name].append(e.prefill(prompt))
    decode = {e.name: {} for e in engines}
    for b in size.batches:
        for r in range(2):
            prompts = [ids(size.context) for _ in range(b)]
            for e in engines if r % 2 == 0 else engines[::-1]:
                decode[e.name].setdefault(str(b), []).extend(e.decode(prompts, size.steps))
    return {e.name: {"prefill_tok_per_s": size.prefill_tokens / statistics.median(prefill[e.name]),
                     "decode_ms_per_step": {b: 1e3 * statistics.median(v) for b, v in decode[e.name].items()}}
            for e in engines}


def _child(args: list[str], quick: bool) -> dict:
    """One child process: its JSON line, or the error it died of."""
    cmd = [sys.executable, "-m", "bench.engine_models", "--child", *args] + (["--quick"] if quick else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        return {"error": (p.stderr or p.stdout)[-1500:]}
    return json.loads(lines[-1])


def run(size: Size, quick: bool, models=MODELS, dtypes=DTYPES) -> dict:
    rows = []
    for model in models:
        for dtype in dtypes:
            speed = _child(["speed", model, dtype], quick)
            mem = {e: _child(["memory", e, model, dtype], quick) for e in ENGINES}
            err = speed.get("error") or next((m["error"] for m in mem.values() if "error" in m), None)
            row = {"model": model, "dtype": dtype}
            if err:
                row["error"] = err
            else:
                m, t = ({**speed[e], **mem[e]} for e in ENGINES)
                row.update(moorage=m, transformers=t,
                           prefill_ratio_vs_transformers=m["prefill_tok_per_s"] / t["prefill_tok_per_s"],
                           decode_ratio_vs_transformers={b: t["decode_ms_per_step"][b] / m["decode_ms_per_step"][b]
                                                         for b in m["decode_ms_per_step"]})
            rows.append(row)
    return {"params": {"quick": quick, "size": asdict(size), "seed": SEED}, "rows": rows}


def report(result: dict) -> str:
    table = []
    for r in result["rows"]:
        if "error" in r:
            table.append([r["model"], r["dtype"], "error", "", "", "", ""])
            continue
        m, t = r["moorage"], r["transformers"]
        dec = " / ".join(f"{m['decode_ms_per_step'][b]:.1f} vs {t['decode_ms_per_step'][b]:.1f}"
                         for b in m["decode_ms_per_step"])
        table.append([r["model"], r["dtype"], f"{m['prefill_tok_per_s']:.0f} vs {t['prefill_tok_per_s']:.0f}",
                      f"{r['prefill_ratio_vs_transformers']:.2f}", dec,
                      " / ".join(f"{v:.2f}" for v in r["decode_ratio_vs_transformers"].values()),
                      f"{m['rss_ratio']:.2f} ({m['rss_ratio_before_release']:.2f} kept)"])
    batches = "/".join(str(b) for b in result["params"]["size"]["batches"])
    return md_table(["model", "dtype", "prefill tok/s (moorage vs transformers)", "ratio",
                     f"decode ms/step, batch {batches}", "ratio", "RSS / (weights + KV)"], table)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result["rows"] if "prefill_ratio_vs_transformers" in r]
    names = [f"{r['model']}\n{r['dtype']}" for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(names, [r["prefill_ratio_vs_transformers"] for r in ok])
    axes[0].set_title("prefill tok/s, moorage / transformers")
    b = list(ok[0]["decode_ratio_vs_transformers"])[-1] if ok else "1"
    axes[1].bar(names, [r["decode_ratio_vs_transformers"][b] for r in ok])
    axes[1].set_title(f"decode speed (batch {b}), moorage / transformers")
    for ax in axes:
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench/results/engine-models.json")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # speed MODEL DTYPE | memory ENGINE MODEL DTYPE
    args = ap.parse_args(argv)
    size = QUICK if args.quick else FULL
    if args.child:
        kind, *rest = args.child
        print(json.dumps(child_speed(*rest, size) if kind == "speed" else child_memory(*rest, size)))
        return 0
    t0 = time.perf_counter()
    result = run(size, args.quick, args.models.split(","), args.dtypes.split(","))
    result["machine"] = machine_info()
    write_result(result, args.out, t0, plot, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
