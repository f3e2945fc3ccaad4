"""Per-request traces and per-stage latencies from moorage's spans (what `moorage trace show|breakdown`
prints), read from the jsonl trace file or, through infra/phoenix_api.py, from Phoenix.

A span is the jsonl exporter's dict (shared/tracing.span_to_dict): name, trace_id, span_id,
parent_span_id, service, start_ns, end_ns, duration_ms, attributes, status. One request is one trace
whose root is `router.request` (its `request_id` attribute names the request).

Stages (milliseconds per request; a stage a request did not go through is absent, not zero):
  router      router.request start -> the first prefill span, less the gate's wait (parse, tokenize,
              chunk hashes, routing, bus hops)
  gate wait   gate.admit
  lookup      store.lookup            restore   store.restore
  queue       prefill.queue           compute   prefill.compute
  gather / write / scatter   the sums of the handoff rounds' kv.gather / kv.write / decode.scatter
  handoff     kv.handoff (whole, bus round trips included)
  first token decode.generate's first_token_ms (adoption -> first decode step)
  itl         decode.generate's mean inter-token gap
  ttft        router.request's ttft_ms      total   router.request
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = "router.request"
PREFILL_SPANS = ("store.lookup", "store.restore", "prefill.queue", "prefill.compute")

# (key, label) in the order a request meets them
STAGES = (
    ("router", "router overhead"), ("gate", "gate wait"), ("lookup", "store lookup"),
    ("restore", "store restore"), ("queue", "prefill queue"), ("compute", "prefill compute"),
    ("gather", "handoff gather"), ("write", "handoff write"), ("scatter", "handoff scatter"),
    ("handoff", "handoff (whole)"), ("first_token", "decode first token"), ("itl", "inter-token gap (mean)"),
    ("ttft", "TTFT (router)"), ("total", "request (router)"),
)
_SINGLE = {"gate": "gate.admit", "lookup": "store.lookup", "restore": "store.restore", "queue": "prefill.queue",
           "compute": "prefill.compute", "handoff": "kv.handoff"}
_SUMMED = {"gather": "kv.gather", "write": "kv.write", "scatter": "decode.scatter"}


def read_jsonl(path: str | Path, since_ns: int = 0) -> list[dict]:
    """Spans of a jsonl trace file that started at or after since_ns (a torn last line is skipped)."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    span = json.loads(line)
                except ValueError:
                    continue
                if span.get("start_ns", 0) >= since_ns:
                    out.append(span)
    except FileNotFoundError:
        raise FileNotFoundError(f"no trace file at {path}") from None
    return out


@dataclass
class RequestTrace:
    """One request's spans, the root first, the rest by start time."""
    root: dict
    spans: list[dict]

    @property
    def request_id(self) -> str:
        return str(self.root["attributes"].get("request_id", ""))

    @property
    def trace_id(self) -> str:
        return self.root["trace_id"]

    def named(self, name: str) -> list[dict]:
        return [s for s in self.spans if s["name"] == name]

    def parent_of(self, span: dict) -> dict | None:
        return next((s for s in self.spans if s["span_id"] == span.get("parent_span_id")), None)

    def depth(self, span: dict) -> int:
        d, seen = 0, set()
        while (p := self.parent_of(span)) is not None and p["span_id"] not in seen:
            seen.add(p["span_id"])
            d, span = d + 1, p
        return d

    def stages(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, name in _SINGLE.items():
            found = self.named(name)
            if found:
                out[key] = sum(s["duration_ms"] for s in found)
        for key, name in _SUMMED.items():
            found = self.named(name)
            if found:
                out[key] = sum(s["duration_ms"] for s in found)
        prefill = [s["start_ns"] for s in self.spans if s["name"] in PREFILL_SPANS]
        if prefill:
            out["router"] = max(0.0, (min(prefill) - self.root["start_ns"]) / 1e6 - out.get("gate", 0.0))
        gen = self.named("decode.generate")
        if gen:
            a = gen[0]["attributes"]
            if a.get("first_token_ms") is not None:
                out["first_token"] = float(a["first_token_ms"])
            if a.get("itl_mean_ms") is not None:
                out["itl"] = float(a["itl_mean_ms"])
        if self.root["attributes"].get("ttft_ms") is not None:
            out["ttft"] = float(self.root["attributes"]["ttft_ms"])
        out["total"] = self.root["duration_ms"]
        return out


def request_traces(spans: list[dict]) -> list[RequestTrace]:
    """Every trace rooted at a router.request, in the order the requests started."""
    by_trace: dict[str, list[dict]] = defaultdict(list)
    for s in spans:
        by_trace[s["trace_id"]].append(s)
    out = []
    for members in by_trace.values():
        roots = [s for s in members if s["name"] == ROOT]
        if not roots:
            continue  # a trace without its request (sampled out, or the router's batch not written yet)
        root = min(roots, key=lambda s: s["start_ns"])
        rest = sorted((s for s in members if s is not root), key=lambda s: (s["start_ns"], s["name"]))
        out.append(RequestTrace(root, [root, *rest]))
    return sorted(out, key=lambda t: t.root["start_ns"])


def find_request(traces: list[RequestTrace], request_id: str | None) -> RequestTrace:
    """The trace of `request_id` (a full id, or the id with or without its req-/chatcmpl-/cmpl- prefix);
    None: the latest request that finished."""
    if not traces:
        raise LookupError("no request traces found")
    if request_id is None:
        return max(traces, key=lambda t: t.root["end_ns"])
    bare = request_id.split("-", 1)[1] if request_id.startswith(("req-", "chatcmpl-", "cmpl-")) else request_id
    for t in traces:
        if t.request_id in (request_id, f"req-{bare}") or t.trace_id == request_id:
            return t
    raise LookupError(f"no trace for request {request_id!r} ({len(traces)} requests searched)")


@dataclass
class StageStats:
    key: str
    label: str
    n: int
    p50: float
    p90: float
    p99: float
    mean: float


@dataclass
class Breakdown:
    requests: int
    stages: list[StageStats] = field(default_factory=list)


def breakdown(traces: list[RequestTrace]) -> Breakdown:
    """p50/p90/p99 of each stage over the requests that went through it."""
    values: dict[str, list[float]] = defaultdict(list)
    for t in traces:
        for key, ms in t.stages().items():
            values[key].append(ms)
    out = Breakdown(len(traces))
    for key, label in STAGES:
        v = values.get(key)
        if v:
            p50, p90, p99 = (float(x) for x in np.percentile(v, [50, 90, 99]))
            out.stages.append(StageStats(key, label, len(v), p50, p90, p99, float(np.mean(v))))
    return out
