"""Request bodies of the OpenAI API (the fields the router honours) and OpenAI-shaped errors.

Validation is strict about the types of known fields (a string where a number belongs is a 400, not a
silent coercion) and tolerant of unknown fields (ignored), as OpenAI clients send many. Chat carries tool
calling (`tools`, `tool_choice`, `parallel_tool_calls`, assistant `tool_calls`, `tool` turns) and
`response_format` (text, json_object, json_schema), and both APIs per-token `logprobs` (chat: `logprobs` +
`top_logprobs`; completions: `logprobs` as a count). OpenAI features the router does not implement (legacy
`functions`, n > 1, best_of, echo, suffix, image or audio parts) are a 400 naming the field, never silently
ignored; their neutral values (n=1, echo=false, ...) are accepted. The models
double as the request bodies of the published OpenAPI schema (app.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from shared.engine.sampling import MAX_LOGPROBS, MAX_STOP_CHARS
from shared.engine.sampling import MAX_STOP_SEQUENCES as MAX_STOP

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


class OpenAIError(Exception):
    """Any failure the client sees: HTTP status + the OpenAI error object."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or default_type(status)
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def default_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """The first problem, phrased for a person, with its JSON path as `param`."""
    errors = exc.errors(include_url=False)
    # in a union every branch reports; our own checks (value_error) or the deepest path say the most
    err = next((e for e in errors if e["type"] == "value_error"), None) or max(errors, key=lambda e: len(e["loc"]))
    if err["type"] == "json_invalid":
        return OpenAIError(400, f"could not parse the request body as JSON: {err['msg']}")
    loc = ".".join(str(p) for i, p in enumerate(err["loc"])
                   if not _is_union_tag(p) and not (i and isinstance(err["loc"][i - 1], int) and p in _ROLE_TAGS))
    if err["type"] == "model_type" and not loc:
        return OpenAIError(400, "the request body must be a JSON object")
    msg = err["msg"].removeprefix("Value error, ")
    return OpenAIError(400, f"{loc}: {msg}" if loc else msg, param=loc or None)


_ROLE_TAGS = {"system", "developer", "user", "assistant", "tool"}  # a message's discriminator in an error's path


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


class _Lenient(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class AgentHints(_Lenient):
    """Dynamo's nvext.agent_hints (services/router/hints.py)."""
    priority: Annotated[int, Field(ge=-1000, le=1000)] | None = None  # higher first
    latency_sensitivity: Annotated[float, Field(ge=0.0, le=3600.0, allow_inf_nan=False)] | None = None
    osl: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None  # expected output tokens: the gate's reservation


class SessionControl(_Lenient):
    """Dynamo's nvext.session_control: `close` frees the session's KV once this request has ended."""
    action: Literal["open", "close"]


class NvExt(_Lenient):
    agent_hints: AgentHints | None = None
    session_control: SessionControl | None = None


class Hinted(_Lenient):
    """The agent hints every generation API accepts."""
    priority: Annotated[int, Field(ge=-1000, le=1000)] | None = None  # vLLM's: lower first
    nvext: NvExt | None = None


class StreamOptions(_Lenient):
    include_usage: bool | None = False


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema")
        return self

    def schema(self) -> dict | None:
        """The JSON schema the answer must match, or None (plain text)."""
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema.schema_ if self.type == "json_schema" else None


def _reject(field: str, what: str, *neutral):
    """A validator for an unimplemented feature: `field` may be None or a `neutral` value (same type and
    value: False is not 0), anything else is a 400 naming the field."""
    def check(cls, v):
        if v is not None and not any(type(v) is type(n) and v == n for n in neutral):
            raise ValueError(f"{what} not supported by this server")
        return v
    return field_validator(field)(classmethod(check))


class ContentPart(_Lenient):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type not in ("text", "input_text", "output_text"):
            raise ValueError(f"content parts of type {self.type!r} are not supported (only 'text'): this model "
                             "reads text only")
        if self.text is None:
            raise ValueError("a 'text' content part needs a 'text' string")
        return self


class FunctionCall(_Lenient):
    name: Annotated[str, Field(min_length=1)]
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            ok = isinstance(json.loads(v or "{}"), dict)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError("arguments must be a JSON object, as a string")
        return v


class ToolCallItem(_Lenient):
    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedChoice(_Lenient):
    type: Literal["function"]
    function: dict[str, Any]

    @field_validator("function")
    @classmethod
    def _named(cls, v: dict) -> dict:
        if not isinstance(v.get("name"), str):
            raise ValueError("tool_choice.function.name must be a string")
        return v


def message_text(content: str | list[ContentPart] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(p.text or "" for p in content)


class _Message(_Lenient):
    content: str | list[ContentPart] | None = None  # None: e.g. an assistant turn that only called tools
    name: str | None = None

    def text(self) -> str:
        return message_text(self.content)

    def turn(self) -> dict:
        """The message in the template convention (services/router/conversation.py)."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class SystemMessage(_Message):
    role: Literal["system", "developer"]


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]
    tool_calls: list[ToolCallItem] | None = None

    def turn(self) -> dict:
        out = super().turn()
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                                 for c in self.tool_calls]
        return out


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: Annotated[str, Field(min_length=1)]

    def turn(self) -> dict:
        return {**super().turn(), "tool_call_id": self.tool_call_id}


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class _GenerationRequest(Hinted):
    """Fields shared by chat and text completions."""
    model: str
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None  # < 1e-5: greedy
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    ignore_eos: bool | None = False  # extension (vLLM): keep generating past EOS
    user: str | None = None
    prompt_cache_key: str | None = None  # names the session (routing), as OpenAI's prompt caching

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("n other than 1 is not supported by this server (one choice per request)")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop sequence must be at most {MAX_STOP_CHARS} characters")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # not implemented: only their neutral values are accepted
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None

    _no_functions = _reject("functions", "functions (legacy function calling; use tools) are", [])
    _no_function_call = _reject("function_call", "function_call (legacy; use tool_choice) other than 'none' or "
                                                 "'auto' is", "none", "auto")

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_count(self) -> int | None:
        """How many alternatives each token's log-probabilities list (SamplingParams.logprobs); None: off."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str]
    logprobs: bool | Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # how many alternatives per token
    # not implemented: only their neutral values are accepted
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    _no_echo = _reject("echo", "echo is", False)
    _no_suffix = _reject("suffix", "suffix is", "")
    _no_best_of = _reject("best_of", "best_of other than 1 is", 1)

    @field_validator("logprobs")
    @classmethod
    def _logprobs_count(cls, v):
        if v is True:
            raise ValueError(f"completions take a number of alternatives per token (0-{MAX_LOGPROBS}), not true")
        return v

    def logprobs_count(self) -> int | None:
        return None if self.logprobs is None or self.logprobs is False else self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str) and len(v) != 1:
            raise ValueError("only one prompt per request is supported")
        return v
