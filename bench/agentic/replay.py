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
import contextlib
import dataclasses
import json
import math
import os
import secrets
import socket
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REJECT_STATUSES = (429, 503)   # admission rejections: the gate said busy / nothing to run it on
SOURCES = ("device", "store", "computed")


@dataclass
class ReplayConfig:
    base_url: str = "http://127.0.0.1:8000"  # the router (with or without /v1)
    model: str = "tiny"
    concurrency: int = 4               # session lanes (subagents add in-flight requests on top, as recorded)
    duration_s: float = 0.0            # stop starting new turns after this; 0 = replay every session fully
    think_time_scale: float = 0.05     # recorded think time x this ...
    think_time_cap_s: float = 2.0      # ... capped at this (so a replay fits the machine)
    warmup_turns: int = 1              # per session, excluded from statistics
    request_timeout_s: float = 300.0
    api_key: str = ""
    tag: str | None = None             # run tag: prompts start with "[tag]" and session ids end with "~tag",
                                       # so a second replay against the same system cannot hit the first one's
                                       # cache or session affinity; None = random per replay, "" = none
    max_sessions: int = 0              # 0 = all

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.duration_s < 0 or self.think_time_scale < 0 or self.think_time_cap_s < 0:
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
    ttft_s: float | None = None    # send -> first non-empty content delta
    gaps_s: list[float] = field(default_factory=list)  # between successive content deltas
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
    """Recorded think time (s) x scale, capped."""
    return max(0.0, min(float(recorded_s or 0.0) * cfg.think_time_scale, cfg.think_time_cap_s))


