"""OpenAI's Responses API (`POST /v1/responses`), stateless: what Codex CLI speaks.

Requests: `input` as a string or items (messages with text parts, `function_call`, `function_call_output`;
`reasoning` items are dropped), `instructions`, function `tools`, `tool_choice`, `parallel_tool_calls`,
`max_output_tokens`, `text.format` (text, json_object, json_schema), `prompt_cache_key` / `user` (the
session), `top_logprobs` and `include: ["message.output_text.logprobs"]` (each text token's log-probability,
in `output_text.logprobs` and on each `output_text.delta` event; a tool call's tokens have none). Nothing is
stored: `store: true` is answered as if false (the response cannot be fetched later), and
`previous_response_id` is a 400. A namespace's function tools are offered as tools of their own; hosted
tools (web search, file search, ...: run by a provider, and moorage has none) are not offered to the model;
any other tool type is a 400 naming it.
Answers: a `message` item with `output_text`, and `function_call` items; `status` completed, or incomplete
(`max_output_tokens`). Streams: response.created, response.in_progress, then per item
response.output_item.added / content_part.added / output_text.delta / output_text.done / content_part.done /
output_item.done (function calls: function_call_arguments.delta / .done), then response.completed; an error
is response.failed.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from services.router.api import Api, Output, Parsed, Prepared, Shaper
from services.router.api_openai import sse
from services.router.conversation import Conversation, ToolChoice, tool
from services.router.hints import from_body
from services.router.logprobs import LogprobRender
from services.router.schemas import INT64_MAX, ContentPart, Hinted, OpenAIError, _Lenient, message_text
from services.router.tool_calls import Call, Text
from shared.engine.sampling import MAX_LOGPROBS

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class Item(_Lenient):
    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None          # function_call, function_call_output
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None

    @model_validator(mode="after")
    def _known(self):
        need = {"message": ("role",), "function_call": ("call_id", "name", "arguments"),
                "function_call_output": ("call_id", "output")}
        if self.type not in need and self.type != "reasoning":
            raise ValueError(f"input items of type {self.type!r} are not supported")
        missing = [f for f in need.get(self.type, ()) if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type!r} item needs {', '.join(missing)}")
        return self


# Tools the provider runs itself: moorage has none of them, so the model is not offered them (Codex always
# sends web_search, with external_web_access false); any other type is a 400 naming it.
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                "computer_use_preview", "mcp")


class FunctionTool(_Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list["FunctionTool"] | None = None  # a namespace's own tools (Codex groups some this way)

    @field_validator("type")
    @classmethod
    def _function(cls, v: str) -> str:
        if v not in ("function", "namespace") and not v.startswith(HOSTED_TOOLS):
            raise ValueError(f"tools of type {v!r} are not supported (function, namespace, or a hosted tool, "
                             "which is not offered to the model)")
        return v

    def functions(self) -> list["FunctionTool"]:
        """The function tools this entry stands for: itself, a namespace's members, or none (hosted)."""
        if self.type == "function":
            return [self]
        return [f for t in self.tools or () for f in t.functions()] if self.type == "namespace" else []


class NamedTool(_Lenient):
    type: Literal["function"]
    name: str


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    name: str | None = None
    strict: bool | None = None


class TextOptions(_Lenient):
    format: TextFormat | None = None


