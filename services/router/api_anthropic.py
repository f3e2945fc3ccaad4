"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): what Claude Code and the
anthropic SDK speak.

Requests: `system` (a string or text blocks), user and assistant turns of text, `tool_use` and
`tool_result` blocks, `tools` with `input_schema`, `tool_choice` (auto, any, tool, none;
`disable_parallel_tool_use`), `stop_sequences`, `metadata.user_id` (names the session), and system turns
among the messages (Claude Code sends them). Thinking blocks in the history are dropped, and `thinking`
settings ignored (this model does not think aloud); image and document blocks are a 400. A `max_tokens` past
the model's context is cut to the room left (Claude Code asks for 32,000 whatever the model).
Answers: text and `tool_use` content blocks, `stop_reason` end_turn / max_tokens / tool_use, and usage
with `cache_read_input_tokens` from moorage's own count (`input_tokens` is the rest, as Anthropic counts).
Streams follow Anthropic's event order, with a ping after the first block opens. Errors are Anthropic's
shape: {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import Field, field_validator, model_validator

from services.router.api import Api, Output, Parsed, Prepared, Shaper
from services.router.api_openai import sse
from services.router.conversation import Conversation, ToolChoice, tool
from services.router.hints import from_body
from services.router.schemas import INT64_MAX, Hinted, OpenAIError, _Lenient
from services.router.tool_calls import Call

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 504: "api_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


class Block(_Lenient):
    type: str
    text: str | None = None
    id: str | None = None              # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None     # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None

    @model_validator(mode="after")
    def _known(self):
        if self.type in ("image", "document", "audio", "search_result"):
            raise ValueError(f"content blocks of type {self.type!r} are not supported: this model reads text only")
        need = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",)}
        missing = [f for f in need.get(self.type, ()) if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type!r} block needs {', '.join(missing)}")
        return self

    def result_text(self) -> str:
        c = self.content
        text = c if isinstance(c, str) else "".join(b.get("text", "") for b in c or () if isinstance(b, dict))
        return f"Error: {text}" if self.is_error else text


class Message(_Lenient):
    role: Literal["user", "assistant", "system"]  # system: a mid-conversation system message (Claude Code's)
    content: str | list[Block]


class ToolSpec(_Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None

    @field_validator("type")
    @classmethod
    def _custom(cls, v: str | None) -> str | None:
        if v not in (None, "custom"):
            raise ValueError(f"server tools ({v!r}) are not supported: define the tool with an input_schema")
        return v


class Choice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Lenient):
    user_id: str | None = None


class MessagesRequest(Hinted):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)]
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: int | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Choice | None = None
    metadata: Metadata | None = None


class CountTokensRequest(MessagesRequest):
    max_tokens: int | None = None  # type: ignore[assignment]


def _system_text(system: str | list[Block] | None) -> str:
    if system is None:
        return ""
    return system if isinstance(system, str) else "\n\n".join(b.text or "" for b in system if b.type == "text")


