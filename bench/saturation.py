"""Busy is not dead (issue 33): the default `moorage up` (SmolLM2) on a host whose every core is busy with
other work, driven by agent-like sessions through the openai SDK.

    python -m bench.saturation [--quick] [--out bench/results/saturation.json]

One CPU hog per core (plain busy loops in processes of their own, each ending itself after the run's
length, killed at the end in any case) runs from before the first request to after the last. Ten sessions
each send a ~3K-token prompt at once, streaming 48 tokens, then come back with the answer and a short tool
result, as an agent does: `--quick` (what tests/test_saturation.py runs) two turns each; the full size
keeps them turning until the hogs have run 4 minutes.

Measured: every request's outcome, TTFT and cached tokens; each instance's load-report gaps as a peer on
the bus sees them (p50, p99, max) and the event-loop lateness each report carries (`loop_lag_ms`);
"instance lost" lines in the router's log; exits announced on the bus; whether every process kept its
pid. Writes JSON and a plot of the gaps (bars: p50/p99/max per instance; the line: the stall backstop).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench._util import machine_info, md_table, write_result

RETRY_PAUSE_S = 2.0  # a session whose request failed waits this long before its next turn
WORDS = ("def return class import self value error test build compile python module function agent tool "
         "result path file line assert config request response token cache session history patch diff").split()


@dataclass(frozen=True)
class Size:
    sessions: int = 10
    prompt_tokens: int = 3000      # each session's first prompt (the chat template adds a few)
    max_tokens: int = 48
    turns: int = 2                 # at least this many turns per session
    saturate_s: float = 0.0        # and more turns until the hogs have run this long (0: just the turns)
    tool_result_words: int = 60    # what a returning turn adds besides the answer


QUICK = Size()
FULL = Size(saturate_s=240.0)


@contextlib.contextmanager
def cpu_hogs(n: int, limit_s: float) -> Iterator[list[subprocess.Popen]]:
    """`n` busy loops in processes of their own; each stops by itself after `limit_s`, and all are killed
    when the block ends."""
    code = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", code, str(limit_s)]) for _ in range(n)]
    try:
        yield hogs
    finally:
        for h in hogs:
            h.kill()
            h.wait()


class BusRecorder:
    """Every load report and exit announcement a peer hears, with its arrival time, from a bus client on a
    thread of its own (the clients' own event loop does not delay it)."""

    def __init__(self, nats_url: str):
        from shared.bus import Bus, BusConfig
        from shared.messages import InstanceExited, LoadReport

        self.arrivals: dict[str, list[float]] = {}   # "role/instance" -> monotonic arrival times
        self.lags: dict[str, list[float]] = {}       # "role/instance" -> loop_lag_ms of each report
        self.exits: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bus-recorder", daemon=True)
        self.thread.start()

        async def on_load(msg: LoadReport, raw) -> None:
            key = f"{msg.role}/{msg.instance}"
            self.arrivals.setdefault(key, []).append(time.monotonic())
            lag = msg.detail.get("loop_lag_ms") if isinstance(msg.detail, dict) else None
            if isinstance(lag, (int, float)):
                self.lags.setdefault(key, []).append(float(lag))

        async def on_exit(msg: InstanceExited, raw) -> None:
            self.exits.append(msg.to_dict())

        async def connect():
            bus = await Bus.connect(BusConfig(url=nats_url), "bench-saturation")
            await bus.subscribe(bus.subjects.load_all, LoadReport, on_load)
            await bus.subscribe(bus.subjects.exited_all, InstanceExited, on_exit)
            return bus

        self.bus = asyncio.run_coroutine_threadsafe(connect(), self.loop).result(30)

    def gaps(self, since: float, until: float) -> dict[str, dict]:
        out = {}
        for key, times in sorted(self.arrivals.items()):
            t = np.array([x for x in times if since <= x <= until])
            if len(t) < 2:
                continue
            g = np.diff(t)
            p50, p99 = np.percentile(g, [50, 99])
            lags = self.lags.get(key, [0.0])
            out[key] = {"reports": len(t), "gap_p50_s": round(float(p50), 3), "gap_p99_s": round(float(p99), 3),
                        "gap_max_s": round(float(g.max()), 3), "loop_lag_max_ms": round(max(lags), 1)}
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.bus.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def first_prompt(tokenizer, session: int, tokens: int) -> str:
    """Words drawn per session until the user message is `tokens` long under the model's tokenizer."""
    rng, words = random.Random(session), []
    while len(tokenizer.encode(" ".join(words))) < tokens:
        words += [rng.choice(WORDS) for _ in range(200)]
    return f"session {session}: " + " ".join(words)


async def run_session(client, model: str, session: int, prompt: str, size: Size, until: float) -> list[dict]:
    """Turns of one agent session: each sends the whole history, streams the answer, then adds it and a
    tool result for the next turn."""
    rng = random.Random(1000 + session)
    messages = [{"role": "system", "content": "You are a coding agent. Use tools, then answer."},
                {"role": "user", "content": prompt}]
    results, turn = [], 0
    while turn < size.turns or time.monotonic() < until:
        t0, first, text, row = time.monotonic(), None, "", {"session": session, "turn": turn}
        try:
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=size.max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_headers={"X-Session-ID": f"sat-{session}"})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.monotonic()
                    text += chunk.choices[0].delta.content
                if chunk.usage:
                    row["prompt_tokens"] = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    row["cached_tokens"] = details.cached_tokens if details else 0
            row.update(ok=True, ttft_s=round((first or time.monotonic()) - t0, 3))
        except Exception as e:  # the outcome is the measurement: a failed request is counted, not raised
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            await asyncio.sleep(RETRY_PAUSE_S)  # as a client backs off before its next turn
        row["total_s"] = round(time.monotonic() - t0, 3)
        results.append(row)
        tool = " ".join(rng.choice(WORDS) for _ in range(size.tool_result_words))
        messages += [{"role": "assistant", "content": text or "(no answer)"},
                     {"role": "user", "content": f"tool result: {tool}"}]
        turn += 1
    return results