class ResponsesRequest(Hinted):
    model: str
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    stream: bool | None = False
    store: bool | None = None
    previous_response_id: str | None = None
    text: TextOptions | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    include: list[str] | None = None

    def logprobs_count(self) -> int | None:
        """Log-probabilities are returned when `include` names them or `top_logprobs` asks for alternatives."""
        if LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs:
            return self.top_logprobs or 0
        return None

    @field_validator("previous_response_id")
    @classmethod
    def _stateless(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("previous_response_id is not supported: this server stores no responses (send the "
                             "whole input each turn)")
        return v


def _turns(body: ResponsesRequest) -> list[dict]:
    turns = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return turns + [{"role": "user", "content": body.input}]
    for item in body.input:
        if item.type == "message":
            turns.append({"role": "system" if item.role == "developer" else item.role,
                          "content": message_text(item.content)})
        elif item.type == "function_call":
            call = {"id": item.call_id, "name": item.name, "arguments": item.arguments}
            if turns and turns[-1]["role"] == "assistant":  # its text and its calls (parallel too): one turn
                turns[-1].setdefault("tool_calls", []).append(call)
            else:
                turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif item.type == "function_call_output":
            out = item.output if isinstance(item.output, str) else message_text(item.output)
            turns.append({"role": "tool", "content": out, "tool_call_id": item.call_id})
    return turns


def conversation(body: ResponsesRequest) -> Conversation:
    functions = [(f"tools[{i}]", f) for i, t in enumerate(body.tools or []) for f in t.functions()]
    for where, f in functions:
        if not f.name:
            raise OpenAIError(400, f"{where}.name is required", param=f"{where}.name")
    tools = [tool(f.name, f.description, f.parameters, where) for where, f in functions]
    c = body.tool_choice
    choice = ToolChoice("named", c.name) if isinstance(c, NamedTool) else ToolChoice(c or "auto")
    fmt = body.text.format if body.text and body.text.format else None
    schema = None
    if fmt is not None and fmt.type == "json_object":
        schema = {"type": "object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise OpenAIError(400, "text.format of type 'json_schema' needs a schema", param="text.format.schema")
        schema = fmt.schema_
    return Conversation(_turns(body), tools, choice, body.parallel_tool_calls is not False, schema)


def usage(u: dict) -> dict:
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"], "moorage": u["moorage"]}


class ResponsesShaper(Shaper):
    def __init__(self, request_id: str, prepared: Prepared):
        self.id = "resp_" + request_id.removeprefix("req-")
        self.parsed, self.created = prepared.parsed, int(time.time())
        self.output = Output(prepared.parser())
        self.items: list[dict] = []     # output items so far (the last may still be open)
        self.text_open = False
        self.seq = 0
        self.render = LogprobRender(prepared.tokenizer) if prepared.tokenizer is not None else None
        self.pending: list = []         # (id, TokenLogprob) pairs not shaped yet

    def add_logprobs(self, pairs) -> None:
        self.pending.extend(pairs)

    def _logprobs(self) -> list:
        """The pending tokens' entries (chat's shape), taken. They belong to the answer's text: those of a
        tool call's tokens are dropped with the call (`_events`)."""
        pairs, self.pending = self.pending, []
        return self.render.chat(pairs)["content"] if self.render is not None else []

    def _text_part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [],
                **({"logprobs": []} if self.render is not None else {})}

    def _response(self, status: str, usage_: dict | None = None, incomplete: str | None = None,
                  error: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.parsed.model, "output": self.items, "usage": usage_, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None,
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "store": False,
                "text": {"format": {"type": "text"}}}

    def _event(self, kind: str, **fields) -> bytes:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **fields}, kind)

    def _status(self, finish_reason: str) -> tuple[str, str | None]:
        return ("incomplete", "max_output_tokens") if finish_reason == "length" and not self.output.calls \
            else ("completed", None)

    def _message_item(self) -> dict:
        return {"type": "message", "id": f"msg_{self.id[5:]}_{len(self.items)}", "status": "in_progress",
                "role": "assistant", "content": []}

    def _call_item(self, c: Call) -> dict:
        return {"type": "function_call", "id": f"fc_{c.id[5:]}", "call_id": c.id, "name": c.name,
                "arguments": c.arguments, "status": "completed"}

    def full(self, text: str, finish_reason: str, usage_: dict) -> dict:
        out = self.output.read_all(text)
        if out.text or not out.calls:
            item = self._message_item()
            part = self._text_part(out.text)
            if self.render is not None:
                part["logprobs"] = self._logprobs()
            item.update(status="completed", content=[part])
            self.items.append(item)
        self.items += [self._call_item(c) for c in out.calls]
        status, incomplete = self._status(finish_reason)
        return self._response(status, usage(usage_), incomplete)

    def start(self) -> bytes:
        r = self._response("in_progress")
        return self._event("response.created", response=r) + self._event("response.in_progress", response=r)

    def _close_text(self) -> bytes:
        item, i = self.items[-1], len(self.items) - 1
        text = item["content"][0]["text"]
        part = dict(item["content"][0])
        item["status"] = "completed"
        self.text_open = False
        return (self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0, text=text)
                + self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                              part=part)
                + self._event("response.output_item.done", output_index=i, item=item))

    def _events(self, events: list[Text | Call]) -> bytes:
        parts = []
        for e in events:
            if isinstance(e, Call):
                self.pending = []  # the call's own tokens: no text holds them
                if self.text_open:
                    parts.append(self._close_text())
                item, i = self._call_item(e), len(self.items)
                self.items.append(item)
                parts.append(self._event("response.output_item.added", output_index=i,
                                         item={**item, "arguments": "", "status": "in_progress"}))
                parts.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=i, delta=e.arguments))
                parts.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=i, arguments=e.arguments))
                parts.append(self._event("response.output_item.done", output_index=i, item=item))
                continue
            if not self.text_open:
                item, i = self._message_item(), len(self.items)
                self.items.append(item)
                self.text_open = True
                parts.append(self._event("response.output_item.added", output_index=i, item=dict(item, content=[])))
                item["content"] = [self._text_part("")]
                parts.append(self._event("response.content_part.added", item_id=item["id"], output_index=i,
                                         content_index=0, part=dict(item["content"][0])))
            item, i = self.items[-1], len(self.items) - 1
            item["content"][0]["text"] += e.text
            logprobs = {}
            if self.render is not None:
                logprobs = {"logprobs": self._logprobs()}
                item["content"][0]["logprobs"] = item["content"][0]["logprobs"] + logprobs["logprobs"]
            parts.append(self._event("response.output_text.delta", item_id=item["id"], output_index=i,
                                     content_index=0, delta=e.text, **logprobs))
        return b"".join(parts)

    def delta(self, text: str) -> bytes:
        return self._events(self.output.feed(text))

    def end(self, finish_reason: str, usage_: dict) -> bytes:
        out = self._events(self.output.finish())
        if self.text_open and self.pending:  # tokens after the last text (an ending with no text of its own)
            self.items[-1]["content"][0]["logprobs"] += self._logprobs()
        if self.text_open:
            out += self._close_text()
        status, incomplete = self._status(finish_reason)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._event(kind, response=self._response(status, usage(usage_), incomplete))

    def error(self, err: OpenAIError) -> bytes:
        failed = self._response("failed", error={"code": err.code or err.type, "message": err.message})
        return self._event("response.failed", response=failed)


class Responses(Api):
    endpoint, chat = "responses", True
    schema = ResponsesRequest

    def parse(self, raw: bytes) -> Parsed:
        body: ResponsesRequest = self.validate(ResponsesRequest, raw)
        return Parsed(body.model, bool(body.stream), conversation=conversation(body),
                      max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p,
                      hints=from_body(body), session_hint=body.prompt_cache_key or body.user,
                      logprobs=body.logprobs_count())

    def shaper(self, prepared: Prepared, request_id: str) -> Shaper:
        return ResponsesShaper(request_id, prepared)