def percentile(xs: Sequence[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _pcts(xs: Sequence[float], ps=(50, 90, 99)) -> dict:
    out = {f"p{p}": percentile(xs, p) for p in ps}
    out["mean"] = sum(xs) / len(xs) if xs else None
    out["n"] = len(xs)
    return out


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
                await asyncio.gather(*(self.lane() for _ in range(self.cfg.concurrency)))
        finally:
            self.progress.close()
        return self.now()

    async def lane(self) -> None:
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

        return {
            "model": self.cfg.model,
            "messages": [{"role": "user", "content": self.salt + prompt_text(session, req)}],
            "max_completion_tokens": max(1, int(req.out_tokens)),
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

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
                if (choice.get("delta") or {}).get("content"):
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


# --- the perfect-cache ceiling -------------------------------------------------------------------

def _sent_items(started: list, records: list[RequestRecord], rec_of: dict | None = None) -> list[tuple[object, list[tuple[object, bool]]]]:
    """Per started session, in trace.iter_requests order: (request, warm-up?) for the requests sent.
    Each sent trace request's record is noted in `rec_of` (by id of the request)."""
    from bench.agentic.trace import iter_requests

    sent = {(r.session, r.thread, r.index): r for r in records}
    out = []
    for s in started:
        idx: dict[str, int] = {}
        kept = []
        for thread, req in iter_requests(s):
            i = idx.get(thread, 0)
            idx[thread] = i + 1
            rec = sent.get((str(s.id), thread, i))
            if rec is not None:
                kept.append((req, rec.warmup))
                if rec_of is not None:
                    rec_of[id(req)] = rec
        out.append((s, kept))
    return out


def _sent_view(session, keep: set[int]):
    """The session with only the requests in `keep` (ids), subagents without any left dropped."""
    def walk(items):
        out = []
        for item in items:
            if is_subagent(item):
                sub = walk(item.requests)
                if sub:
                    out.append(dataclasses.replace(item, requests=sub))
            elif id(item) in keep:
                out.append(item)
        return out
    return dataclasses.replace(session, requests=walk(session.requests))


def split_ceiling(per_session: list[tuple[object, list[tuple[object, bool]]]], per_request: dict | None = None) -> dict:
    """trace.ceiling's perfect infinite prefix cache over the sent requests (same order and namespaces),
    its reuse totalled apart for measured and warm-up requests: `measured` is the ceiling to compare the
    measured token sources with (warm-up requests still fill the cache). `per_request` receives each
    request's reusable tokens (by id of the request)."""
    from bench.agentic.trace import scope_namespace

    events = []
    for si, (s, items) in enumerate(per_session):
        for order, (req, warm) in enumerate(items):
            events.append((req.t, si, order, req, warm))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    trie: dict[tuple[int, int], int] = {}
    roots: dict[str, int] = {}
    nodes = 0
    tot = {False: [0, 0], True: [0, 0]}
    for _, si, _, req, warm in events:
        s = per_session[si][0]
        ns = scope_namespace(s)
        if ns not in roots:
            nodes += 1
            roots[ns] = nodes
        node, matched = roots[ns], 0
        for h in req.hash_ids:
            nxt = trie.get((node, h))
            if nxt is None:
                break
            node, matched = nxt, matched + 1
        for h in req.hash_ids[matched:]:
            nodes += 1
            trie[(node, h)] = nodes
            node = nodes
        reusable = min(matched * s.block_size, req.in_tokens)
        tot[warm][0] += req.in_tokens
        tot[warm][1] += reusable
        if per_request is not None:
            per_request[id(req)] = reusable

    def c(p, r):
        return {"prompt_tokens": p, "reusable_tokens": r, "ratio": r / p if p else 0.0}
    return {"measured": c(*tot[False]), "warmup": c(*tot[True]),
            "sent": c(tot[False][0] + tot[True][0], tot[False][1] + tot[True][1])}


def ceilings(started: list, records: list[RequestRecord]) -> dict:
    """The perfect-cache ceiling (trace.ceiling): `measured` (what the measured shares compare with),
    `replayed` (trace.ceiling over every request sent), `full_sessions` (over the started sessions whole)."""
    from bench.agentic.trace import ceiling

    rec_of: dict[int, RequestRecord] = {}
    per_request: dict[int, int] = {}
    per_session = _sent_items(started, records, rec_of)
    split = split_ceiling(per_session, per_request)
    for key, rec in rec_of.items():
        rec.ceiling_tokens = per_request.get(key, 0)
    views = [_sent_view(s, {id(req) for req, _ in items}) for s, items in per_session]
    return {"measured": split["measured"], "warmup": split["warmup"],
            "replayed": ceiling(views) if views else split["sent"],
            "full_sessions": ceiling(started) if started else split["sent"],
            "note": "trace tokens (no chat template, no salt), trace block size; in replay order of t"}


# --- statistics ----------------------------------------------------------------------------------

def _tokens(recs: list[RequestRecord]) -> dict:
    prompt = sum(r.prompt_tokens for r in recs)
    out = {"prompt": prompt, "completion": sum(r.completion_tokens for r in recs)}
    for k in SOURCES:
        out[k] = sum(getattr(r, k) for r in recs)
    out["shares"] = {("pool" if k == "store" else k): (out[k] / prompt if prompt else None) for k in SOURCES}
    out["shares"]["reused"] = (out["device"] + out["store"]) / prompt if prompt else None
    return out


def summarize(records: list[RequestRecord], wall_s: float, cfg: ReplayConfig | None = None,
              total_requests: int | None = None, ceiling: dict | None = None, samples: bool = True) -> dict:
    measured = [r for r in records if not r.warmup]
    warm = [r for r in records if r.warmup]
    ok = [r for r in measured if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    tpot = [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in ok
            if r.ttft_s is not None and r.completion_tokens > 1]
    e2e = [r.e2e_s for r in ok]
    window = (max(r.t_end for r in measured) - min(r.t_start for r in measured)) if measured else 0.0
    tok = _tokens(ok)
    statuses = Counter(str(r.status) for r in records if not r.ok)
    rejections = sum(1 for r in records if r.status in REJECT_STATUSES)
    out = {
        "accounting": "warm-up turns (the first warmup_turns main-thread requests of each session and the "
                      "subagents recorded after them) are sent but excluded from latency, throughput, token "
                      "sources and the ceiling; see `warmup`. errors/rejections count every request. Token "
                      "throughput = (prompt tokens, cached or not, + completion tokens) of measured successful "
                      "requests / measured window.",
        "requests": {
            "total_in_traces": total_requests, "sent": len(records), "measured": len(measured),
            "measured_ok": len(ok), "warmup": len(warm),
            "not_sent": (total_requests - len(records)) if total_requests is not None else None,
        },
        "errors": {"total": sum(statuses.values()), "by_status": dict(statuses)},
        "rejections": rejections,
        "ttft_s": _pcts(ttft),
        "itl_s": _pcts(gaps),
        "tpot_s": _pcts(tpot),
        "e2e_s": _pcts(e2e),
        "window_s": window,
        "wall_s": wall_s,
        "throughput": {
            "requests_per_s": len(ok) / window if window > 0 else None,
            "tokens_per_s": (tok["prompt"] + tok["completion"]) / window if window > 0 else None,
            "prompt_tokens_per_s": tok["prompt"] / window if window > 0 else None,
            "completion_tokens_per_s": tok["completion"] / window if window > 0 else None,
        },
        "tokens": tok,
        "warmup": {"requests": len(warm), "ok": sum(r.ok for r in warm), "tokens": _tokens([r for r in warm if r.ok])},
    }
    if ceiling is not None:
        out["ceiling"] = ceiling
    if cfg is not None:
        out["config"] = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "api_key"}
    if samples:
        out["samples"] = {"ttft_s": [round(x, 5) for x in ttft], "e2e_s": [round(x, 5) for x in e2e]}
    return out


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


# --- starting a system ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def up_supports(*names: str) -> bool:
    from shared.up import UpSettings

    have = {f.name for f in dataclasses.fields(UpSettings)}
    return all(n in have for n in names)


TOPOLOGY_HELP = "<none|split|shared>[-<cache-aware|sticky|p2c>]"


def topology_overrides(topology: str, groups: int = 1, device_blocks: int = 0, store_bytes: int = 0,
                       decode_blocks: int = 0, stores: int = 0) -> tuple[list[str], list[str]]:
    """(UpConfig overrides, notes) for a topology `<pool mode>[-<routing>]` (none, split, shared,
    shared-p2c, shared-sticky, none-p2c, ...; routing defaults to cache-aware) on `groups` groups."""
    mode, _, routing = topology.partition("-")
    routing = routing or "cache-aware"
    if mode not in ("none", "split", "shared") or routing not in ("cache-aware", "sticky", "p2c"):
        raise ValueError(f"unknown topology {topology!r}: {TOPOLOGY_HELP}")
    notes: list[str] = []
    sets = ["up.model=tiny", f"up.pool={'false' if mode == 'none' else 'true'}",
            f"router.router.routing={routing}"]
    if up_supports("groups", "pool_mode"):
        sets.append(f"up.groups={groups}")
        if mode != "none":
            sets.append(f"up.pool_mode={mode}")
    else:
        if mode == "split":
            raise ValueError("this Launcher has no up.pool_mode: the split topology needs up.groups / up.pool_mode")
        if groups > 1:
            sets.append(f"up.prefills={groups}")
            notes.append(f"Launcher without up.groups: {groups} prefills behind one decode and one pool instead")
    if device_blocks:
        sets.append(f"prefill.engine.num_blocks={device_blocks}")
    if decode_blocks:
        sets.append(f"decode.engine.num_blocks={decode_blocks}")
    if mode != "none":
        if store_bytes:
            sets.append(f"up.store_bytes={store_bytes}")
        if stores:
            sets.append(f"up.stores={stores}")
    return sets, notes


@contextlib.contextmanager
def running_system(overrides: Sequence[str], run_dir: str | os.PathLike,
                   ready_timeout_s: float = 180.0) -> Iterator[str]:
    """Start moorage (shared.up.Launcher) with `overrides` on a free port; yield its URL; stop it."""
    from shared.config import load_config
    from shared.up import Launcher, UpConfig

    cfg = load_config(UpConfig, overrides=[f"up.port={free_port()}", f"up.run_dir={run_dir}",
                                           f"up.ready_timeout_s={ready_timeout_s}", *overrides])
    launcher = Launcher(cfg)
    try:
        url = launcher.start()
        launcher.wait_ready(url)
        yield url
    finally:
        launcher.stop()


# --- plots ---------------------------------------------------------------------------------------

def plot(runs: list[dict], path: str | os.PathLike, title: str = "moorage agentic replay") -> None:
    """runs: [{"topology", "concurrency", "stats"}]: TTFT distribution (CDF per run), token sources per load
    (stacked shares with the ceiling), token throughput per load (one line per topology)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    topologies = list(dict.fromkeys(r["topology"] for r in runs))
    color = {t: f"C{i}" for i, t in enumerate(topologies)}
    loads = sorted({r["concurrency"] for r in runs})
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.8))
    fig.suptitle(title, fontsize=11)

    ax = axes[0]
    for r in runs:
        xs = sorted(r["stats"].get("samples", {}).get("ttft_s", []))
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", color=color[r["topology"]],
                    linestyle=styles[loads.index(r["concurrency"]) % len(styles)],
                    label=f"{r['topology']} c={r['concurrency']}")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log)")
    ax.set_ylabel("fraction of measured requests")
    ax.set_title("TTFT distribution (CDF)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)

    ax = axes[1]
    labels, x = [], 0
    for r in runs:
        sh = r["stats"]["tokens"]["shares"]
        d, p, c = (sh.get(k) or 0.0 for k in ("device", "pool", "computed"))
        ax.bar(x, d, color="C2", label="device" if x == 0 else None)
        ax.bar(x, p, bottom=d, color="C0", label="pool" if x == 0 else None)
        ax.bar(x, c, bottom=d + p, color="C7", label="computed" if x == 0 else None)
        ceil = (r["stats"].get("ceiling") or {}).get("measured", {}).get("ratio")
        if ceil is not None:
            ax.plot([x - 0.4, x + 0.4], [ceil, ceil], color="k", lw=2, label="ceiling" if x == 0 else None)
        ax.annotate(f"{d + p:.0%}", (x, min(d + p, 0.97)), ha="center", va="bottom", fontsize=7)
        labels.append(f"{r['topology']}\nc={r['concurrency']}")
        x += 1
    ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=45 if len(labels) > 6 else 0)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("share of prompt tokens")
    ax.set_title("Token sources per load (line: perfect-cache ceiling)")
    ax.legend(fontsize=7, loc="lower right")

    ax = axes[2]
    width = 0.8 / max(1, len(topologies))
    for i, t in enumerate(topologies):
        rs = sorted((r for r in runs if r["topology"] == t), key=lambda r: r["concurrency"])
        xs = [loads.index(r["concurrency"]) + (i - (len(topologies) - 1) / 2) * width for r in rs]
        ys = [r["stats"]["throughput"]["tokens_per_s"] or 0.0 for r in rs]
        bars = ax.bar(xs, ys, width, color=color[t], label=t)
        ax.bar_label(bars, fmt="%.0f", fontsize=6)
    ax.set_xticks(range(len(loads)), [f"c={c}" for c in loads])
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("tokens/s (prompt incl. cached + generated)")
    ax.set_title("Token throughput per load")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_line(stats: dict) -> str:
    t, sh, th = stats["ttft_s"], stats["tokens"]["shares"], stats["throughput"]
    ceil = (stats.get("ceiling") or {}).get("measured", {}).get("ratio")

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)
    return (f"{stats['requests']['measured_ok']}/{stats['requests']['measured']} measured ok, "
            f"{stats['errors']['total']} errors, {stats['rejections']} rejections; TTFT p50/p90/p99 "
            f"{f(t['p50'], '.3f')}/{f(t['p90'], '.3f')}/{f(t['p99'], '.3f')} s, ITL p50 "
            f"{f(stats['itl_s']['p50'], '.4f')} s; {f(th['tokens_per_s'], ',.0f')} tok/s, "
            f"{f(th['requests_per_s'], '.2f')} req/s; prompt tokens device {f(sh['device'], '.1%')} / pool "
            f"{f(sh['pool'], '.1%')} / computed {f(sh['computed'], '.1%')} (ceiling {f(ceil, '.1%')})")


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
    p.add_argument("--think-cap", type=float, default=ReplayConfig.think_time_cap_s,
                   help="cap on the scaled think time, s (default %(default)s)")
    p.add_argument("--warmup-turns", type=int, default=ReplayConfig.warmup_turns,
                   help="turns per session excluded from statistics (default %(default)s)")
    p.add_argument("--timeout", type=float, default=ReplayConfig.request_timeout_s, help="per request, s")
    p.add_argument("--model", default="tiny", help="model name sent in requests")
    p.add_argument("--api-key", default=os.environ.get("MOORAGE_API_KEY", ""))
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_system_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=1, help="groups of prefill + stores + decode (up.groups)")
    p.add_argument("--device-blocks", type=int, default=0,
                   help="device KV blocks (16 tokens) per prefill (prefill.engine.num_blocks); 0 = from the "
                        "traces, see --device-fraction")
    p.add_argument("--device-fraction", type=float, default=0.15,
                   help="with --device-blocks 0: device KV of all prefills together = this x the distinct "
                        "prompt tokens of the traces (at least the longest request), so device memory alone "
                        "holds well under the ceiling (default %(default)s)")
    p.add_argument("--device-min-prompts", type=float, default=1.0,
                   help="with --device-blocks 0: device KV per prefill holds at least this many of the longest "
                        "prompt (a pool restore needs free device blocks next to the prompts in flight; "
                        "default %(default)s)")
    p.add_argument("--decode-blocks", type=int, default=0, help="decode KV blocks (0 = from the traces)")
    p.add_argument("--chunk-tokens", type=int, default=64,
                   help="pool chunk size in tokens (prefill.engine.chunk_tokens; production default 256). The "
                        "bench corpus scales contexts ~50x down; a 256-token chunk would then leave a partial "
                        "chunk worth ~5%% of every prompt out of the pool, so the chunk shrinks to the trace "
                        "block size (default %(default)s)")
    p.add_argument("--stores", type=int, default=1, help="store services per group (up.stores)")
    p.add_argument("--store-bytes", type=int, default=256 << 20, help="DRAM per store service, bytes "
                                                                     "(up.store_bytes; default %(default)s)")
    p.add_argument("--run-dir", default=".moorage/bench", help="configs and logs of the systems started")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra UpConfig override for the systems started (repeatable)")


def replay_config(args: argparse.Namespace, concurrency: int, duration_s: float) -> ReplayConfig:
    return ReplayConfig(model=args.model, concurrency=concurrency, duration_s=duration_s,
                        think_time_scale=args.think_scale, think_time_cap_s=args.think_cap,
                        warmup_turns=args.warmup_turns, request_timeout_s=args.timeout, api_key=args.api_key)


def _walk_requests(items):
    for i in items:
        if is_subagent(i):
            yield from _walk_requests(i.requests)
        else:
            yield i


def auto_blocks(sessions: list, groups: int, fraction: float, concurrency: int,
                block_tokens: int = 16, min_prompts: float = 1.0) -> tuple[int, int]:
    """(device blocks per prefill, decode blocks), sized from the traces: device KV across all prefills
    holds `fraction` of the distinct prompt tokens (the perfect cache's working set) but never less than
    `min_prompts` x the longest request; decode holds 4 x `concurrency` of the longest sequences (subagents
    run alongside)."""
    reqs = [r for s in sessions for r in _walk_requests(s.requests)]
    longest = max((r.in_tokens + r.out_tokens for r in reqs), default=1024) + 64  # + template and tag
    distinct_tokens = 0
    seen = set()
    for s in sessions:
        ns = "" if s.hash_id_scope == "global" else s.id
        for r in _walk_requests(s.requests):
            for h in r.hash_ids:
                if (ns, h) not in seen:
                    seen.add((ns, h))
                    distinct_tokens += s.block_size
    need = math.ceil(min_prompts * longest / block_tokens) + 2
    device = max(need, math.ceil(fraction * distinct_tokens / block_tokens / max(1, groups)))
    decode = max(256, 4 * concurrency * math.ceil(longest / block_tokens))
    return device, decode


def system_overrides(args: argparse.Namespace, topology: str, sessions: list,
                     concurrency: int) -> tuple[list[str], list[str]]:
    device, decode = auto_blocks(sessions, args.groups, args.device_fraction, concurrency,
                                 min_prompts=args.device_min_prompts)
    sets, notes = topology_overrides(topology, args.groups, args.device_blocks or device, args.store_bytes,
                                     args.decode_blocks or decode, args.stores)
    if not topology.startswith("none"):  # same bytes per batched read as 4 chunks of 256 tokens
        sets += [f"prefill.engine.chunk_tokens={args.chunk_tokens}",
                 f"prefill.pool.restore_batch_chunks={max(4, 1024 // args.chunk_tokens)}"]
    return sets + list(args.set), notes


def write_json(path: str | os.PathLike, obj: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(obj, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moorage bench agentic", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running router; omit: start moorage (model tiny) for the run and stop it")
    p.add_argument("--concurrency", type=int, default=4, help="session lanes (default %(default)s)")
    p.add_argument("--duration", type=float, default=0.0, help="stop starting new turns after S s (0 = all)")
    p.add_argument("--topology", default="shared", help=f"with no --url: {TOPOLOGY_HELP} (default %(default)s)")
    p.add_argument("--out", default="bench/results/agentic-replay.json", help="JSON result ('' = none)")
    p.add_argument("--png", default=None, help="plots (default: --out with .png)")
    add_replay_args(p)
    add_system_args(p)
    args = p.parse_args(argv)

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
