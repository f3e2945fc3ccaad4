"""Parallel layouts as ranks (issue 51): pipeline-parallel prefill (P ranks) and context-parallel decode (C ranks)
against one process, in one run.

    python -m bench.layouts [--quick] [--out bench/results/layouts.json]

Engines in this process, each with its rank processes (shared/engine/pipeline.py, context_parallel.py), all
started before any is timed and measured in interleaved rounds (every configuration once per round), so each
sees the same machine load; ratios are to P = 1 and C = 1 of the same round.
- Prefill: the time to a prompt's first token (prefill only: max_tokens 1; no prefix cache, so every round
  computes the whole prompt) by prompt length and P; the pipeline bubble (the share of a step's wall time the
  average rank sat idle) from the ranks' own compute times.
- Decode: milliseconds per decode step by context length, batch and C (after the prompts' prefill), and the
  share of it rank 0 spent waiting for the other ranks' attention shares.
- Exactness: every configuration's greedy tokens against P = C = 1's (they must be equal).

On 2 cores the ranks share the cores one process had: P, C > 1 are expected to be slower here; this measures
by how much, and what the bubble and the exchange cost, rather than hiding it. The seed's gains need one device
per rank.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from bench._util import machine_info, md_table, write_result
from shared.engine.engine import Engine, EngineConfig
from shared.engine.models import load_model
from shared.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Size:
    model: str = "smollm2-135m"
    prompt_lengths: tuple = (512, 2048)
    pp: tuple = (1, 2, 4)
    dcp: tuple = (1, 2, 4)
    contexts: tuple = (1024, 2048)
    batches: tuple = (1, 4)
    decode_steps: int = 16
    rounds: int = 2
    vocab: int = 32000


QUICK = Size(model="tiny", prompt_lengths=(256, 1024), pp=(1, 2), dcp=(1, 2), contexts=(512,), batches=(1,),
             decode_steps=6, rounds=2, vocab=256)
FULL = Size()


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _blocks(tokens: int) -> int:
    return -(-tokens // 16) + 16


def prefill_once(engine: Engine, prompt: list[int]) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    [seq] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return (time.perf_counter() - t0) * 1e3, seq.output_ids


def decode_once(engine: Engine, prompts: list[list[int]], steps: int) -> tuple[float, list[list[int]], float]:
    """ms per decode step over `steps` steps, after the prompts' prefill (not timed); the tokens; the share of the
    decode steps' time rank 0 waited for the other ranks' attention shares (0 with one process)."""
    sp = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(f"d{time.monotonic_ns()}-{i}", p, sp) for i, p in enumerate(prompts)]
    while any(not s.output_ids for s in seqs):
        engine.step()
    t0, n, ex = time.perf_counter(), 0, engine.context.exchange_ms if engine.context else 0.0
    while any(not s.is_finished for s in seqs):
        engine.step()
        n += 1
    took = (time.perf_counter() - t0) * 1e3
    waited = (engine.context.exchange_ms - ex) / took if engine.context else 0.0
    return took / max(n, 1), [s.output_ids for s in seqs], waited


def run(size: Size) -> dict:
    loaded = load_model(size.model)
    longest = max(size.prompt_lengths)
    pre = {p: Engine(loaded, EngineConfig(num_blocks=_blocks(longest), pp=p, enable_prefix_cache=False,
                                          long_prefill_tokens=0, max_batched_tokens=2048)) for p in size.pp}
    dec_tokens = max(size.batches) * (max(size.contexts) + size.decode_steps + 16)
    dec = {c: Engine(loaded, EngineConfig(num_blocks=_blocks(dec_tokens), dcp=c, enable_prefix_cache=False))
           for c in size.dcp}
    try:
        prefill = {(n, p): [] for n in size.prompt_lengths for p in size.pp}
        decode = {(ctx, b, c): [] for ctx in size.contexts for b in size.batches for c in size.dcp}
        bubble = {(n, p): [] for n in size.prompt_lengths for p in size.pp if p > 1}
        waited = {(ctx, b, c): [] for ctx in size.contexts for b in size.batches for c in size.dcp if c > 1}
        exact, checked = True, 0
        for rnd in range(size.rounds):
            for n in size.prompt_lengths:
                prompt = _ids(rnd * 100 + n, n, size.vocab)
                tokens = {}
                for p, engine in pre.items():
                    st = engine.pipeline.stats if engine.pipeline else None
                    before = (st.wall_ms, sum(st.busy_ms)) if st else None
                    ms, tokens[p] = prefill_once(engine, prompt)
                    prefill[(n, p)].append(ms)
                    if st:
                        wall, busy = st.wall_ms - before[0], sum(st.busy_ms) - before[1]
                        bubble[(n, p)].append(max(0.0, 1 - busy / (p * wall)))
                exact &= all(t == tokens[size.pp[0]] for t in tokens.values())
                checked += 1
            for ctx in size.contexts:
                for b in size.batches:
                    prompts = [_ids(rnd * 1000 + ctx + i, ctx, size.vocab) for i in range(b)]
                    tokens = {}
                    for c, engine in dec.items():
                        ms, tokens[c], share = decode_once(engine, prompts, size.decode_steps)
                        decode[(ctx, b, c)].append(ms)
                        if engine.context:
                            waited[(ctx, b, c)].append(share)
                    exact &= all(t == tokens[size.dcp[0]] for t in tokens.values())
                    checked += 1
    finally:
        for e in [*pre.values(), *dec.values()]:
            e.close()
    med = statistics.median
    return {
        "params": {**asdict(size), "quick": size == QUICK},
        "prefill": [{"prompt_tokens": n, "pp": p, "ttft_ms_median": med(v), "ttft_ms_all": v,
                     "vs_pp1": med(v) / med(prefill[(n, size.pp[0])]),
                     "bubble_median": med(bubble[(n, p)]) if (n, p) in bubble else 0.0}
                    for (n, p), v in prefill.items()],
        "decode": [{"context": ctx, "batch": b, "dcp": c, "step_ms_median": med(v), "step_ms_all": v,
                    "vs_dcp1": med(v) / med(decode[(ctx, b, size.dcp[0])]),
                    "exchange_wait_share": med(waited[(ctx, b, c)]) if (ctx, b, c) in waited else 0.0}
                   for (ctx, b, c), v in decode.items()],
        "exact": exact, "comparisons": checked,
    }


def report(r: dict) -> str:
    pre = md_table(["prompt tokens", "P", "TTFT ms (median)", "vs P=1", "bubble"],
                   [[x["prompt_tokens"], x["pp"], x["ttft_ms_median"], x["vs_pp1"], x["bubble_median"]]
                    for x in r["prefill"]])
    dec = md_table(["context", "batch", "C", "ms / step (median)", "vs C=1", "waiting for ranks"],
                   [[x["context"], x["batch"], x["dcp"], x["step_ms_median"], x["vs_dcp1"], x["exchange_wait_share"]]
                    for x in r["decode"]])
    return (f"## layouts ({r['params']['model']}, {r['params']['rounds']} interleaved rounds)\n\n{pre}\n\n{dec}\n\n"
            f"greedy tokens equal to P = C = 1 in all {r['comparisons']} comparisons: {r['exact']}")


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for n in r["params"]["prompt_lengths"]:
        rows = [x for x in r["prefill"] if x["prompt_tokens"] == n]
        a.plot([x["pp"] for x in rows], [x["vs_pp1"] for x in rows], "o-", label=f"{n} tokens")
    a.set(xlabel="pipeline ranks P", ylabel="TTFT vs P = 1", title="prefill (pp ranks)")
    for ctx in r["params"]["contexts"]:
        for bt in r["params"]["batches"]:
            rows = [x for x in r["decode"] if x["context"] == ctx and x["batch"] == bt]
            b.plot([x["dcp"] for x in rows], [x["vs_dcp1"] for x in rows], "o-", label=f"ctx {ctx}, batch {bt}")
    b.set(xlabel="context-parallel ranks C", ylabel="decode step vs C = 1", title="decode (dcp ranks)")
    for ax in (a, b):
        ax.axhline(1, color="grey", lw=0.5)
        ax.legend()
    fig.suptitle(f"{r['params']['model']} on {r['machine']['cpu_count']} CPUs: ranks share the cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench/results/layouts.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    machine = machine_info()
    result = run(QUICK if args.quick else FULL)
    result["machine"] = machine
    write_result(result, args.out, t0, plot, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
