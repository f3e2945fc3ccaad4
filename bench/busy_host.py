"""A host busy with other work: agent sessions on the default `moorage up` while other processes keep every
core busy, with the KV page warmer on (the default) and off, in one run.

    python -m bench.busy_host [--quick] [--out bench/results/busy-host.json]

Each cell starts the system (`moorage up`, SmolLM2, pool on), then `hogs` processes that spin (none when
the host is idle), then `sessions` agent sessions at once with the openai SDK, streamed: a turn that must
call a tool, the tool's pause, and the turn that reads its result. Every prompt is the session's own (no
shared prefix flatters a cell). Cells: {idle, busy} x {warmer on, `engine.kv_warm_ahead=0`}, interleaved
over `repeats` rounds so drift hits every cell alike.

Reported per cell: when the last first turn ended (all sessions' prefill and decode), TTFT p50/p90 per turn,
the whole run, the required calls the model ran on past max_tokens inside (an answer, not an error: that
session ends there) and every error; then busy / idle per system and warmer on / off per load.

Why: the warmer used to call madvise(MADV_POPULATE_WRITE) at nice 19. On a busy host the scheduler left it
off the CPU while it held the process's mmap lock, and the engine stalled behind it: 8 first turns took
111-115 s with two spinning processes beside `moorage up` on 2 cores, 32 s with the warmer off. It now
faults pages in by touch from a native thread, taking no lock the engine needs (kernels/csrc/page_warmer.c).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from bench._util import md_table, system_bench_main

WORDS = ("def return class import self value error test build compile python module function agent tool "
         "result path file line assert config request response token cache session history patch diff").split()
TOOL = {"type": "function", "function": {"name": "bash", "description": "Run a shell command in the repository",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}
WARMER_OFF = ["prefill.engine.kv_warm_ahead=0", "decode.engine.kv_warm_ahead=0"]


@dataclass(frozen=True)
class Size:
    sessions: int = 8
    prompt_words: int = 300        # ~500 tokens with the template and tool list
    max_tokens: int = 64            # a required call of ~30 tokens must fit whole (agents ask for thousands)
    pause_s: float = 1.0           # the tool's run
    hogs: int = 0                  # spinning processes when busy (0: one per core)
    repeats: int = 1
    loads: tuple[str, ...] = ("idle", "busy")
    warmer: tuple[str, ...] = ("on", "off")


QUICK = Size(sessions=3, loads=("busy",), warmer=("on",))
FULL = Size(repeats=2)


def system_prompt(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return f"Session {seed}. You are a coding agent. Notes: " + " ".join(rng.choice(WORDS) for _ in range(words))


async def turn(client, model: str, messages: list, session: str, max_tokens: int, required: bool) -> dict:
    t0, first, calls, text, usage = time.monotonic(), None, {}, "", None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, tools=[TOOL], tool_choice="required" if required else "auto",
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_headers={"X-Session-ID": session})
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                d = c.delta
                if first is None and (d.content or d.tool_calls):
                    first = time.monotonic()
                text += d.content or ""
                for tc in d.tool_calls or []:
                    e = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    e["id"] = tc.id or e["id"]
                    e["name"] += (tc.function and tc.function.name) or ""
                    e["arguments"] += (tc.function and tc.function.arguments) or ""
        end = time.monotonic()
        return {"ok": True, "t_start": t0, "t_end": end, "ttft_s": round((first or end) - t0, 3),
                "prompt_tokens": usage.prompt_tokens if usage else None, "text": text, "calls": list(calls.values())}
    except Exception as e:  # the outcome is the measurement
        return {"ok": False, "t_start": t0, "t_end": time.monotonic(), "error": f"{type(e).__name__}: {str(e)[:200]}"}


async def session(client, model: str, seed: int, size: Size) -> list[dict]:
    messages = [{"role": "system", "content": system_prompt(seed, size.prompt_words)},
                {"role": "user", "content": f"Make tests/test_{seed}.py pass."}]
    first = await turn(client, model, messages, f"busy-{seed}", size.max_tokens, required=True)
    rows = [{"session": seed, "turn": 1, **first}]
    if first["ok"] and first["calls"]:
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in first["calls"]]
        messages.append({"role": "assistant", "content": first["text"] or None, "tool_calls": calls})
        await asyncio.sleep(size.pause_s)
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": "1 failed: assert 1 == 2"} for c in calls]
        second = await turn(client, model, messages, f"busy-{seed}", size.max_tokens, required=False)
        rows.append({"session": seed, "turn": 2, **second})
    elif first["ok"]:  # the model ran on inside the call (a 135M model repeats "py.py.py..." in a string)
        rows[0]["cut"] = True  # an answer, at max_tokens: counted, not an error; the session ends here
    return rows


async def drive(url: str, model: str, size: Size, seed0: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=900, max_retries=0)
    try:
        t0 = time.monotonic()
        per = await asyncio.gather(*[session(client, model, seed0 + i, size) for i in range(size.sessions)])
        rows = [r for rs in per for r in rs]
        for r in rows:
            r["t_start"], r["t_end"] = round(r["t_start"] - t0, 3), round(r["t_end"] - t0, 3)
            r.pop("text", None)
        firsts = [r["t_end"] for r in rows if r["turn"] == 1]
        return {"rows": rows, "first_turns_done_s": round(max(firsts), 2), "wall_s": round(time.monotonic() - t0, 2)}
    finally:
        await client.close()


def cell(size: Size, run_dir: str, load: str, warmer: str, seed0: int, overrides: list[str]) -> dict:
    from infra.up import UpConfig, launched
    from shared.config import load_config

    sets = ["up.port=0", f"up.run_dir={run_dir}/{load}-{warmer}", *(WARMER_OFF if warmer == "off" else []),
            *overrides]
    cfg = load_config(UpConfig, overrides=sets, env={})
    n_hogs = (size.hogs or os.cpu_count() or 1) if load == "busy" else 0
    with launched(cfg) as (_, url):
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n_hogs)]
        try:
            got = asyncio.run(drive(url, cfg.up.model, size, seed0))
        finally:
            for h in hogs:
                h.kill()
                h.wait()
    rows = got.pop("rows")
    out = {"load": load, "warmer": warmer, "hogs": n_hogs, "overrides": sets, **got,
           "calls_cut_by_max_tokens": sum(bool(r.get("cut")) for r in rows),
           "errors": [r for r in rows if not r["ok"]], "rows": rows}
    for t in (1, 2):
        ttft = [r["ttft_s"] for r in rows if r["ok"] and r["turn"] == t]
        out[f"turn{t}_ttft_p50_s"] = round(float(np.percentile(ttft, 50)), 3) if ttft else None
        out[f"turn{t}_ttft_p90_s"] = round(float(np.percentile(ttft, 90)), 3) if ttft else None
    return out


def summarize(cells: list[dict]) -> dict:
    """Per (load, warmer): the median over repeats of first_turns_done_s, wall_s, turn TTFT p50s; and ratios."""
    out: dict = {}
    for c in cells:
        out.setdefault(f"{c['load']}, warmer {c['warmer']}", []).append(c)
    med = {k: {m: round(float(np.median([c[m] for c in cs if c[m] is not None])), 2)
               for m in ("first_turns_done_s", "wall_s", "turn1_ttft_p50_s", "turn2_ttft_p50_s")
               if any(c[m] is not None for c in cs)}
           | {"runs": len(cs), "errors": sum(len(c["errors"]) for c in cs),
              "calls_cut": sum(c["calls_cut_by_max_tokens"] for c in cs)}
           for k, cs in out.items()}
    ratios = {}
    for w in ("on", "off"):
        a, b = med.get(f"busy, warmer {w}"), med.get(f"idle, warmer {w}")
        if a and b:
            ratios[f"busy / idle, warmer {w}"] = round(a["first_turns_done_s"] / b["first_turns_done_s"], 2)
    for load in ("idle", "busy"):
        a, b = med.get(f"{load}, warmer on"), med.get(f"{load}, warmer off")
        if a and b:
            ratios[f"warmer on / off, {load}"] = round(a["first_turns_done_s"] / b["first_turns_done_s"], 2)
    return {"cells": med, "ratios": ratios}


def run(size: Size, run_dir: str, overrides: list[str] = ()) -> dict:
    cells = []
    for r in range(size.repeats):
        order = [(load, w) for load in size.loads for w in size.warmer]
        for i, (load, w) in enumerate(order if r % 2 == 0 else order[::-1]):
            cells.append(cell(size, run_dir, load, w, 1000 * (r * len(order) + i + 1), list(overrides)))
    return {"params": {"quick": size == QUICK, "size": dataclasses.asdict(size), "cpu_count": os.cpu_count()},
            **summarize(cells), "errors": [e for c in cells for e in c["errors"]], "runs": cells}


def report(result: dict) -> str:
    rows = [[k, v["runs"], v["first_turns_done_s"], v.get("turn1_ttft_p50_s"), v.get("turn2_ttft_p50_s"),
             v["wall_s"], v["calls_cut"], v["errors"]] for k, v in result["cells"].items()]
    table = md_table(["cell", "runs", "last first turn done s", "turn 1 TTFT p50 s", "turn 2 TTFT p50 s", "wall s",
                      "calls cut by max_tokens", "errors"], rows)
    return table + "\n\n" + "\n".join(f"- {k}: {v}x" for k, v in result["ratios"].items())


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    names = list(cells)
    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(names))
    ax.bar(x - 0.2, [cells[n]["first_turns_done_s"] for n in names], 0.4, label="last first turn done")
    ax.bar(x + 0.2, [cells[n].get("turn2_ttft_p50_s") or 0 for n in names], 0.4, label="turn 2 TTFT p50")
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("s")
    ax.set_title(f"{result['params']['size']['sessions']} agent sessions on moorage up, idle vs busy host")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    return system_bench_main(argv, __doc__, "busy-host", run, QUICK, FULL, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
