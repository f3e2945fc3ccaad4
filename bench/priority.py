"""Two priority classes under overload (issue 30's agent hints): does a high-priority request keep its
unloaded TTFT while low-priority work saturates the system?

    python -m bench.priority [--quick] [--out bench/results/priority.json]

Against the default `moorage up` (SmolLM2, pool on), with the openai SDK:
1. unloaded: `high` requests one after another, nothing else running;
2. overloaded: `low_clients` closed-loop clients each keep one cold low-priority request in flight (more
   prefill work than the host computes: the queue grows), and meanwhile the same number of high requests
   as in 1, alternating priority 0 and `nvext.agent_hints.priority` = `priority`, so both classes meet the
   same load in one run.
Every prompt is cold (its own words and session), so no cache hit flatters either class.

Reported: TTFT p50/p90 per class, each as a ratio to the unloaded p50, the low class's TTFT and
throughput, and every error. Goal (issue 30): high priority within 1.5x of unloaded under overload.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from dataclasses import dataclass

import numpy as np

from bench._util import md_table, system_bench_main

WORDS = ("def return class import self value error test build compile python module function agent tool "
         "result path file line assert config request response token cache session history patch diff").split()


@dataclass(frozen=True)
class Size:
    high: int = 4                  # high-class requests per phase and per priority
    low_clients: int = 6
    high_tokens: int = 600
    low_tokens: int = 1500
    high_max_tokens: int = 4
    low_max_tokens: int = 16
    priority: int = 5
    pause_s: float = 1.0           # between high requests
    warm_s: float = 6.0            # overload runs this long before the first high request


QUICK = Size()
FULL = Size(high=12, low_clients=8)


def prompt(tokenizer, seed: int, tokens: int) -> str:
    rng, words = random.Random(seed), []
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words += [rng.choice(WORDS) for _ in range(100)]
    return f"request {seed}: " + " ".join(words)


async def one(client, model: str, text: str, max_tokens: int, session: str, priority: int | None) -> dict:
    t0, first = time.monotonic(), None
    extra = {"nvext": {"agent_hints": {"priority": priority}}} if priority is not None else {}
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
            stream=True, extra_body=extra, extra_headers={"X-Session-ID": session})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.monotonic()
        end = time.monotonic()
        return {"ok": True, "ttft_s": round((first or end) - t0, 3), "total_s": round(end - t0, 3)}
    except Exception as e:  # the outcome is the measurement
        return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}


async def drive(url: str, model: str, tokenizer, size: Size) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=900, max_retries=0)
    seeds = iter(range(1, 10 ** 6))
    rows = []

    async def high(phase: str, priority: int | None) -> None:
        seed = next(seeds)
        r = await one(client, model, prompt(tokenizer, seed, size.high_tokens), size.high_max_tokens,
                      f"high-{seed}", priority)
        rows.append({"class": "high", "phase": phase, "priority": priority or 0, **r})
        await asyncio.sleep(size.pause_s)

    try:
        for _ in range(size.high):
            await high("unloaded", None)
        stop = asyncio.Event()
        low_rows: list[dict] = []

        async def low(i: int) -> None:
            while not stop.is_set():
                seed = next(seeds)
                r = await one(client, model, prompt(tokenizer, seed, size.low_tokens), size.low_max_tokens,
                              f"low-{seed}", None)
                low_rows.append({"class": "low", "phase": "overloaded", "priority": 0, "t": time.monotonic(), **r})

        lows = [asyncio.create_task(low(i)) for i in range(size.low_clients)]
        await asyncio.sleep(size.warm_s)
        t0 = time.monotonic()
        for _ in range(size.high):
            await high("overloaded", None)
            await high("overloaded", size.priority)
        span = time.monotonic() - t0
        stop.set()
        await asyncio.gather(*lows)
        rows += low_rows
        done_in_span = sum(1 for r in low_rows if r["ok"] and t0 <= r["t"] <= t0 + span)
        return {"rows": rows, "overloaded_s": round(span, 1), "low_completed_per_s": round(done_in_span / span, 3)}
    finally:
        await client.close()


def summarize(rows: list[dict], size: Size) -> dict:
    def stats(sel) -> dict:
        t = [r["ttft_s"] for r in rows if r["ok"] and sel(r)]
        return {"n": len(t), "ttft_p50_s": round(float(np.percentile(t, 50)), 3) if t else None,
                "ttft_p90_s": round(float(np.percentile(t, 90)), 3) if t else None}

    out = {"unloaded": stats(lambda r: r["class"] == "high" and r["phase"] == "unloaded"),
           "overloaded, priority 0": stats(lambda r: r["class"] == "high" and r["phase"] == "overloaded"
                                           and r["priority"] == 0),
           f"overloaded, priority {size.priority}": stats(lambda r: r["class"] == "high" and r["phase"] == "overloaded"
                                                          and r["priority"] == size.priority),
           "low class (overload)": stats(lambda r: r["class"] == "low")}
    base = out["unloaded"]["ttft_p50_s"]
    for v in out.values():
        if base and v["ttft_p50_s"] is not None:
            v["p50_vs_unloaded"] = round(v["ttft_p50_s"] / base, 2)
    return out


def run(size: Size, run_dir: str, overrides: list[str] = ()) -> dict:
    from infra.up import UpConfig, launched
    from shared.config import load_config
    from shared.engine.models import load_tokenizer

    cfg = load_config(UpConfig, overrides=["up.port=0", f"up.run_dir={run_dir}", *overrides], env={})
    tokenizer, _ = load_tokenizer(cfg.up.model)
    with launched(cfg) as (_, url):
        got = asyncio.run(drive(url, cfg.up.model, tokenizer, size))
    rows = got.pop("rows")
    return {"params": {"quick": size == QUICK, "size": dataclasses.asdict(size),
                       "system": "moorage up (defaults: SmolLM2, pool on) with " + " ".join(["up.port=0", *overrides])},
            **got, "classes": summarize(rows, size),
            "errors": [r for r in rows if not r["ok"]], "rows": rows}


def report(result: dict) -> str:
    rows = [[name, v["n"], v["ttft_p50_s"], v["ttft_p90_s"], v.get("p50_vs_unloaded")]
            for name, v in result["classes"].items()]
    return (md_table(["class", "n", "TTFT p50 s", "TTFT p90 s", "p50 / unloaded"], rows)
            + f"\n\nlow class: {result['low_completed_per_s']} requests/s completed while overloaded "
              f"({result['overloaded_s']} s); errors: {len(result['errors'])}")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = result["classes"]
    names = list(classes)
    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(names))
    ax.bar(x - 0.2, [classes[n]["ttft_p50_s"] or 0 for n in names], 0.4, label="p50")
    ax.bar(x + 0.2, [classes[n]["ttft_p90_s"] or 0 for n in names], 0.4, label="p90")
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("TTFT (s)")
    ax.set_title("Priority under overload (moorage up, SmolLM2)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    return system_bench_main(argv, __doc__, "priority", run, QUICK, FULL, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