async def drive(base_url: str, model: str, prompts: list[str], size: Size, until: float) -> list[dict]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", timeout=1800, max_retries=0)
    try:
        rows = await asyncio.gather(*(run_session(client, model, i, p, size, until) for i, p in enumerate(prompts)))
    finally:
        await client.close()
    return [r for session in rows for r in session]


def log_sizes(run_dir: Path) -> dict[Path, int]:
    """Where each router log ends now (logs are appended to across runs in one run directory)."""
    return {log: log.stat().st_size for log in run_dir.glob("router-*.log")}


def instance_lost_lines(run_dir: Path, since: dict[Path, int]) -> int:
    """"instance lost" lines the routers logged after `since` (log_sizes)."""
    count = 0
    for log in run_dir.glob("router-*.log"):
        with open(log, "rb") as f:
            f.seek(since.get(log, 0))
            count += f.read().decode(errors="replace").count('"event": "instance lost"')
    return count


def run(size: Size, run_dir: str, overrides: list[str] = ()) -> dict:
    """The measurement, against a system started here: `moorage up` with its defaults, but for the port,
    the run directory and `overrides`."""
    from infra.up import UpConfig, launched
    from shared.config import load_config
    from shared.engine.models import load_tokenizer

    cfg = load_config(UpConfig, overrides=["up.port=0", f"up.run_dir={run_dir}", *overrides], env={})
    tokenizer, _ = load_tokenizer(cfg.up.model)
    prompts = [first_prompt(tokenizer, i, size.prompt_tokens) for i in range(size.sessions)]
    t0 = time.monotonic()
    with launched(cfg) as (launcher, url):
        startup_s = time.monotonic() - t0
        pids, logs = launcher.supervisor.pids(), log_sizes(launcher.run_dir)
        recorder = BusRecorder(launcher.nats.url)
        cores = os.cpu_count() or 1
        try:
            # hogs end themselves after the longest this run may take; the block kills them sooner
            with cpu_hogs(cores, max(size.saturate_s, 0) + 3600):
                time.sleep(2.0)  # the hogs own the cores before the first request
                start = time.monotonic()
                rows = asyncio.run(drive(url, cfg.up.model, prompts, size, start + size.saturate_s))
                end = time.monotonic()
            gaps = recorder.gaps(start, end)
        finally:
            recorder.close()
        alive = {n: launcher.supervisor.pids().get(n) == pid for n, pid in pids.items()}
        restarts = launcher.restarts()
        lost = instance_lost_lines(launcher.run_dir, logs)
    ok = [r for r in rows if r["ok"]]
    ttft = {turn: [r["ttft_s"] for r in ok if r["turn"] == turn] for turn in sorted({r["turn"] for r in ok})}
    return {
        "params": {"quick": size == QUICK, "size": dataclasses.asdict(size), "hogs": cores,
                   "system": "moorage up (defaults: SmolLM2, pool on) with " + " ".join(["up.port=0", *overrides]),
                   "liveness_timeout_s": cfg.router.router.liveness_timeout_s},
        "startup_s": round(startup_s, 1),
        "saturated_s": round(end - start, 1),
        "requests": len(rows), "succeeded": len(ok),
        "failed": [r for r in rows if not r["ok"]],
        "instance_lost": lost,
        "exits_announced": recorder.exits,
        "all_alive": all(alive.values()), "restarts": restarts,
        "gaps": gaps,
        "ttft_p50_s_by_turn": {str(t): round(float(np.percentile(v, 50)), 2) for t, v in ttft.items() if v},
        "cached_tokens_turn2_plus": sum(r.get("cached_tokens", 0) for r in ok if r["turn"] > 0),
        "rows": rows,
    }


