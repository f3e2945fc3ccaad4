"""Decode keeps the session (issue 30): agent sessions of growing context, decode reuse on against off, one run.

    python -m bench.decode_reuse [--quick] [--out bench/results/decode-reuse.json]

Two systems, one after the other, each the default `moorage up` (SmolLM2, pool on; `--quick`: the tiny model)
but for `transfer.decode_reuse` on prefill and decode. Against each, `sessions` agent sessions take turns round
robin: the first prompt is `first_tokens` long, and every later turn is the whole history so far (the prompt,
the model's answer) plus `step_tokens` new tokens, until the context would pass `max_context`. One request at
a time, streamed, so every handoff is attributed to its turn (the prefill's load report totals, before and
after). Prompts are token ids (/v1/completions), seeded: both systems see the very same turns.

Reported per mode, over the returning turns (every turn but a session's first):
- handoff bytes per turn, and their ratio to the KV of the tokens decode lacked plus one block (goal: <= 1.1);
- decode's hit share (prompt tokens decode already held);
- TTFT p50/p90 (prefill streams the first token itself, before the handoff), and the time to the second
  token, the first one decode produces: it waits for the handoff (p50/p90, and at the longest contexts), and
  the gap between the two (handoff, adoption and decode's first step);
- ITL p50/p99 of decode's later tokens (goal: on within 1.1x of off), and output tokens per second of request
  time (first byte sent to last token, one request at a time: the waits for load reports are left out);
- whether every answer is the same in both modes (greedy: it must be).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

import numpy as np
import torch

from bench._util import LoadWatcher, md_table, system_bench_main


@dataclass(frozen=True)
class Size:
    model: str = "smollm2-135m"
    sessions: int = 2
    first_tokens: int = 2048
    step_tokens: int = 480        # an agent turn: a tool result and a few lines; SmolLM2 contexts 2K -> 8K in 12 turns
    max_context: int = 8192
    max_tokens: int = 32
    vocab: int = 32000            # prompt token ids are drawn below this


QUICK = Size(model="tiny", first_tokens=512, step_tokens=384, max_context=2048, max_tokens=16, vocab=256)
FULL = Size()


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def stream(http, model: str, prompt: list[int], max_tokens: int, session: str) -> dict:
    """One streamed greedy completion: the time of each content event (ms from the request), the text, usage."""
    t0, times, usage = time.perf_counter(), [], None
    with http.stream("POST", "/v1/completions", headers={"X-Session-ID": session}, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        text = []
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            usage = obj.get("usage") or usage
            for c in obj.get("choices") or []:
                if c.get("text"):
                    times.append((time.perf_counter() - t0) * 1e3)
                    text.append(c["text"])
    return {"times_ms": times, "text": "".join(text), "usage": usage}


def drive(url: str, watcher: LoadWatcher, size: Size) -> list[dict]:
    import httpx

    from shared.engine.models import load_tokenizer

    tokenizer, _ = load_tokenizer(size.model)
    rows: list[dict] = []
    history = {s: _ids(1000 + s, size.first_tokens, size.vocab) for s in range(size.sessions)}
    prefill = next(i for i, (_, r) in watcher.latest.items() if r.role == "prefill")
    with httpx.Client(base_url=url, timeout=900) as http:
        turn = 0
        while history:
            for s in list(history):
                prompt = history[s]
                before = watcher.latest[prefill][1].detail
                t = time.monotonic()
                got = stream(http, size.model, prompt, size.max_tokens, f"reuse-{s}")
                after = _after(watcher, prefill, t, before["handoffs_done"] + 1)
                out = tokenizer.encode(got["text"])  # the answer, as the next turn's history holds it
                rows.append({"session": s, "turn": turn, "prompt_tokens": len(prompt), "times_ms": got["times_ms"],
                             "output_tokens": got["usage"]["completion_tokens"], "text": got["text"],
                             "handoff_bytes": after["handoff_bytes"] - before["handoff_bytes"],
                             "reused_blocks": after["handoff_reused_blocks"] - before["handoff_reused_blocks"],
                             "block_size": after["block_size"]})
                nxt = prompt + out + _ids(7919 * (turn + 1) + s, size.step_tokens, size.vocab)
                if len(nxt) + size.max_tokens > size.max_context or not out:
                    del history[s]
                else:
                    history[s] = nxt
            turn += 1
    return rows


def _after(watcher: LoadWatcher, prefill: str, since: float, done: int, timeout: float = 60.0) -> dict:
    """The prefill's load report detail once it counts `done` handoffs (reported after `since`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        t, r = watcher.latest[prefill]
        if t > since and r.detail["handoffs_done"] >= done:
            return r.detail
        time.sleep(0.05)
    raise TimeoutError("the prefill did not report the handoff")


def run_mode(size: Size, reuse: bool, run_dir: str, overrides: list[str]) -> dict:
    from infra.up import UpConfig, launched
    from shared.config import load_config

    flag = "true" if reuse else "false"
    sets = [f"up.model={size.model}", "up.port=0", f"up.run_dir={run_dir}", f"prefill.transfer.decode_reuse={flag}",
            f"decode.transfer.decode_reuse={flag}", *overrides]
    cfg = load_config(UpConfig, overrides=sets, env={})
    with launched(cfg) as (launcher, url):
        watcher = LoadWatcher(launcher.nats.url, "bench-decode-reuse")
        try:
            deadline = time.monotonic() + 30
            while not any(r.role == "prefill" for _, r in watcher.latest.values()) and time.monotonic() < deadline:
                time.sleep(0.1)
            t0 = time.perf_counter()
            rows = drive(url, watcher, size)
            wall = time.perf_counter() - t0
        finally:
            watcher.close()
    return {"mode": "on" if reuse else "off", "overrides": sets, "wall_s": round(wall, 2), "rows": rows}