def _turns(body: MessagesRequest) -> list[dict]:
    turns = [{"role": "system", "content": s}] if (s := _system_text(body.system)) else []
    for m in body.messages:
        if isinstance(m.content, str):
            turns.append({"role": m.role, "content": m.content})
            continue
        text = "".join(b.text or "" for b in m.content if b.type == "text")
        if m.role == "system":
            turns.append({"role": "system", "content": text})
            continue
        if m.role == "assistant":
            calls = [{"id": b.id, "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}
                     for b in m.content if b.type == "tool_use"]
            turns.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
            continue
        turns += [{"role": "tool", "content": b.result_text(), "tool_call_id": b.tool_use_id}
                  for b in m.content if b.type == "tool_result"]
        if text or not any(b.type == "tool_result" for b in m.content):
            turns.append({"role": "user", "content": text})
    return turns


def conversation(body: MessagesRequest) -> Conversation:
    tools = [tool(t.name, t.description, t.input_schema, f"tools[{i}]") for i, t in enumerate(body.tools or [])]
    c = body.tool_choice
    choice = ToolChoice() if c is None else ToolChoice({"auto": "auto", "any": "required", "tool": "named",
                                                        "none": "none"}[c.type], c.name or "")
    if c is not None and c.type == "tool" and not c.name:
        raise OpenAIError(400, "tool_choice of type 'tool' needs a name", param="tool_choice.name")
    return Conversation(_turns(body), tools, choice, not (c and c.disable_parallel_tool_use))


def usage(u: dict) -> dict:
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def error_body(err: OpenAIError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def _tool_use(c: Call) -> dict:
    return {"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}


class AnthropicShaper(Shaper):
    def __init__(self, request_id: str, model: str, prepared: Prepared):
        self.id = "msg_" + request_id.removeprefix("req-")
        self.model, self.prompt_tokens = model, prepared.prompt_tokens
        self.output = Output(prepared.parser("toolu_"))
        self.index = -1          # the open content block, or the last one
        self.text_open = False

    def _message(self, content: list, stop_reason: str | None, usage_: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": None, "usage": usage_}

    def _stop_reason(self, finish_reason: str) -> str:
        return "tool_use" if self.output.calls else STOP_REASONS.get(finish_reason, "end_turn")

    def full(self, text: str, finish_reason: str, usage_: dict) -> dict:
        out = self.output.read_all(text)
        content = ([{"type": "text", "text": out.text}] if out.text else []) + [_tool_use(c) for c in out.calls]
        return self._message(content, self._stop_reason(finish_reason), usage(usage_))

    def start(self) -> bytes:
        head = self._message([], None, {"input_tokens": self.prompt_tokens, "output_tokens": 0,
                                        "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0})
        return sse({"type": "message_start", "message": head}, "message_start")

    def _open(self, block: dict) -> bytes:
        self.index += 1
        out = sse({"type": "content_block_start", "index": self.index, "content_block": block}, "content_block_start")
        return out + (sse({"type": "ping"}, "ping") if self.index == 0 else b"")

    def _close(self) -> bytes:
        return sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")

    def _events(self, events) -> bytes:
        parts = []
        for e in events:
            if isinstance(e, Call):
                if self.text_open:
                    parts.append(self._close())
                    self.text_open = False
                parts.append(self._open({"type": "tool_use", "id": e.id, "name": e.name, "input": {}}))
                parts.append(sse({"type": "content_block_delta", "index": self.index,
                                  "delta": {"type": "input_json_delta", "partial_json": e.arguments}},
                                 "content_block_delta"))
                parts.append(self._close())
                continue
            if not self.text_open:
                parts.append(self._open({"type": "text", "text": ""}))
                self.text_open = True
            parts.append(sse({"type": "content_block_delta", "index": self.index,
                              "delta": {"type": "text_delta", "text": e.text}}, "content_block_delta"))
        return b"".join(parts)

    def delta(self, text: str) -> bytes:
        return self._events(self.output.feed(text))

    def end(self, finish_reason: str, usage_: dict) -> bytes:
        out = self._events(self.output.finish())
        if self.text_open:
            out += self._close()
        if self.index < 0:  # an empty answer still has its (empty) text block
            out += self._open({"type": "text", "text": ""}) + self._close()
        out += sse({"type": "message_delta", "delta": {"stop_reason": self._stop_reason(finish_reason),
                                                       "stop_sequence": None}, "usage": usage(usage_)},
                   "message_delta")
        return out + sse({"type": "message_stop"}, "message_stop")

    def error(self, err: OpenAIError) -> bytes:
        return sse(error_body(err), "error")


class Messages(Api):
    endpoint, chat = "messages", True
    clamps_max_tokens = True  # Claude Code asks for 32,000 whatever the model's context: it gets the room left
    schema = MessagesRequest

    def parse(self, raw: bytes) -> Parsed:
        body: MessagesRequest = self.validate(MessagesRequest, raw)
        return Parsed(body.model, bool(body.stream), conversation=conversation(body), max_tokens=body.max_tokens,
                      temperature=body.temperature, top_p=body.top_p, stop=list(body.stop_sequences or []),
                      hints=from_body(body), session_hint=body.metadata.user_id if body.metadata else None)

    def shaper(self, prepared: Prepared, request_id: str) -> Shaper:
        return AnthropicShaper(request_id, prepared.parsed.model, prepared)

    def error_response(self, err: OpenAIError) -> JSONResponse:
        return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)
