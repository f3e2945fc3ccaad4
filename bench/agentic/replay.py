"""`moorage bench agentic`: replay agentic coding sessions against the router, the way AgentX does.

N session lanes; each lane takes the next session from a queue and plays its main thread in order: wait
the recorded think time (x `think_time_scale`, capped at `think_time_cap_s`), then one streaming
`/v1/chat/completions` whose single user message is the session's full history so far (`prompt_text`:
turn k's text extends turn k-1's wherever their hash ids agree), `max_completion_tokens` = the recorded
output with `ignore_eos`. A subagent entry starts its requests as a concurrent thread (its own
`X-Correlation-ID`); every subagent started since the last main request is joined before the next one.
`X-Session-ID` is the session id on every request of the session.

Warm-up: a *turn* is one main-thread request plus the subagents recorded after it (before the next main
request); the first `warmup_turns` turns of every session are sent but left out of every statistic
(latency, throughput, token sources, ceiling): they are reported apart under `warmup`. Errors and
admission rejections (HTTP 429 and 503) are counted over all requests, warm-up included.

Token throughput counts every prompt token, cached or not, plus every generated token, of the measured
requests that succeeded, over the measured window (first measured send to last measured finish).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import secrets
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.agentic.plots import plot
from bench.agentic.stats import SOURCES, ceilings, summarize, summary_line
from bench.agentic.system import TOPOLOGY_HELP, add_system_args, running_system, system_overrides


# tool_turns' tool: its one argument is a digit, so a required call always completes
TOOL = {"type": "function", "function": {"name": "run", "description": "run step n", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}


@dataclass
class ReplayConfig:
    base_url: str = "http://127.0.0.1:8000"  # the router (with or without /v1)
    model: str = "tiny"
    concurrency: int = 4               # session lanes (subagents add in-flight requests on top, as recorded)
    duration_s: float = 0.0            # stop starting new turns after this; 0 = replay every session fully
    think_time_scale: float = 0.05     # recorded think time x this ...
    think_time_cap_s: float | None = 2.0  # ... capped at this (so a replay fits the machine); None = uncapped
    warmup_turns: int = 1              # per session, excluded from statistics
    request_timeout_s: float = 300.0
    api_key: str = ""
    tag: str | None = None             # run tag: prompts start with "[tag]" and session ids end with "~tag",
                                       # so a second replay against the same system cannot hit the first one's
                                       # cache or session affinity; None = random per replay, "" = none
    max_sessions: int = 0              # 0 = all
    start_stagger_s: float = 0.0       # lane k starts its first session k x this after the replay starts (a fleet
                                       # whose agents do not all send their first, cold prompt in one second)
    tool_turns: bool = False           # every request carries the tool list, as an agent's does (it renders
                                       # into the prompt: a list sent on some turns only would change every
                                       # later turn's prefix); a request the trace recorded as ending in a tool
                                       # call (stop "tool_use") is sent with tool_choice "required", so it ends
                                       # in a real call (finish_reason tool_calls) and the server learns the
                                       # session is expected back (retention, prefetch); the others with "none"

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.duration_s < 0 or self.think_time_scale < 0 or (self.think_time_cap_s or 0) < 0:
            raise ValueError("duration_s, think_time_scale and think_time_cap_s must not be negative")
        if self.warmup_turns < 0:
            raise ValueError(f"warmup_turns must not be negative, got {self.warmup_turns}")


@dataclass
class RequestRecord:
    session: str
    thread: str                    # "main" or the subagent's id
    index: int                     # position in its thread
    turn: int                      # the main-thread turn it belongs to
    warmup: bool
    t_start: float                 # s since the replay started (after the think time)
    t_end: float = 0.0
    think_s: float = 0.0           # what was waited before sending
    status: int | str = 0          # HTTP status; "stream_error:<code>" or "error:<Exception>" otherwise
    error: str = ""
    ttft_s: float | None = None    # send -> first non-empty content (or tool call) delta
    gaps_s: list[float] = field(default_factory=list)  # between successive content (or tool call) deltas
    prompt_tokens: int = 0         # from usage (0 without a usage chunk)
    completion_tokens: int = 0
    device: int = 0
    store: int = 0
    computed: int = 0
    trace_in_tokens: int = 0
    trace_out_tokens: int = 0
    ceiling_tokens: int = 0        # what the perfect cache reuses of this request (trace tokens)

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def e2e_s(self) -> float:
        return self.t_end - self.t_start

    @property
    def itl_s(self) -> float | None:
        return sum(self.gaps_s) / len(self.gaps_s) if self.gaps_s else None


MAIN = "main"


def is_subagent(item) -> bool:
    return hasattr(item, "requests") and not hasattr(item, "in_tokens")


def _walk_requests(items):
    for i in items:
        if is_subagent(i):
            yield from _walk_requests(i.requests)
        else:
            yield i


def count_requests(items) -> int:
    return sum(count_requests(i.requests) if is_subagent(i) else 1 for i in items)


def thread_names(session) -> dict[int, str]:
    """id(subagent entry) -> its thread name, as trace.iter_requests names them (document order, depth
    first; a repeated agent_id gets "#2", "#3", ...)."""
    used: dict[str, int] = {MAIN: 1}
    names: dict[int, str] = {}

    def walk(items):
        for item in items:
            if is_subagent(item):
                n = used.get(item.agent_id, 0) + 1
                used[item.agent_id] = n
                names[id(item)] = item.agent_id if n == 1 else f"{item.agent_id}#{n}"
                walk(item.requests)
    walk(session.requests)
    return names


def recorded_end(sub) -> float:
    """When a subagent ended in the recording (s from the session start): spawn + duration, or else the end
    of its last request."""
    if getattr(sub, "duration_ms", None) is not None:
        return float(sub.t) + sub.duration_ms / 1000.0
    ends = [float(r.t) + float(getattr(r, "api_time", 0.0) or 0.0) for r in _walk_requests(sub.requests)]
    return max(ends, default=float(sub.t))


def think_delay(recorded_s: float | None, cfg: ReplayConfig) -> float:
    """Recorded think time (s) x scale, capped (cap None: uncapped)."""
    delay = float(recorded_s or 0.0) * cfg.think_time_scale
    if cfg.think_time_cap_s is not None:
        delay = min(delay, cfg.think_time_cap_s)
    return max(0.0, delay)


class _Progress:
    def __init__(self, total: int, enabled: bool, duration_s: float):
        self.total, self.enabled, self.duration_s = total, enabled and total > 0, duration_s
        self.done = self.errors = 0
        self.t0 = time.monotonic()
        self._last = 0.0

    def tick(self, ok: bool, force: bool = False) -> None:
        self.done += 1
        self.errors += 0 if ok else 1
        self.draw(force)

    def draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < 0.2):
            return
        self._last = now
        width = 30
        fill = int(width * self.done / self.total) if self.total else width
        el = now - self.t0
        tail = f"/{self.duration_s:.0f}s" if self.duration_s else "s"
        sys.stderr.write(f"\ragentic [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} req  "
                         f"{self.errors} err  {el:.0f}{tail} ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self.draw(force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()


class _Run:
    def __init__(self, sessions: list, cfg: ReplayConfig, progress: bool):
        self.cfg = cfg
        self.sessions = list(sessions)
        self.queue = deque(self.sessions)
        self.records: list[RequestRecord] = []
        self.started_sessions: list = []
        self.tag = cfg.tag if cfg.tag is not None else secrets.token_hex(4)
        self.salt = f"[{self.tag}]\n" if self.tag else ""
        self.progress = _Progress(sum(count_requests(s.requests) for s in self.sessions), progress, cfg.duration_s)
        base = cfg.base_url.rstrip("/")
        self.url = base.removesuffix("/v1") + "/v1/chat/completions"
        self.t0 = 0.0
        self.client: httpx.AsyncClient | None = None

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def expired(self) -> bool:
        return self.cfg.duration_s > 0 and self.now() >= self.cfg.duration_s

    async def run(self) -> float:
        headers = {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}
        timeout = httpx.Timeout(self.cfg.request_timeout_s, connect=min(30.0, self.cfg.request_timeout_s))
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=4 * self.cfg.concurrency + 16)
        self.t0 = time.perf_counter()
        try:
            async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as self.client:
                await asyncio.gather(*(self.lane(k * self.cfg.start_stagger_s) for k in range(self.cfg.concurrency)))
        finally:
            self.progress.close()
        return self.now()

    async def lane(self, delay_s: float = 0.0) -> None:
        if delay_s:
            await asyncio.sleep(delay_s)
        while self.queue and not self.expired():
            session = self.queue.popleft()
            self.started_sessions.append(session)
            await self.thread(session, MAIN, session.requests, None, thread_names(session))

    async def thread(self, session, tid: str, items, parent_turn: int | None, names: dict[int, str]) -> None:
        """Play one thread: the main one (parent_turn None: each request is a turn) or a subagent's (all
        its requests belong to the main-thread turn that spawned it)."""
        pending: list[asyncio.Task] = []
        join_t = 0.0   # recorded time the pending subagents were joined
        sent = 0
        try:
            for item in items:
                if is_subagent(item):
                    turn = parent_turn if parent_turn is not None else max(sent - 1, 0)
                    pending.append(asyncio.create_task(
                        self.thread(session, names[id(item)], item.requests, turn, names)))
                    join_t = max(join_t, recorded_end(item))
                    continue
                recorded = getattr(item, "think_time", 0.0)
                if pending:
                    await asyncio.gather(*pending)
                    pending = []
                    # the recorded think time ran from the previous request through the subagents: only
                    # the part after the recorded join is still to wait
                    recorded = max(0.0, float(item.t) - join_t)
                    join_t = 0.0
                think = think_delay(recorded, self.cfg)
                if self.expired():
                    return
                if think:
                    await asyncio.sleep(think)
                if self.expired():
                    return
                turn = sent if parent_turn is None else parent_turn
                await self.send(session, tid, sent, turn, turn < self.cfg.warmup_turns, item, think)
                sent += 1
        finally:
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    def body(self, session, req) -> dict:
        from bench.agentic.prompt import prompt_text

        body = {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": self.salt + prompt_text(session, req)}],
            "max_completion_tokens": max(1, int(req.out_tokens)),
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if not self.cfg.tool_turns:
            return body
        body.update(tools=[TOOL], tool_choice="none")  # every turn: the same prompt prefix; the trace's answer is text
        if getattr(req, "stop", "") == "tool_use":  # a call of about 60 tokens, always whole
            body.update(tool_choice="required", parallel_tool_calls=False, ignore_eos=False,
                        max_completion_tokens=max(128, int(req.out_tokens)))
        return body

    async def send(self, session, tid: str, index: int, turn: int, warm: bool, req, think: float) -> None:
        rec = RequestRecord(session=str(session.id), thread=tid, index=index, turn=turn, warmup=warm,
                            t_start=0.0, think_s=think, trace_in_tokens=int(req.in_tokens),
                            trace_out_tokens=int(req.out_tokens))
        body = self.body(session, req)
        sid = f"{session.id}~{self.tag}" if self.tag else str(session.id)
        headers = {"X-Session-ID": sid, "X-Correlation-ID": f"{sid}/{tid}"}
        rec.t_start = self.now()
        try:
            async with self.client.stream("POST", self.url, json=body, headers=headers) as r:
                if r.status_code != 200:
                    rec.status = r.status_code
                    rec.error = (await r.aread()).decode("utf-8", "replace")[:300]
                else:
                    await self._read_stream(r, rec)
        except Exception as e:  # connection refused, timeout, broken stream: one failed request, not a crash
            rec.status, rec.error = f"error:{type(e).__name__}", str(e)[:300]
        rec.t_end = self.now()
        self.records.append(rec)
        self.progress.tick(rec.ok)

    async def _read_stream(self, r: httpx.Response, rec: RequestRecord) -> None:
        last = None
        usage = None
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("error"):
                err = obj["error"]
                rec.status = f"stream_error:{err.get('code') or err.get('type') or 'unknown'}"
                rec.error = str(err.get("message", ""))[:300]
                return
            for choice in obj.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("tool_calls"):
                    t = self.now()
                    if last is None:
                        rec.ttft_s = t - rec.t_start
                    else:
                        rec.gaps_s.append(t - last)
                    last = t
            if obj.get("usage"):
                usage = obj["usage"]
        rec.status = 200
        if usage:
            rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            rec.completion_tokens = int(usage.get("completion_tokens") or 0)
            src = usage.get("moorage") or {}
            if src:
                rec.device, rec.store, rec.computed = (int(src.get(k) or 0) for k in SOURCES)
            else:  # a server without moorage's breakdown: cached tokens count as device
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                rec.device, rec.computed = cached, rec.prompt_tokens - cached


async def replay(sessions: Sequence, cfg: ReplayConfig, progress: bool = True) -> dict:
    """Replay `sessions` (TraceSession) against cfg.base_url; the statistics as a JSON-able dict."""
    sessions = list(sessions)[: cfg.max_sessions or None]
    run = _Run(sessions, cfg, progress)
    wall = await run.run()
    total = sum(count_requests(s.requests) for s in sessions)
    stats = summarize(run.records, wall, cfg, total, ceilings(run.started_sessions, run.records))
    stats["sessions"] = {"given": len(sessions), "started": len(run.started_sessions)}
    stats["records"] = [_record_json(r) for r in sorted(run.records, key=lambda r: r.t_start)]
    return stats


def _record_json(r: RequestRecord) -> dict:
    d = dataclasses.asdict(r)
    d.pop("gaps_s")
    d["itl_s"] = r.itl_s
    d["e2e_s"] = r.e2e_s
    for k in ("t_start", "t_end", "think_s", "ttft_s", "itl_s", "e2e_s"):
        if isinstance(d[k], float):
            d[k] = round(d[k], 5)
    return d


# --- CLI -----------------------------------------------------------------------------------------

# The synthetic corpus used when no --traces are given: the public corpus' shape (synth.SynthParams),
# every token count x `scale` and fewer turns, so a replay fits the `tiny` model on a few CPU cores.
BENCH_SYNTH = {"sessions": 8, "scale": 0.02, "turns": 12, "min_turns": 3}
QUICK_SYNTH = {"sessions": 3, "scale": 0.01, "turns": 4, "min_turns": 3}


def bench_synth_params(quick: bool = False, **overrides):
    from bench.agentic.synth import SynthParams

    return SynthParams(**{**(QUICK_SYNTH if quick else BENCH_SYNTH), **overrides})


def load_sessions(traces: str | None, quick: bool = False, seed: int = 0) -> tuple[list, dict]:
    """(sessions, where they came from): the traces at `traces`, else the bench's synthetic corpus."""
    if traces:
        from bench.agentic.trace import load_traces

        return list(load_traces(traces)), {"traces": str(traces)}
    from bench.agentic.synth import synthesize

    params = bench_synth_params(quick, seed=seed)
    return synthesize(params), {"synth": params.to_json()}


