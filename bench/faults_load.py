"""The load of bench/faults.py: one request and how it ended (`Result`), multi-turn clients, a prober
for the first success after a fault, a disconnect storm and an overload burst.

Every request is greedy (temperature 0, ignore_eos), so each completed answer, and the text a stream
got before it was cut, can be compared with the in-process engine (bench/faults_reference.py).

Outcomes:
- ok: 200 with a whole answer (a stream: a finish_reason, then `data: [DONE]`)
- sse_error: a stream that ended with an OpenAI-shaped error event, then `data: [DONE]`
- 503 / 429: a JSON error body with Retry-After
- dropped: the connection closed or was refused (the router's process is gone: nothing else can answer)
- client_closed: the client hung up on purpose (the storm)
- other: anything else: a plain-text 500, another status, a malformed body, a stream cut without [DONE]
  while the router lives, a hang past the request timeout
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

OUTCOMES = ("ok", "sse_error", "503", "429", "dropped", "client_closed", "other")
CLEAN = {"ok", "sse_error", "503", "429"}
ERROR_KEYS = {"message", "type", "param", "code"}
SYSTEM = ("You are a careful assistant on a harbour. You answer questions about moorings, tides, knots and "
          "boats briefly and precisely, and you never make things up.\n")
QUESTIONS = ["How do I tie a bowline?", "When is high tide?", "What is a cleat for?", "How long is a fathom?",
             "Why do boats have fenders?", "What does port mean?", "How deep is the harbour?",
             "Which knot holds best in rain?", "What is a spring line?", "How do I read a tide table?"]


@dataclass
class Result:
    kind: str            # load | probe | storm | burst
    stream: bool
    prompt: str
    max_tokens: int
    start: float         # time.monotonic()
    end: float = 0.0
    outcome: str = "other"
    status: int = 0
    text: str = ""       # the answer, or what a stream got before it ended
    complete: bool = False
    detail: str = ""
    retry_after: float | None = None


def _error_json(r: httpx.Response, body: bytes) -> dict | None:
    if not r.headers.get("content-type", "").startswith("application/json"):
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    err = obj.get("error") if isinstance(obj, dict) else None
    return err if isinstance(err, dict) and ERROR_KEYS <= set(err) else None


def _classify_status(res: Result, r: httpx.Response, body: bytes) -> None:
    res.status = r.status_code
    err = _error_json(r, body)
    retry = r.headers.get("retry-after")
    if r.status_code in (503, 429) and err is not None and retry is not None and retry.isdigit():
        res.outcome, res.retry_after = str(r.status_code), float(retry)
        res.detail = str(err.get("code"))
    else:
        res.outcome, res.detail = "other", f"HTTP {r.status_code}: {body[:200].decode(errors='replace')}"


async def _read_stream(res: Result, r: httpx.Response, stop_after: int | None) -> None:
    """SSE: text deltas until finish + [DONE] (ok), an error event + [DONE] (sse_error), or a cut."""
    parts, finished, error, events = [], False, None, 0
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            res.text = "".join(parts)
            if error is not None:
                res.outcome, res.detail = "sse_error", str(error.get("code"))
            elif finished:
                res.outcome, res.complete = "ok", True
            else:
                res.outcome, res.detail = "other", "[DONE] without a finish_reason"
            return
        try:
            event = json.loads(line[6:])
        except ValueError:
            res.outcome, res.detail = "other", f"malformed SSE data: {line[:120]}"
            return
        if "error" in event:
            error = event["error"] if isinstance(event["error"], dict) and ERROR_KEYS <= set(event["error"]) \
                else {"code": "malformed"}
            continue
        for choice in event.get("choices", []):
            parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
            finished = finished or choice.get("finish_reason") is not None
        events += 1
        if stop_after is not None and events >= stop_after:
            res.text, res.outcome = "".join(parts), "client_closed"
            return
    res.text = "".join(parts)
    res.outcome, res.detail = "other", "stream ended without [DONE]"


async def send(http: httpx.AsyncClient, kind: str, prompt: str, max_tokens: int, stream: bool,
               timeout_s: float, stop_after: int | None = None, close_after_s: float | None = None) -> Result:
    """One completion through the router, classified. `stop_after` events or `close_after_s` seconds:
    the client hangs up (the storm)."""
    res = Result(kind, stream, prompt, max_tokens, time.monotonic())
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}

    async def go() -> None:
        if not stream:
            r = await http.post("/v1/completions", json=body)
            if r.status_code == 200:
                try:
                    choice = r.json()["choices"][0]
                    res.text, res.status = choice["text"], 200
                    res.outcome, res.complete = ("ok", True) if choice.get("finish_reason") else ("other", False)
                except (ValueError, KeyError, IndexError, TypeError):
                    res.outcome, res.detail = "other", f"malformed 200: {r.text[:200]}"
            else:
                _classify_status(res, r, r.content)
            return
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                _classify_status(res, r, await r.aread())
                return
            res.status = 200
            await _read_stream(res, r, stop_after)

    limit = timeout_s if close_after_s is None else min(timeout_s, close_after_s)
    try:
        await asyncio.wait_for(go(), limit)
    except asyncio.TimeoutError:
        res.outcome, res.detail = ("client_closed", "closed") if close_after_s is not None else \
            ("other", f"no end within {timeout_s:g} s")
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        res.outcome, res.detail = "dropped", type(e).__name__
    except httpx.HTTPError as e:
        res.outcome, res.detail = "other", f"{type(e).__name__}: {e}"
    res.end = time.monotonic()
    return res


@dataclass
class LoadShape:
    clients: int = 4
    max_tokens: int = 24
    max_prompt_bytes: int = 800     # a conversation starts over past this many prompt tokens (tiny: bytes)
    request_timeout_s: float = 60.0  # a request not ended by then is a hang ("other")
    retry_cap_s: float = 1.0         # a client waits min(Retry-After, this) before trying the turn again


@dataclass
class Load:
    """Multi-turn clients (half streaming, half not), each sending its next turn when the last ended.
    Every result lands in `results`; `on_result` is told of each (the harness waits on it)."""
    base_url: str
    shape: LoadShape
    on_result: Callable[[Result], None]
    results: list[Result] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.running = asyncio.Event()
        self.turns = [0] * self.shape.clients

    def record(self, res: Result) -> Result:
        self.results.append(res)
        self.on_result(res)
        return res

    async def client(self, i: int, http: httpx.AsyncClient) -> None:
        transcript = SYSTEM
        stream = i % 2 == 0
        while self.running.is_set():
            question = QUESTIONS[(i + self.turns[i]) % len(QUESTIONS)]
            prompt = f"{transcript}User {i}: {question}\nAssistant:"
            res = self.record(await send(http, "load", prompt, self.shape.max_tokens, stream,
                                         self.shape.request_timeout_s))
            if res.outcome == "ok":
                self.turns[i] += 1
                transcript = prompt + res.text + "\n"
                if len(transcript.encode()) > self.shape.max_prompt_bytes:
                    transcript = SYSTEM
            else:
                await asyncio.sleep(min(res.retry_after or 0.2, self.shape.retry_cap_s))

    async def run(self) -> None:
        """Until `running` is cleared (each client finishes its current request)."""
        self.running.set()
        async with httpx.AsyncClient(base_url=self.base_url, timeout=None,
                                     limits=httpx.Limits(max_connections=64)) as http:
            await asyncio.gather(*(self.client(i, http) for i in range(self.shape.clients)))


async def probe_until_success(base_url: str, record: Callable[[Result], Result], since: float, within: float,
                              gap_s: float = 0.25) -> float | None:
    """New small requests, one at a time, from `since` on: seconds from `since` to the end of the first
    that succeeded, or None within `within`. A fresh connection each time (the router may be new)."""
    while time.monotonic() - since < within:
        async with httpx.AsyncClient(base_url=base_url, timeout=None) as http:
            res = record(await send(http, "probe", SYSTEM + "User: ping\nAssistant:", 4, False,
                                    max(1.0, within - (time.monotonic() - since))))
        if res.outcome == "ok":
            return res.end - since
        await asyncio.sleep(gap_s)
    return None


async def storm(base_url: str, record: Callable[[Result], Result], streams: int, max_tokens: int,
                stop_after: int, close_after_s: float) -> None:
    """`streams` streams at once, each closed by the client after `stop_after` events (mid-way) or after
    `close_after_s` (queued at the gate or still waiting for its first token)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=None,
                                 limits=httpx.Limits(max_connections=streams + 8)) as http:
        async def one(k: int) -> None:
            prompt = f"{SYSTEM}User storm-{k}: tell me a long story about rope number {k}.\nAssistant:"
            record(await send(http, "storm", prompt, max_tokens, True, 60.0, stop_after=stop_after,
                              close_after_s=close_after_s))
        await asyncio.gather(*(one(k) for k in range(streams)))


