"""Prefetch on resume (issue 29): a session that paused for a tool, whose history other work pushed out of the
prefill's device cache meanwhile, returns to find it there again; prefetch off against on, one run.

    python -m bench.prefetch [--quick] [--out bench/results/prefetch.json]

Two systems, one after the other: `moorage up` with the tiny model, the pool on, a prefill device cache of
`device_blocks` blocks, and `prefill.pool.prefetch` false or true. Against each, the same seeded script:
1. Warm-up: `warmup` sessions each call a tool, pause `pause_s` and return, in parallel, so that the router has
   seen enough tool pauses to say when a paused session is expected back (the median, `expect_in_s`).
2. `sessions` times, one after the other: a session's first turn (`history_tokens` of system prompt, a tool
   call); `fillers` one-turn conversations of other work at once (they take the device cache); the session
   returns `pause_s` after its call with the tool's result (one token asked: the request's time is its TTFT).
Reported per mode: the returning turns' latency (p50, mean), their cached tokens, and prefill's prefetch
counters (run, chunks, used, wasted) and pool restores. With prefetch on, the history is restored from the
pool halfway through the pause and the returning turn finds it on the device; with it off, the returning
turn restores it from the pool itself before computing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np

from bench._util import LoadWatcher, md_table, system_bench_main
from bench.retention import TOOL, system_text


@dataclass(frozen=True)
class Size:
    sessions: int = 12
    warmup: int = 8
    fillers: int = 4
    history_tokens: int = 3000   # tiny: one token per byte; with the tool's schema ~3.6K tokens, 14 chunks
    pause_s: float = 4.0
    device_blocks: int = 640     # 10K tokens: one session's history and the fillers do not fit together


QUICK = Size(sessions=4)
FULL = Size()


def _body(messages: list[dict], max_tokens: int, tools: str = "") -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if tools:
        body.update(tools=[TOOL], tool_choice=tools, parallel_tool_calls=False)
    return body


def _session(http: httpx.Client, sid: str, seed: int, size: Size, fillers=None) -> dict:
    """A first turn that calls the tool, the pause (with `fillers` run at its start), the return."""
    msgs = [{"role": "system", "content": system_text(seed, size.history_tokens)},
            {"role": "user", "content": f"task {seed}"}]
    headers = {"X-Session-ID": sid}
    r = http.post("/v1/chat/completions", json=_body(msgs, 128, "required"), headers=headers)
    r.raise_for_status()
    called = time.monotonic()
    message = r.json()["choices"][0]["message"]
    if fillers is not None:
        fillers()
    time.sleep(max(0.0, called + size.pause_s - time.monotonic()))
    back = msgs + [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "done"}]
    t0 = time.perf_counter()
    r = http.post("/v1/chat/completions", json=_body(back, 1, "auto"), headers=headers)  # agents resend the tools
    r.raise_for_status()
    usage = r.json()["usage"]
    return {"session": sid, "latency_ms": round((time.perf_counter() - t0) * 1e3, 1),
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def drive(url: str, size: Size) -> list[dict]:
    with httpx.Client(base_url=url, timeout=120) as http:
        threads = [threading.Thread(target=_session, args=(http, f"warm{i}", 500 + i, size)) for i in range(size.warmup)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        def fillers(i: int):
            def run():
                for j in range(size.fillers):
                    msgs = [{"role": "system", "content": system_text(2000 + 10 * i + j, size.history_tokens)},
                            {"role": "user", "content": "filler"}]
                    http.post("/v1/chat/completions", json=_body(msgs, 1)).raise_for_status()
            return run

        return [_session(http, f"s{i}", i, size, fillers(i)) for i in range(size.sessions)]


def run_mode(size: Size, prefetch: bool, run_dir: str, overrides: list[str]) -> dict:
    from infra.up import UpConfig, launched
    from shared.config import load_config

    sets = ["up.model=tiny", "up.port=0", "up.stores=1", f"up.run_dir={run_dir}",
            f"prefill.engine.num_blocks={size.device_blocks}", "decode.engine.num_blocks=2048",
            "decode.transfer.decode_reuse=false", f"prefill.pool.prefetch={str(prefetch).lower()}", *overrides]
    cfg = load_config(UpConfig, overrides=sets, env={})
    with launched(cfg) as (launcher, url):
        watcher = LoadWatcher(launcher.nats.url, "bench-prefetch")
        try:
            t0 = time.perf_counter()
            rows = drive(url, size)
            wall = time.perf_counter() - t0
            time.sleep(1.5)  # one more load report
            reports = {r.role: r.detail for _, r in watcher.latest.values()}
        finally:
            watcher.close()
    return {"prefetch": prefetch, "overrides": sets, "wall_s": round(wall, 2), "rows": rows,
            "prefill_pool": reports.get("prefill", {}).get("pool"), "router_sessions": reports.get("router", {}).get("sessions")}


def summarize(mode: dict) -> dict:
    lat = [r["latency_ms"] for r in mode["rows"]]
    pool = mode.get("prefill_pool") or {}
    return {"prefetch": mode["prefetch"], "returning_turns": len(lat),
            "latency_p50_ms": round(float(np.percentile(lat, 50)), 1), "latency_mean_ms": round(float(np.mean(lat)), 1),
            "history_cached": round(sum(r["cached_tokens"] for r in mode["rows"])
                                    / max(1, sum(r["prompt_tokens"] for r in mode["rows"])), 4),
            **{k: pool.get(k, 0) for k in ("prefetches", "prefetched_chunks", "prefetch_used", "prefetch_wasted",
                                           "restored_chunks")}}


def run(size: Size, run_dir: str, overrides: list[str] = ()) -> dict:
    modes = [run_mode(size, p, f"{run_dir}/{'on' if p else 'off'}", list(overrides)) for p in (False, True)]
    summary = [summarize(m) for m in modes]
    off, on = summary
    return {"params": {"size": size.__dict__, "quick": size.sessions < FULL.sessions}, "modes": modes,
            "summary": summary, "latency_p50_ratio_off_over_on": round(off["latency_p50_ms"] / on["latency_p50_ms"], 3)}


def report(result: dict) -> str:
    keys = ["prefetch", "returning_turns", "latency_p50_ms", "latency_mean_ms", "history_cached", "prefetches",
            "prefetched_chunks", "prefetch_used", "prefetch_wasted", "restored_chunks"]
    return (md_table(keys, [[s[k] for k in keys] for s in result["summary"]])
            + f"\n\nreturning-turn latency p50, off / on: {result['latency_p50_ratio_off_over_on']}x")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in result["modes"]:
        ax.plot([r["latency_ms"] for r in m["rows"]], "o-", label=f"prefetch {'on' if m['prefetch'] else 'off'}")
    ax.set_xlabel("returning session")
    ax.set_ylabel("returning turn latency, 1 token (ms)")
    ax.set_title("history pushed out of the device during a tool pause")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    return system_bench_main(argv, __doc__, "prefetch", run, QUICK, FULL, plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
