"""The public AgentX / weka agent-session trace format: read, validate strictly, write, and measure.

One JSON object per session (the shape of `semianalysisai/cc-traces-weka-062126` and of the AgentX
harness' trace loader)::

    {"id": "...", "models": ["..."], "block_size": 64, "hash_id_scope": "local" | "global",
     "tool_tokens": 0, "system_tokens": 0,                      # optional
     "requests": [
        {"t": 0.0, "type": "s" | "n", "model": "...", "in": 25259, "out": 86,
         "hash_ids": [1, 2, ...], "input_types": ["text"], "output_types": ["text"],
         "stop": "" | "tool_use" | "end_turn", "api_time": 3.1, "think_time": 0.0, "ttft": 0.9},
        {"t": 12.5, "type": "subagent", "agent_id": "agent_001", "subagent_type": "Explore",
         "status": "completed", "duration_ms": 40210, "requests": [ ...same shapes, nested... ]}]}

Field meanings: `t` is the start of a request (or the spawn of a subagent) in seconds from the start of
the session; `in`/`out` are token counts; `hash_ids` has one id per `block_size`-token block of the input,
the last block possibly partial (so `len(hash_ids) == ceil(in / block_size)`), and equal ids mean
byte-identical blocks; `think_time` is the client's delay before the request, `api_time` how long the
request took when it was recorded (both seconds). `hash_id_scope` "local" (alias "session") means ids
only compare within one session; "global" means one id space across the corpus.

Validation is strict: a missing or mistyped field, an unknown field, a negative count, a hash-id list
whose length does not match `in`, or an unknown request type raises `TraceError`, whose message names
the file, the session id and the JSON path of the problem (e.g. `requests[3].requests[1].hash_ids`).
Optional fields the format allows (`input_types`, `output_types`, `stop`, `api_time`, `think_time`,
`ttft`; subagent `duration_ms`, `total_tokens`, `tool_use_count`, `models`, `tool_tokens`,
`system_tokens`; session `tool_tokens`, `system_tokens`, `totals`) take their defaults when absent;
a null `api_time` / `think_time` reads as 0.0.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

REQUEST_TYPES = ("n", "s")
SUBAGENT_TYPE = "subagent"
SCOPES = ("local", "session", "global")
MAIN_THREAD = "main"


class TraceError(ValueError):
    """A trace that is not valid; the message names the file, the session and the JSON path."""

    def __init__(self, message: str, *, source: str = "", session_id: str | None = None, path: str = ""):
        self.source = source
        self.session_id = session_id
        self.path = path
        self.reason = message
        parts = [source or "<trace>"]
        if session_id is not None:
            parts.append(f"session {session_id!r}")
        if path:
            parts.append(path)
        super().__init__(": ".join(parts + [message]))


@dataclass
class TraceRequest:
    t: float
    type: str
    model: str
    in_tokens: int
    out_tokens: int
    hash_ids: list[int]
    input_types: list[str] = field(default_factory=list)
    output_types: list[str] = field(default_factory=list)
    stop: str = ""
    api_time: float = 0.0
    think_time: float = 0.0
    ttft: float | None = None


@dataclass
class TraceSubagent:
    t: float
    agent_id: str
    subagent_type: str
    status: str
    duration_ms: float | None
    requests: list[Union[TraceRequest, "TraceSubagent"]]
    models: list[str] = field(default_factory=list)
    total_tokens: int | None = None
    tool_use_count: int | None = None
    tool_tokens: int = 0
    system_tokens: int = 0


TraceItem = Union[TraceRequest, TraceSubagent]


@dataclass
class TraceSession:
    id: str
    models: list[str]
    block_size: int
    hash_id_scope: str
    requests: list[TraceItem]
    tool_tokens: int = 0
    system_tokens: int = 0
    totals: dict | None = None


# ---------------------------------------------------------------- validation


class _Ctx:
    def __init__(self, source: str, session_id: str | None):
        self.source = source
        self.session_id = session_id

    def fail(self, path: str, message: str) -> TraceError:
        return TraceError(message, source=self.source, session_id=self.session_id, path=path)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _typename(v: Any) -> str:
    return "null" if v is None else "bool" if isinstance(v, bool) else type(v).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _check_keys(ctx: _Ctx, obj: dict, path: str, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    for k in required:
        if k not in obj:
            raise ctx.fail(_join(path, k), "missing required field")
    allowed = set(required) | set(optional)
    for k in obj:
        if k not in allowed:
            raise ctx.fail(_join(path, str(k)), f"unknown field (allowed: {', '.join(sorted(allowed))})")


def _str(ctx: _Ctx, obj: dict, key: str, path: str, default: Any = ..., nonempty: bool = False) -> str:
    if key not in obj and default is not ...:
        return default
    v = obj[key]
    if not isinstance(v, str):
        raise ctx.fail(_join(path, key), f"expected a string, got {_typename(v)}")
    if nonempty and not v:
        raise ctx.fail(_join(path, key), "must not be empty")
    return v


def _count(ctx: _Ctx, obj: dict, key: str, path: str, default: Any = ..., nullable: bool = False,
           positive: bool = False) -> Any:
    if key not in obj and default is not ...:
        return default
    v = obj[key]
    if v is None and nullable:
        return None
    if not _is_int(v):
        raise ctx.fail(_join(path, key), f"expected an integer, got {_typename(v)} {v!r}")
    if v < 0 or (positive and v == 0):
        raise ctx.fail(_join(path, key), f"must be {'positive' if positive else 'non-negative'}, got {v}")
    return v


def _seconds(ctx: _Ctx, obj: dict, key: str, path: str, default: Any = ..., null_as: Any = ...) -> Any:
    if key not in obj and default is not ...:
        return default
    v = obj[key]
    if v is None and null_as is not ...:
        return null_as
    if not _is_num(v):
        raise ctx.fail(_join(path, key), f"expected a finite number, got {_typename(v)} {v!r}")
    if v < 0:
        raise ctx.fail(_join(path, key), f"must be non-negative, got {v}")
    return v


def _str_list(ctx: _Ctx, obj: dict, key: str, path: str, default: Any = ...) -> list[str]:
    if key not in obj and default is not ...:
        return list(default)
    v = obj[key]
    p = _join(path, key)
    if not isinstance(v, list):
        raise ctx.fail(p, f"expected a list of strings, got {_typename(v)}")
    for i, s in enumerate(v):
        if not isinstance(s, str):
            raise ctx.fail(f"{p}[{i}]", f"expected a string, got {_typename(s)}")
    return list(v)


_REQ_REQUIRED = ("t", "type", "model", "in", "out", "hash_ids")
_REQ_OPTIONAL = ("input_types", "output_types", "stop", "api_time", "think_time", "ttft")
_SUB_REQUIRED = ("t", "type", "agent_id", "subagent_type", "status", "requests")
_SUB_OPTIONAL = ("duration_ms", "total_tokens", "tool_use_count", "models", "tool_tokens", "system_tokens")
_SESSION_REQUIRED = ("id", "models", "block_size", "hash_id_scope", "requests")
_SESSION_OPTIONAL = ("tool_tokens", "system_tokens", "totals")


def _parse_request(ctx: _Ctx, obj: dict, path: str, block_size: int) -> TraceRequest:
    _check_keys(ctx, obj, path, _REQ_REQUIRED, _REQ_OPTIONAL)
    t = _seconds(ctx, obj, "t", path)
    typ = obj["type"]
    model = _str(ctx, obj, "model", path)
    n_in = _count(ctx, obj, "in", path)
    n_out = _count(ctx, obj, "out", path)
    ids = obj["hash_ids"]
    p = _join(path, "hash_ids")
    if not isinstance(ids, list):
        raise ctx.fail(p, f"expected a list of integers, got {_typename(ids)}")
    for i, h in enumerate(ids):
        if not _is_int(h) or h < 0:
            raise ctx.fail(f"{p}[{i}]", f"expected a non-negative integer, got {_typename(h)} {h!r}")
    want = -(-n_in // block_size)
    if len(ids) != want:
        raise ctx.fail(p, f"has {len(ids)} ids but in={n_in} at block_size={block_size} needs "
                          f"ceil({n_in}/{block_size}) = {want}")
    return TraceRequest(
        t=t, type=typ, model=model, in_tokens=n_in, out_tokens=n_out, hash_ids=list(ids),
        input_types=_str_list(ctx, obj, "input_types", path, default=()),
        output_types=_str_list(ctx, obj, "output_types", path, default=()),
        stop=_str(ctx, obj, "stop", path, default=""),
        api_time=_seconds(ctx, obj, "api_time", path, default=0.0, null_as=0.0),
        think_time=_seconds(ctx, obj, "think_time", path, default=0.0, null_as=0.0),
        ttft=_seconds(ctx, obj, "ttft", path, default=None, null_as=None),
    )


def _parse_subagent(ctx: _Ctx, obj: dict, path: str, block_size: int) -> TraceSubagent:
    _check_keys(ctx, obj, path, _SUB_REQUIRED, _SUB_OPTIONAL)
    return TraceSubagent(
        t=_seconds(ctx, obj, "t", path),
        agent_id=_str(ctx, obj, "agent_id", path, nonempty=True),
        subagent_type=_str(ctx, obj, "subagent_type", path),
        status=_str(ctx, obj, "status", path),
        duration_ms=_seconds(ctx, obj, "duration_ms", path, default=None, null_as=None),
        requests=_parse_items(ctx, obj["requests"], _join(path, "requests"), block_size, allow_empty=True),
        models=_str_list(ctx, obj, "models", path, default=()),
        total_tokens=_count(ctx, obj, "total_tokens", path, default=None, nullable=True),
        tool_use_count=_count(ctx, obj, "tool_use_count", path, default=None, nullable=True),
        tool_tokens=_count(ctx, obj, "tool_tokens", path, default=0),
        system_tokens=_count(ctx, obj, "system_tokens", path, default=0),
    )


def _parse_items(ctx: _Ctx, items: Any, path: str, block_size: int, allow_empty: bool) -> list[TraceItem]:
    if not isinstance(items, list):
        raise ctx.fail(path, f"expected a list of requests, got {_typename(items)}")
    if not items and not allow_empty:
        raise ctx.fail(path, "a session needs at least one request")
    out: list[TraceItem] = []
    for i, item in enumerate(items):
        p = f"{path}[{i}]"
        if not isinstance(item, dict):
            raise ctx.fail(p, f"expected an object, got {_typename(item)}")
        if "type" not in item:
            raise ctx.fail(_join(p, "type"), "missing required field")
        typ = item["type"]
        if typ in REQUEST_TYPES:
            out.append(_parse_request(ctx, item, p, block_size))
        elif typ == SUBAGENT_TYPE:
            out.append(_parse_subagent(ctx, item, p, block_size))
        else:
            raise ctx.fail(_join(p, "type"), f"unknown request type {typ!r} (expected 'n', 's' or 'subagent')")
    return out


def parse_session(obj: Any, source: str = "") -> TraceSession:
    """Validate one session object strictly and return it; raise `TraceError` on the first problem."""
    sid = obj.get("id") if isinstance(obj, dict) else None
    ctx = _Ctx(source, sid if isinstance(sid, str) else None)
    if not isinstance(obj, dict):
        raise ctx.fail("", f"a session must be a JSON object, got {_typename(obj)}")
    _check_keys(ctx, obj, "", _SESSION_REQUIRED, _SESSION_OPTIONAL)
    sid = _str(ctx, obj, "id", "", nonempty=True)
    block_size = _count(ctx, obj, "block_size", "", positive=True)
    scope = _str(ctx, obj, "hash_id_scope", "")
    if scope not in SCOPES:
        raise ctx.fail("hash_id_scope", f"unknown scope {scope!r} (expected 'local', 'session' or 'global')")
    totals = obj.get("totals")
    if totals is not None and not isinstance(totals, dict):
        raise ctx.fail("totals", f"expected an object, got {_typename(totals)}")
    return TraceSession(
        id=sid,
        models=_str_list(ctx, obj, "models", ""),
        block_size=block_size,
        hash_id_scope=scope,
        requests=_parse_items(ctx, obj["requests"], "requests", block_size, allow_empty=False),
        tool_tokens=_count(ctx, obj, "tool_tokens", "", default=0),
        system_tokens=_count(ctx, obj, "system_tokens", "", default=0),
        totals=dict(totals) if totals is not None else None,
    )


# ---------------------------------------------------------------- writing


def _request_to_json(r: TraceRequest) -> dict:
    d: dict[str, Any] = {
        "t": r.t, "type": r.type, "model": r.model, "in": r.in_tokens, "out": r.out_tokens,
        "hash_ids": list(r.hash_ids), "input_types": list(r.input_types),
        "output_types": list(r.output_types), "stop": r.stop, "api_time": r.api_time,
        "think_time": r.think_time,
    }
    if r.ttft is not None:
        d["ttft"] = r.ttft
    return d


def _item_to_json(item: TraceItem) -> dict:
    if isinstance(item, TraceRequest):
        return _request_to_json(item)
    d: dict[str, Any] = {
        "t": item.t, "type": SUBAGENT_TYPE, "agent_id": item.agent_id,
        "subagent_type": item.subagent_type, "status": item.status,
    }
    for k in ("duration_ms", "total_tokens", "tool_use_count"):
        if getattr(item, k) is not None:
            d[k] = getattr(item, k)
    if item.models:
        d["models"] = list(item.models)
    if item.tool_tokens:
        d["tool_tokens"] = item.tool_tokens
    if item.system_tokens:
        d["system_tokens"] = item.system_tokens
    d["requests"] = [_item_to_json(x) for x in item.requests]
    return d


def session_to_json(s: TraceSession) -> dict:
    d: dict[str, Any] = {"id": s.id, "models": list(s.models), "block_size": s.block_size,
                         "hash_id_scope": s.hash_id_scope}
    if s.tool_tokens:
        d["tool_tokens"] = s.tool_tokens
    if s.system_tokens:
        d["system_tokens"] = s.system_tokens
    if s.totals is not None:
        d["totals"] = dict(s.totals)
    d["requests"] = [_item_to_json(x) for x in s.requests]
    return d


def _safe_name(sid: str) -> str:
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in sid).strip(".")
    return name or "session"


def write_traces(sessions: list[TraceSession], dir_or_file: str | os.PathLike) -> list[Path]:
    """Write sessions: to `X.jsonl` one per line, to `X.json` as a list, otherwise into the directory
    `dir_or_file` as one `<index>-<id>.json` per session (the index keeps the order `load_traces`
    reads them back in). Returns the paths written."""
    target = Path(dir_or_file)
    if target.suffix == ".jsonl":
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("".join(json.dumps(session_to_json(s), separators=(",", ":")) + "\n"
                                  for s in sessions))
        return [target]
    if target.suffix == ".json":
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps([session_to_json(s) for s in sessions], separators=(",", ":")) + "\n")
        return [target]
    target.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    width = max(5, len(str(len(sessions) - 1)))
    for i, s in enumerate(sessions):
        p = target / f"{i:0{width}d}-{_safe_name(s.id)}.json"
        p.write_text(json.dumps(session_to_json(s), separators=(",", ":")) + "\n")
        written.append(p)
    return written


# ---------------------------------------------------------------- loading


def _load_file(p: Path) -> list[tuple[str, TraceSession]]:
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"cannot read: {e}", source=str(p)) from e
    out: list[tuple[str, TraceSession]] = []
    if p.suffix == ".jsonl":
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            src = f"{p}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"invalid JSON: {e}", source=src) from e
            out.append((src, parse_session(obj, src)))
        return out
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"invalid JSON: {e}", source=str(p)) from e
    if isinstance(obj, list):
        return [(f"{p}[{i}]", parse_session(o, f"{p}[{i}]")) for i, o in enumerate(obj)]
    return [(str(p), parse_session(obj, str(p)))]


def trace_files(path: str | os.PathLike) -> list[Path]:
    """The trace files `load_traces` reads: `path` itself, or the *.json / *.jsonl files directly in
    the directory `path`, sorted by name."""
    p = Path(path)
    if p.is_dir():
        return sorted((f for f in p.iterdir()
                       if f.is_file() and f.suffix in (".json", ".jsonl") and not f.name.startswith(".")),
                      key=lambda f: f.name)
    if p.is_file():
        return [p]
    raise TraceError("no such file or directory", source=str(p))


def load_traces(path: str | os.PathLike) -> list[TraceSession]:
    """Load and validate every session under `path` (a file or a directory of *.json / *.jsonl)."""
    files = trace_files(path)
    sessions: list[TraceSession] = []
    seen: dict[str, str] = {}
    for f in files:
        for src, s in _load_file(f):
            if s.id in seen:
                raise TraceError(f"duplicate session id (also in {seen[s.id]})", source=src, session_id=s.id)
            seen[s.id] = src
            sessions.append(s)
    if not sessions:
        raise TraceError("no sessions found (expected *.json or *.jsonl trace files)", source=str(path))
    return sessions


# ---------------------------------------------------------------- walking and measuring


def iter_requests(session: TraceSession) -> Iterator[tuple[str, TraceRequest]]:
    """Every request of the session in document order (depth first), with its thread: "main" for the
    session's own list, the subagent's `agent_id` for a subagent's (a repeated id gets "#2", "#3"...)."""
    used: dict[str, int] = {MAIN_THREAD: 1}

    def walk(items: list[TraceItem], thread: str) -> Iterator[tuple[str, TraceRequest]]:
        for item in items:
            if isinstance(item, TraceRequest):
                yield thread, item
            else:
                n = used.get(item.agent_id, 0) + 1
                used[item.agent_id] = n
                name = item.agent_id if n == 1 else f"{item.agent_id}#{n}"
                yield from walk(item.requests, name)

    yield from walk(session.requests, MAIN_THREAD)