def add_replay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--traces", help="trace file or directory (AgentX / weka format); omit: a synthetic corpus "
                                    f"(synth.SynthParams with {BENCH_SYNTH}, with --quick {QUICK_SYNTH})")
    p.add_argument("--quick", action="store_true", help="the small synthetic corpus (a CI smoke run)")
    p.add_argument("--seed", type=int, default=0, help="synthetic corpus seed")
    p.add_argument("--max-sessions", type=int, default=0, help="replay only the first K sessions (0 = all)")
    p.add_argument("--think-scale", type=float, default=ReplayConfig.think_time_scale,
                   help="recorded think time x this (default %(default)s)")
    p.add_argument("--think-cap", type=_cap, default=ReplayConfig.think_time_cap_s,
                   help="cap on the scaled think time, s; 'none' = uncapped (default %(default)s)")
    p.add_argument("--real-think", action="store_true",
                   help="the recorded think times as they are: --think-scale 1 --think-cap none (unless given)")
    p.add_argument("--warmup-turns", type=int, default=ReplayConfig.warmup_turns,
                   help="turns per session excluded from statistics (default %(default)s)")
    p.add_argument("--timeout", type=float, default=ReplayConfig.request_timeout_s, help="per request, s")
    p.add_argument("--model", default="tiny",
                   help="model sent in requests, and served by the system started when there is no --url: "
                        "tiny (default) or smollm2-135m (8K context: keep the corpus' prompts well below)")
    p.add_argument("--api-key", default=os.environ.get("MOORAGE_API_KEY", ""))
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _cap(text: str) -> float | None:
    """--think-cap: seconds, or none/inf/off for uncapped."""
    if text.strip().lower() in ("none", "inf", "off", "uncapped"):
        return None
    return float(text)