def report(result: dict) -> str:
    gaps = result["gaps"]
    head = (f"## moorage under saturation ({'quick' if result['params']['quick'] else 'full'}): "
            f"{result['params']['hogs']} CPU hogs, {result['params']['size']['sessions']} sessions, "
            f"{result['saturated_s']:.0f} s saturated\n"
            f"requests {result['succeeded']}/{result['requests']} succeeded; 'instance lost' {result['instance_lost']}; "
            f"exits announced {len(result['exits_announced'])}; every process alive: {result['all_alive']}; "
            f"TTFT p50 by turn {result['ttft_p50_s_by_turn']}\n")
    return head + md_table(["instance", "reports", "gap p50 (s)", "gap p99 (s)", "gap max (s)", "loop lag max (ms)"],
                           [[k, v["reports"], v["gap_p50_s"], v["gap_p99_s"], v["gap_max_s"], v["loop_lag_max_ms"]]
                            for k, v in gaps.items()])


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gaps = result["gaps"]
    names = list(gaps)
    fig, ax = plt.subplots(figsize=(11, 5))
    x, w = np.arange(len(names)), 0.27
    for i, (key, label) in enumerate((("gap_p50_s", "p50"), ("gap_p99_s", "p99"), ("gap_max_s", "max"))):
        bars = ax.bar(x + (i - 1) * w, [gaps[n][key] for n in names], w, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(result["params"]["liveness_timeout_s"], color="red", ls="--", lw=1,
               label=f"stall backstop (router.liveness_timeout_s = {result['params']['liveness_timeout_s']:g} s)")
    ax.set_yscale("log")
    ax.set_xticks(x, names, fontsize=8, rotation=20)
    ax.set_ylabel("seconds between load reports, as a peer hears them (log)")
    ax.set_title(f"Load-report gaps under {result['params']['hogs']} CPU hogs: {result['succeeded']}/"
                 f"{result['requests']} requests ok, {result['instance_lost']} 'instance lost'")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="two turns per session (tests/test_saturation.py)")
    p.add_argument("--out", default=f"runs/saturation-{time.strftime('%Y%m%d-%H%M%S')}/saturation.json")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a `moorage up` override")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    out = Path(args.out)
    result = {"machine": machine_info(),
              **run(QUICK if args.quick else FULL, str(out.parent / "run"), args.set)}
    write_result(result, out, t_start, plot, report)
    return 0 if result["succeeded"] == result["requests"] and not result["instance_lost"] else 1


if __name__ == "__main__":
    sys.exit(main())