def scope_namespace(session: TraceSession) -> str:
    """The namespace equal hash ids share: "" for global scope, the session id otherwise."""
    return "" if session.hash_id_scope == "global" else session.id


def ceiling(sessions: list[TraceSession]) -> dict:
    """The reuse a perfect, infinite prefix cache would get replaying `sessions` in time order.

    A request's reusable tokens are those of the longest block prefix of its hash ids that was already
    a prefix of an earlier request (same namespace: per session for local scope, corpus-wide for global),
    capped at its input length. Ties in `t` go by session order, then document order."""
    events = []
    for si, s in enumerate(sessions):
        for order, (_, r) in enumerate(iter_requests(s)):
            events.append((r.t, si, order, r))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    trie: dict[tuple[int, int], int] = {}
    roots: dict[str, int] = {}
    next_node = 0
    prompt = reusable = 0
    for _, si, _, r in events:
        s = sessions[si]
        ns = scope_namespace(s)
        node = roots.get(ns)
        if node is None:
            next_node += 1
            node = roots[ns] = next_node
        matched = 0
        ids = r.hash_ids
        for h in ids:
            nxt = trie.get((node, h))
            if nxt is None:
                break
            node = nxt
            matched += 1
        for h in ids[matched:]:
            next_node += 1
            trie[(node, h)] = next_node
            node = next_node
        prompt += r.in_tokens
        reusable += min(matched * s.block_size, r.in_tokens)
    return {"prompt_tokens": prompt, "reusable_tokens": reusable,
            "ratio": reusable / prompt if prompt else 0.0}