def _p(xs, q):
    return round(float(np.percentile(xs, q)), 2) if len(xs) else None


def summarize(mode: dict, block_bytes: int) -> dict:
    back = [r for r in mode["rows"] if r["turn"] > 0]
    bs = back[0]["block_size"] if back else 16
    token_bytes = block_bytes / bs
    lacked = [(r["prompt_tokens"] - r["reused_blocks"] * bs) * token_bytes + block_bytes for r in back]
    ttft = [r["times_ms"][0] for r in back if r["times_ms"]]
    t2t = [r["times_ms"][1] for r in back if len(r["times_ms"]) > 1]
    gap = [r["times_ms"][1] - r["times_ms"][0] for r in back if len(r["times_ms"]) > 1]
    longest = max((r["prompt_tokens"] for r in back), default=0)
    t2t_long = [r["times_ms"][1] for r in back if len(r["times_ms"]) > 1 and r["prompt_tokens"] > 0.75 * longest]
    itl = [b - a for r in back for a, b in zip(r["times_ms"][1:], r["times_ms"][2:])]
    out_tokens = sum(r["output_tokens"] for r in mode["rows"])
    busy_s = sum(r["times_ms"][-1] for r in mode["rows"] if r["times_ms"]) / 1e3  # requests one at a time
    return {"returning_turns": len(back),
            "handoff_mb_per_turn": round(float(np.mean([r["handoff_bytes"] for r in back])) / 1e6, 2) if back else None,
            "bytes_over_lacked_kv_plus_block": round(max(r["handoff_bytes"] / x for r, x in zip(back, lacked)), 3)
            if back else None,
            "decode_hit_share": round(sum(r["reused_blocks"] * bs for r in back) / max(1, sum(r["prompt_tokens"] for r in back)), 3),
            "ttft_p50_ms": _p(ttft, 50), "ttft_p90_ms": _p(ttft, 90),
            "second_token_p50_ms": _p(t2t, 50), "second_token_p90_ms": _p(t2t, 90),
            "second_token_p50_ms_longest": _p(t2t_long, 50), "longest_context": longest,
            "handoff_gap_p50_ms": _p(gap, 50), "handoff_gap_p90_ms": _p(gap, 90),
            "itl_p50_ms": _p(itl, 50), "itl_p99_ms": _p(itl, 99),
            "output_tokens_per_s": round(out_tokens / busy_s, 2) if busy_s else None}


def run(size: Size, run_dir: str, overrides: list[str] = ()) -> dict:
    modes = [run_mode(size, reuse, f"{run_dir}/{'on' if reuse else 'off'}", list(overrides)) for reuse in (False, True)]
    first_off = next(r for r in modes[0]["rows"] if r["turn"] == 0)
    block_bytes = first_off["handoff_bytes"] // -(-first_off["prompt_tokens"] // first_off["block_size"])
    summary = {m["mode"]: summarize(m, block_bytes) for m in modes}
    off, on = summary["off"], summary["on"]
    ratios = {k: round(off[k] / on[k], 2) for k in ("handoff_mb_per_turn", "ttft_p50_ms", "second_token_p50_ms",
                                                    "second_token_p50_ms_longest", "handoff_gap_p50_ms",
                                                    "handoff_gap_p90_ms", "itl_p50_ms", "itl_p99_ms")
              if off.get(k) and on.get(k)}
    same = [a["text"] == b["text"] for a, b in zip(modes[0]["rows"], modes[1]["rows"])]
    return {"params": {"quick": size == QUICK, "size": dataclasses.asdict(size), "block_bytes": block_bytes},
            "summary": summary, "off_over_on": ratios, "answers_identical": all(same) and len(same) > 0,
            "turns": len(same), "modes": modes}


def report(result: dict) -> str:
    s = result["summary"]
    keys = [k for k in s["off"] if k != "longest_context"]
    rows = [[k, s["off"][k], s["on"][k], result["off_over_on"].get(k, "")] for k in keys]
    return (md_table(["returning turns", "reuse off", "reuse on", "off / on"], rows)
            + f"\n\nlongest context {s['on']['longest_context']} tokens; {result['turns']} turns, answers identical "
              f"in both modes: {result['answers_identical']}")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for m in result["modes"]:
        back = [r for r in m["rows"] if r["turn"] > 0 and len(r["times_ms"]) > 1]
        a.scatter([r["prompt_tokens"] for r in back], [r["handoff_bytes"] / 1e6 for r in back], label=f"reuse {m['mode']}")
        b.scatter([r["prompt_tokens"] for r in back], [r["times_ms"][1] for r in back], label=f"reuse {m['mode']}")
    a.set(xlabel="context (tokens)", ylabel="handoff MB per turn", title="Handoff bytes, returning turns")
    b.set(xlabel="context (tokens)", ylabel="time to second token (ms)", title="Second token (first from decode)")
    a.legend(), b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    return system_bench_main(argv, __doc__, "decode-reuse", run, QUICK, FULL, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
