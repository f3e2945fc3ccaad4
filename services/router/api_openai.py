"""OpenAI's Chat Completions (`POST /v1/chat/completions`) and Completions (`POST /v1/completions`):
requests into `Parsed`, answers as chat.completion(.chunk) and text_completion objects.

Tool calls stream in OpenAI's delta shape: a call's first delta carries its `index`, `id`, `type` and the
function's `name` with empty `arguments`, the next its `arguments` (the JSON object, whole); the last chunk
says `finish_reason: "tool_calls"`. `tool_choice: "none"` renders the tools (the prompt stays the same every
turn) but reads no calls.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from services.router.api import Api, Output, Parsed, Prepared, Shaper
from services.router.conversation import Conversation, ToolChoice, tool
from services.router.hints import from_body
from services.router.logprobs import LogprobRender
from services.router.schemas import ChatCompletionRequest, CompletionRequest, NamedChoice, OpenAIError
from services.router.tool_calls import Call
from shared.messages import TokenChunk

DONE = b"data: [DONE]\n\n"


def sse(obj: dict, event: str | None = None) -> bytes:
    data = b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
    return (b"event: " + event.encode() + b"\n" + data) if event else data


def make_usage(final: TokenChunk | None, prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI usage + moorage's breakdown, from the final chunk's `usage` (counted here when absent). The
    other APIs reshape this one."""
    got = (final.usage if final is not None else None) or {}
    prompt = int(got.get("prompt_tokens", prompt_tokens))
    completion = int(got.get("completion_tokens", completion_tokens))
    src = dict(got.get("moorage") or {})
    if not src:
        cached = int((got.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0)
        src = {"device": cached, "store": 0, "computed": prompt - cached}
    breakdown = {k: int(src.get(k, 0) or 0) for k in ("device", "store", "computed")}
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": breakdown["device"] + breakdown["store"]},
        "moorage": breakdown,
    }


def tool_call(c: Call) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


