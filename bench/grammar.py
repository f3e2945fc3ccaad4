"""What constrained decoding costs per token (issue 27's goal: at most +10% ITL at batch 8).

    python -m bench.grammar [--quick] [--out bench/results/grammar.json]

In-process engine (SmolLM2, fp32, CPU), decode only: B sequences (1 and 8) with the same prompt, once
free (ignore_eos) and once each under a grammar that cannot end early (a JSON array of at least 200
strings, the shape of a long tool argument, with a fresh matcher per sequence), N decode steps each. The
two modes alternate over R repeats so the box's load falls on both alike. ITL = the median decode step time
(every sequence gets one token per step). The grammar's mask is filled on its own thread while the forward
pass runs (shared/engine/guide.py), so what remains is the apply and the token accept.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench._util import machine_info, md_table, write_result

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 200}


def decode_steps(engine, prompt: list[int], batch: int, steps: int, grammar: str) -> list[float]:
    """Seconds per decode step (after every prompt is computed) of `batch` sequences."""
    from shared.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps + 1, ignore_eos=not grammar, grammar=grammar)
    seqs = [engine.add_request(f"g{time.monotonic_ns()}-{i}", prompt, params) for i in range(batch)]
    while any(len(s.output_ids) == 0 for s in seqs):  # prefill (and the first token)
        engine.step()
    times = []
    while not all(s.is_finished for s in seqs):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def run(quick: bool) -> dict:
    import llguidance

    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.models import load_model

    loaded = load_model("smollm2-135m")
    engine = Engine(loaded, EngineConfig(num_blocks=512, enable_prefix_cache=False))
    prompt = loaded.tokenizer.chat_token_ids([{"role": "user", "content": "List fruit names as a JSON array."}])
    from services.router.guided import enforced

    grammar = llguidance.LLMatcher.grammar_from_json_schema(enforced(SCHEMA))  # as the router builds it
    steps, repeats = (16, 2) if quick else (48, 5)
    rows = []
    for batch in (1, 8):
        decode_steps(engine, prompt, batch, 4, grammar)  # warm both paths
        free, guided = [], []
        for _ in range(repeats):
            free.append(statistics.median(decode_steps(engine, prompt, batch, steps, "")))
            guided.append(statistics.median(decode_steps(engine, prompt, batch, steps, grammar)))
        ratio = [g / f for g, f in zip(guided, free)]
        rows.append({"batch": batch, "steps": steps, "repeats": repeats,
                     "itl_free_ms": round(statistics.median(free) * 1e3, 2),
                     "itl_guided_ms": round(statistics.median(guided) * 1e3, 2),
                     "overhead": round(statistics.median(ratio) - 1, 4),
                     "overhead_each_repeat": [round(r - 1, 4) for r in ratio]})
    return {"params": {"quick": quick, "model": "smollm2-135m", "schema": SCHEMA}, "rows": rows}


def report(result: dict) -> str:
    return "## constrained decoding: ITL with vs without a grammar\n" + md_table(
        ["batch", "ITL free (ms)", "ITL guided (ms)", "overhead (median of repeats)", "each repeat"],
        [[r["batch"], r["itl_free_ms"], r["itl_guided_ms"], f"{r['overhead']:+.1%}",
          " ".join(f"{x:+.1%}" for x in r["overhead_each_repeat"])] for r in result["rows"]])


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["itl_free_ms"] for r in rows], 0.4, label="free")
    bars = ax.bar(x + 0.2, [r["itl_guided_ms"] for r in rows], 0.4, label="grammar (llguidance)")
    ax.bar_label(bars, labels=[f"{r['overhead']:+.1%}" for r in rows], fontsize=8)
    ax.set_xticks(x, [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("decode step (ms, median)")
    ax.set_title("Constrained decoding's cost per token (SmolLM2, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=f"runs/grammar-{time.strftime('%Y%m%d-%H%M%S')}/grammar.json")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    result = {"machine": machine_info(), **run(args.quick)}
    write_result(result, args.out, t0, plot, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
