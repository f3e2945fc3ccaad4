"""The replay's statistics: percentiles, the perfect-cache ceiling over the requests actually sent, and
the summary that `moorage bench agentic` writes (see `summarize` for what each number counts)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from bench._util import percentile as _percentile

if TYPE_CHECKING:
    from bench.agentic.replay import ReplayConfig, RequestRecord

REJECT_STATUSES = (429, 503)   # admission rejections: the gate said busy / nothing to run it on
SOURCES = ("device", "store", "computed")


def percentile(xs: Sequence[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no data."""
    return _percentile(list(xs), p) if xs else None


def _pcts(xs: Sequence[float], ps=(50, 90, 99)) -> dict:
    out = {f"p{p}": percentile(xs, p) for p in ps}
    out["mean"] = sum(xs) / len(xs) if xs else None
    out["n"] = len(xs)
    return out


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
    from bench.agentic.trace import TraceRequest

    def walk(items):
        out = []
        for item in items:
            if not isinstance(item, TraceRequest):  # a subagent
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