def resolve_think(args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    """--real-think: scale 1 and no cap, except where --think-scale / --think-cap were given explicitly."""
    if not getattr(args, "real_think", False):
        return
    given = {a.split("=", 1)[0] for a in (argv if argv is not None else sys.argv[1:])}
    if "--think-scale" not in given:
        args.think_scale = 1.0
    if "--think-cap" not in given:
        args.think_cap = None


def default_out(name: str, file: str | None = None) -> str:
    """A fresh run directory under runs/ (gitignored): runs/<name>-<YYYYmmdd-HHMMSS>/<file or name.json>."""
    return str(Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}" / (file or f"{name}.json"))


def replay_config(args: argparse.Namespace, concurrency: int, duration_s: float) -> ReplayConfig:
    return ReplayConfig(model=args.model, concurrency=concurrency, duration_s=duration_s,
                        think_time_scale=args.think_scale, think_time_cap_s=args.think_cap,
                        warmup_turns=args.warmup_turns, request_timeout_s=args.timeout, api_key=args.api_key)


def write_json(path: str | os.PathLike, obj: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(obj, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moorage bench agentic", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running router; omit: start moorage (serving --model) for the run and stop it")
    p.add_argument("--concurrency", type=int, default=4, help="session lanes (default %(default)s)")
    p.add_argument("--duration", type=float, default=0.0, help="stop starting new turns after S s (0 = all)")
    p.add_argument("--topology", default="shared", help=f"with no --url: {TOPOLOGY_HELP} (default %(default)s)")
    p.add_argument("--out", default=None, help="JSON result ('' = none; default runs/agentic-<time>/"
                                               "agentic-replay.json, gitignored; bench/results/ on request)")
    p.add_argument("--png", default=None, help="plots (default: --out with .png)")
    add_replay_args(p)
    add_system_args(p)
    args = p.parse_args(argv)
    resolve_think(args, argv)
    if args.out is None:
        args.out = default_out("agentic", "agentic-replay.json")

    sessions, source = load_sessions(args.traces, args.quick, args.seed)
    sessions = sessions[: args.max_sessions or None]
    if not sessions:
        print("moorage bench agentic: no sessions to replay", file=sys.stderr)
        return 1
    cfg = replay_config(args, args.concurrency, args.duration)
    system: dict = {}
    if args.url:
        cfg.base_url = args.url
        stats = asyncio.run(replay(sessions, cfg, progress=not args.no_progress))
        topology = "external"
    else:
        topology = args.topology
        sets, notes = system_overrides(args, topology, sessions, args.concurrency)
        t0 = time.monotonic()
        with running_system(sets, Path(args.run_dir) / topology) as url:
            system = {"overrides": sets, "notes": notes, "startup_s": round(time.monotonic() - t0, 1)}
            cfg.base_url = url
            stats = asyncio.run(replay(sessions, cfg, progress=not args.no_progress))
    print(f"{topology} c={args.concurrency}: {summary_line(stats)}")
    if args.out:
        from bench.agentic.trace import summarize as corpus_summary

        run = {"topology": topology, "concurrency": args.concurrency, "system": system, "stats": stats}
        write_json(args.out, {"kind": "moorage-bench-agentic", "source": source,
                              "corpus": corpus_summary(sessions), **run})
        png = args.png or str(Path(args.out).with_suffix(".png"))
        plot([run], png, f"moorage bench agentic: {topology}, concurrency {args.concurrency}, "
                         f"{len(sessions)} sessions")
        print(f"wrote {args.out} and {png}")
    return 0 if stats["requests"]["sent"] and not stats["errors"]["total"] else 1


if __name__ == "__main__":
    sys.exit(main())