def summarize(sessions: list[TraceSession]) -> dict:
    """Corpus statistics: sessions, requests (main thread / subagents), tokens, medians, reuse ceiling."""
    main_counts, inputs = [], []
    n_req = n_sub_req = n_sub = out_tok = 0
    for s in sessions:
        m = 0
        for thread, r in iter_requests(s):
            n_req += 1
            inputs.append(r.in_tokens)
            out_tok += r.out_tokens
            if thread == MAIN_THREAD:
                m += 1
            else:
                n_sub_req += 1
        main_counts.append(m)
        stack = list(s.requests)
        while stack:
            it = stack.pop()
            if isinstance(it, TraceSubagent):
                n_sub += 1
                stack.extend(it.requests)

    def median(xs: list) -> float:
        xs = sorted(xs)
        if not xs:
            return 0.0
        mid = len(xs) // 2
        return float(xs[mid]) if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2

    c = ceiling(sessions)
    return {
        "sessions": len(sessions), "requests": n_req, "main_requests": n_req - n_sub_req,
        "subagent_requests": n_sub_req, "subagents": n_sub,
        "median_main_requests_per_session": median(main_counts),
        "prompt_tokens": c["prompt_tokens"], "output_tokens": out_tok,
        "median_input_tokens": median(inputs), "max_input_tokens": max(inputs, default=0),
        "reusable_tokens": c["reusable_tokens"], "ceiling": c["ratio"],
    }
