"""Request bodies of the OpenAI API (the fields the router honours) and OpenAI-shaped errors.

Validation is strict about the types of known fields (a string where a number belongs is a 400, not a
silent coercion) and tolerant of unknown fields (ignored), as OpenAI clients send many. OpenAI features
the router does not implement (logprobs, tools / functions, n > 1, best_of, echo, suffix, a non-text
response_format) are a 400 naming the field, never silently ignored; their neutral values (n=1,
logprobs=false, response_format={"type": "text"}, ...) are accepted. The models double as the request
bodies of the published OpenAPI schema (app.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.engine.sampling import MAX_STOP_CHARS
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
    loc = ".".join(str(p) for p in err["loc"] if not _is_union_tag(p))
    if err["type"] == "model_type" and not loc:
        return OpenAIError(400, "the request body must be a JSON object")
    msg = err["msg"].removeprefix("Value error, ")
    return OpenAIError(400, f"{loc}: {msg}" if loc else msg, param=loc or None)


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


class _Lenient(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool | None = False


class ResponseFormat(_Lenient):
    type: str


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
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported (only 'text')")
        if self.text is None:
            raise ValueError("a 'text' content part needs a 'text' string")
        return self


class ChatMessage(_Lenient):
    role: Annotated[str, Field(min_length=1)]
    content: str | list[ContentPart] | None = None  # None: e.g. an assistant turn that only called tools

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)


class _GenerationRequest(_Lenient):
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
    # not implemented: only their neutral values are accepted
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None

    _no_logprobs = _reject("logprobs", "logprobs are", False)
    _no_top_logprobs = _reject("top_logprobs", "top_logprobs are", 0)
    _no_tools = _reject("tools", "tools (tool calling) are", [])
    _no_tool_choice = _reject("tool_choice", "tool_choice other than 'none' or 'auto' is", "none", "auto")
    _no_functions = _reject("functions", "functions (function calling) are", [])
    _no_function_call = _reject("function_call", "function_call other than 'none' or 'auto' is", "none", "auto")

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: ResponseFormat | None) -> ResponseFormat | None:
        if v is not None and v.type != "text":
            raise ValueError(f"response_format of type {v.type!r} is not supported by this server (only 'text')")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str]
    # not implemented: only their neutral values are accepted
    logprobs: bool | int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    _no_logprobs = _reject("logprobs", "logprobs are", False)
    _no_echo = _reject("echo", "echo is", False)
    _no_suffix = _reject("suffix", "suffix is", "")
    _no_best_of = _reject("best_of", "best_of other than 1 is", 1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str) and len(v) != 1:
            raise ValueError("only one prompt per request is supported")
        return v
