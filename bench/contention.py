"""TTFT of a returning turn, alone and while another session computes a cold prompt, per schedule policy.

The scene a coding agent lives in: session A comes back after a tool call with ~3.4K tokens of history
(on prefill's device) and ~150 new tokens; session B has just sent a cold 4K prompt. The goal (issue 8):
A's TTFT next to B is at most 2x its TTFT alone. Each policy gets its own `moorage up` (default config,
the real model, `prefill.engine.schedule=<policy>`); the client is the openai package, streaming chat.

    python -m bench.contention --out bench/results/contention.json      # fcfs and srpf, 3 rounds each
    python -m bench.contention --quick                                   # 1 round, smaller prompts

Per policy it reports A's TTFT alone and contended (median over rounds), their ratio, B's TTFT (what the
cold prompt pays for A's priority), and the usage breakdown proving A was >= 90% cached.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench._util import machine_info, md_table, write_result
from shared.config import load_config
from shared.engine.models import load_tokenizer
from infra.up import Launcher, UpConfig

MODEL = "smollm2-135m"
WORDS = ("def return self value index buffer request session token cache block chunk prefill decode store "
         "handoff import class async await yield lambda error retry timeout config queue worker stream file "
         "path read write open close parse test assert result status batch layer head tensor").split()


def log(msg: str) -> None:
    print(f"[contention {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def text_of(tokenizer, n_tokens: int, seed: int) -> str:
    """Seeded code-like prose of about n_tokens tokens (checked with the model's tokenizer)."""
    rng = random.Random(seed)
    words: list[str] = []
    while True:
        words += [rng.choice(WORDS) + ("()" if rng.random() < 0.1 else "") for _ in range(64)]
        text = " ".join(words)
        if len(tokenizer.encode(text)) >= n_tokens:
            return text


class Client:
    """The openai package against the router; one streamed chat completion = one measurement."""

    def __init__(self, base_url: str):
        import openai

        self.c = openai.OpenAI(api_key="none", base_url=base_url + "/v1", max_retries=0, timeout=1800)

    def turn(self, session: str, messages: list[dict], max_tokens: int) -> dict:
        t0 = time.perf_counter()
        ttft, usage = None, None
        stream = self.c.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_headers={"X-Session-ID": session})
        for chunk in stream:
            if ttft is None and chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
                ttft = time.perf_counter() - t0
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
        return {"ttft_ms": (ttft or 0) * 1e3, "total_ms": (time.perf_counter() - t0) * 1e3, "usage": usage}


def cached_share(r: dict) -> float:
    u = r["usage"]
    return (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) / u["prompt_tokens"]


def run_policy(policy: str, p: dict, tok) -> dict:
    tmp = tempfile.TemporaryDirectory(prefix=f"bench-contention-{policy}-")
    launcher = Launcher(load_config(UpConfig, overrides=[
        f"up.model={MODEL}", "up.port=0", f"up.run_dir={tmp.name}", "up.ready_timeout_s=600",
        "router.router.request_timeout_s=3600", f"prefill.engine.schedule={policy}"]))
    system = "A coding agent. Answer briefly."
    history = text_of(tok, p["history"], seed=1)
    out = {"policy": policy, "alone": [], "contended": [], "cold": []}
    try:
        base = launcher.start()
        launcher.wait_ready(base)
        client = Client(base)
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": history}]
        client.turn("A", msgs, 4)  # A's history goes onto the prefill's device (and into the pool)
        client.turn("warm", [{"role": "user", "content": "hello"}], 2)
        for r in range(p["rounds"]):
            new = text_of(tok, p["new"], seed=100 + r)
            turn = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": new}]
            out["alone"].append(client.turn("A", turn, p["max_tokens"]))
            new = text_of(tok, p["new"], seed=200 + r)
            turn = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": new}]
            cold_msgs = [{"role": "user", "content": text_of(tok, p["cold"], seed=300 + r)}]
            cold: dict = {}
            b = threading.Thread(target=lambda: cold.update(client.turn(f"B{r}", cold_msgs, p["max_tokens"])))
            b.start()
            time.sleep(p["lead_s"])  # B's prompt is being computed when A returns
            out["contended"].append(client.turn("A", turn, p["max_tokens"]))
            b.join()
            out["cold"].append(cold)
            log(f"{policy} round {r}: A alone {out['alone'][-1]['ttft_ms']:.0f} ms, next to a cold prompt "
                f"{out['contended'][-1]['ttft_ms']:.0f} ms; cold B {cold['ttft_ms']:.0f} ms")
    finally:
        launcher.stop()
        tmp.cleanup()
    med = {k: statistics.median(x["ttft_ms"] for x in out[k]) for k in ("alone", "contended", "cold")}
    out["median_ttft_ms"] = med
    out["ratio_contended_vs_alone"] = med["contended"] / med["alone"]
    out["min_cached_share_A"] = min(cached_share(x) for x in out["alone"] + out["contended"])
    return out


def report(res: dict) -> str:
    rows = [[x["policy"], f"{x['median_ttft_ms']['alone']:.0f}", f"{x['median_ttft_ms']['contended']:.0f}",
             f"{x['ratio_contended_vs_alone']:.2f}x", f"{x['min_cached_share_A']:.1%}",
             f"{x['median_ttft_ms']['cold']:.0f}"] for x in res["policies"]]
    return md_table(["schedule", "A alone TTFT ms", "A next to cold TTFT ms", "ratio", "A cached (min)",
                     "cold B TTFT ms"], rows)


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    pols = [x["policy"] for x in res["policies"]]
    w = 0.27
    for i, (key, label) in enumerate((("alone", "A alone"), ("contended", "A next to a cold prompt"),
                                      ("cold", "cold prompt B"))):
        vals = [x["median_ttft_ms"][key] / 1e3 for x in res["policies"]]
        ax.bar([j + (i - 1) * w for j in range(len(pols))], vals, w, label=label)
    for j, x in enumerate(res["policies"]):
        ax.annotate(f"{x['ratio_contended_vs_alone']:.1f}x", (j, x["median_ttft_ms"]["contended"] / 1e3),
                    ha="center", va="bottom")
    ax.set_xticks(range(len(pols)), pols)
    ax.set_ylabel("TTFT (s, median)")
    ax.set_title(f"returning turn ({res['params']['history']}+{res['params']['new']} tok) vs cold "
                 f"{res['params']['cold']}-tok prompt, {MODEL}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.contention", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/contention.json", help="JSON result (+ .png beside it)")
    ap.add_argument("--policies", default="fcfs,srpf")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    p = (dict(history=1600, new=150, cold=2048, rounds=1, max_tokens=4, lead_s=1.0) if args.quick else
         dict(history=3400, new=150, cold=4096, rounds=3, max_tokens=4, lead_s=1.5))
    t0 = time.perf_counter()
    tok = load_tokenizer(MODEL)[0]
    res = {"params": {**p, "quick": args.quick}, "machine": machine_info(),
           "policies": [run_policy(pol, p, tok) for pol in args.policies.split(",")]}
    write_result(res, args.out, t0, plot, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