async def burst(base_url: str, record: Callable[[Result], Result], requests: int, prompt_bytes: int,
                max_tokens: int, timeout_s: float, priority: int | None = None, tag: str = "burst") -> None:
    """`requests` at once whose reservations together exceed the gate's budget: the rest wait, and what
    waits past gate.admission_wait_s is a 429 with Retry-After. `priority`: each says it (x-request-priority),
    one tenant flooding at its ceiling, ahead of everyone else in the gate's queue and prefill's order.
    `tag` starts every prompt's lines: bursts with different tags share no prefix past the system prompt, so a
    later burst is as cold as the first (the same prompts again were served from the prefix cache, the queue
    drained within admission_wait_s, and the burst overran nothing)."""
    headers = {"x-request-priority": str(priority)} if priority is not None else {}
    async with httpx.AsyncClient(base_url=base_url, timeout=None, headers=headers,
                                 limits=httpx.Limits(max_connections=requests + 8)) as http:
        async def one(k: int) -> None:
            line = f"User {tag}-{k}: list every knot you know, number {k}.\n"
            prompt = SYSTEM + line * max(1, (prompt_bytes - len(SYSTEM)) // len(line)) + "Assistant:"
            record(await send(http, "burst", prompt, max_tokens, k % 2 == 0, timeout_s))
        await asyncio.gather(*(one(k) for k in range(requests)))