@dataclass
class OpenAIShaper(Shaper):
    """Builds the objects of one response; `chat` picks chat.completion vs text_completion shapes."""
    chat: bool
    request_id: str
    model: str
    include_usage: bool = False
    output: Output = field(default_factory=lambda: Output(None))
    created: int = field(default_factory=lambda: int(time.time()))
    render: LogprobRender | None = None  # the request asked for log-probabilities
    pending: list = field(default_factory=list)  # (id, TokenLogprob) pairs not shaped yet

    def add_logprobs(self, pairs) -> None:
        self.pending.extend(pairs)

    def _logprobs(self) -> dict | None:
        """The pending tokens' log-probabilities in this API's shape (taken: shaped once), or None."""
        if self.render is None:
            return None
        pairs, self.pending = self.pending, []
        return self.render.chat(pairs) if self.chat else self.render.completion(pairs)

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id.removeprefix("req-")

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _finish(self, finish_reason: str) -> str:
        return "tool_calls" if self.output.calls else finish_reason

    def full(self, text: str, finish_reason: str, usage: dict) -> dict:
        out = self.output.read_all(text)
        if self.chat:
            message = {"role": "assistant", "content": out.text if out.text or not out.calls else None}
            if out.calls:
                message["tool_calls"] = [tool_call(c) for c in out.calls]
            choice = {"index": 0, "message": message, "logprobs": self._logprobs(),
                      "finish_reason": self._finish(finish_reason)}
            return {**self._base("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": self._logprobs(), "finish_reason": finish_reason}
        return {**self._base("text_completion"), "choices": [choice], "usage": usage}

    def _chunk(self, choice: dict) -> bytes:
        obj = {**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            obj["usage"] = None
        return sse(obj)

    def _delta(self, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> bytes:
        return self._chunk({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})

    def start(self) -> bytes:
        return self._delta({"role": "assistant", "content": ""}) if self.chat else b""

    def _events(self, events, logprobs: dict | None = None) -> bytes:
        """The chunks of these events; `logprobs` ride on the first (a tool-call parser may hold text back,
        so the tokens' numbers can come before their text)."""
        parts = []
        for e in events:
            if isinstance(e, Call):
                parts.append(self._delta({"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                                          "function": {"name": e.name, "arguments": ""}}]},
                                         logprobs=logprobs))
                parts.append(self._delta({"tool_calls": [{"index": e.index, "function": {"arguments": e.arguments}}]}))
            else:
                parts.append(self._delta({"content": e.text}, logprobs=logprobs))
            logprobs = None
        if logprobs is not None:
            parts.append(self._delta({}, logprobs=logprobs))
        return b"".join(parts)

    def delta(self, text: str) -> bytes:
        logprobs = self._logprobs() if self.pending else None
        if not self.chat:
            return self._chunk({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None}) \
                if text or logprobs else b""
        return self._events(self.output.feed(text), logprobs)

    def end(self, finish_reason: str, usage: dict) -> bytes:
        logprobs = self._logprobs() if self.pending else None
        if not self.chat:
            last = self._chunk({"index": 0, "text": "", "logprobs": logprobs, "finish_reason": finish_reason})
        else:
            last = self._events(self.output.finish()) + self._delta({}, self._finish(finish_reason), logprobs)
        tail = sse({**self._base("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                    "usage": usage}) if self.include_usage else b""
        return last + tail + DONE

    def error(self, err: OpenAIError) -> bytes:
        return sse(err.body()) + DONE


def _choice(body: ChatCompletionRequest) -> ToolChoice:
    c = body.tool_choice
    if isinstance(c, NamedChoice):
        return ToolChoice("named", c.function["name"])
    return ToolChoice(c or "auto")


class ChatCompletions(Api):
    endpoint, chat = "chat", True
    schema = ChatCompletionRequest

    def parse(self, raw: bytes) -> Parsed:
        body: ChatCompletionRequest = self.validate(ChatCompletionRequest, raw)
        tools = [tool(t.function.name, t.function.description, t.function.parameters, f"tools[{i}].function")
                 for i, t in enumerate(body.tools or [])]
        conv = Conversation([m.turn() for m in body.messages], tools, _choice(body),
                            body.parallel_tool_calls is not False,
                            body.response_format.schema() if body.response_format else None)
        return Parsed(body.model, bool(body.stream), conversation=conv, max_tokens=body.requested_max_tokens(),
                      temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop=body.stop_list(),
                      ignore_eos=bool(body.ignore_eos), hints=from_body(body), logprobs=body.logprobs_count(),
                      session_hint=body.prompt_cache_key or body.user,
                      include_usage=body.include_usage)

    def shaper(self, prepared: Prepared, request_id: str) -> Shaper:
        p = prepared.parsed
        return OpenAIShaper(True, request_id, p.model, p.include_usage, Output(prepared.parser()),
                            render=_render(prepared))


class Completions(Api):
    endpoint, chat = "completions", False
    schema = CompletionRequest

    def parse(self, raw: bytes) -> Parsed:
        body: CompletionRequest = self.validate(CompletionRequest, raw)
        return Parsed(body.model, bool(body.stream), prompt=body.prompt, max_tokens=body.requested_max_tokens(),
                      temperature=body.temperature, top_p=body.top_p, seed=body.seed, stop=body.stop_list(),
                      ignore_eos=bool(body.ignore_eos), hints=from_body(body), logprobs=body.logprobs_count(),
                      session_hint=body.prompt_cache_key or body.user,
                      include_usage=body.include_usage)

    def shaper(self, prepared: Prepared, request_id: str) -> Shaper:
        p = prepared.parsed
        return OpenAIShaper(False, request_id, p.model, p.include_usage, render=_render(prepared))


def _render(prepared: Prepared) -> LogprobRender | None:
    return LogprobRender(prepared.tokenizer) if prepared.tokenizer is not None else None
