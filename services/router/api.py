"""What every generation API gives the router, and what it takes back.

An `Api` (OpenAI Chat Completions and Completions: api_openai.py; Anthropic Messages: api_anthropic.py;
OpenAI Responses: api_responses.py) parses its request body into one `Parsed` request, shapes the answer
(one JSON body, or the events of a stream) through a per-request `Shaper`, and says errors its own way. The
router's path from there on (prepare.py, dispatch.py, generate.py) is the same for all of them.

`Output` is the model's text seen through the request's tool-call parser (services/router/tool_calls.py):
what a shaper streams as content, and the calls it streams as tool calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from services.router.conversation import Conversation
from services.router.hints import Hints
from services.router.schemas import OpenAIError, from_validation_error
from services.router.tool_calls import Call, CallParser, Text, ToolFormat
from shared.engine.tokenizer import Tokenizer


@dataclass
class Parsed:
    """One request, API-neutral. A chat-like API fills `conversation`, a completion `prompt`."""
    model: str
    stream: bool = False
    conversation: Conversation | None = None
    prompt: str | list[int] | list[str] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None      # per-token log-probabilities with this many alternatives (None: off)
    session_hint: str | None = None  # the session, as the body names it (prompt_cache_key, user, metadata.user_id)
    include_usage: bool = False      # OpenAI streams: a final usage chunk
    hints: Hints = Hints()           # priority (services/router/hints.py), before the header and the tenant's ceiling


@dataclass
class Prepared:
    """A parsed request the router can run: its prompt, and how to read the model's answer."""
    parsed: Parsed
    prompt_tokens: int
    fmt: ToolFormat | None = None       # the model's tool-call format, when calls are parsed from the output
    tool_names: frozenset[str] = frozenset()
    tokenizer: Tokenizer | None = None  # when the request asked for per-token log-probabilities (their texts)

    def parser(self, id_prefix: str = "call_") -> CallParser | None:
        return self.fmt.parser(self.tool_names, id_prefix) if self.fmt is not None else None


class Output:
    """The answer so far, read through the tool-call parser when there is one."""

    def __init__(self, parser: CallParser | None):
        self.parser = parser
        self.calls: list[Call] = []
        self.text_parts: list[str] = []

    def feed(self, text: str) -> list[Text | Call]:
        events = self.parser.feed(text) if self.parser is not None else ([Text(text)] if text else [])
        return self._keep(events)

    def finish(self) -> list[Text | Call]:
        return self._keep(self.parser.finish() if self.parser is not None else [])

    def _keep(self, events: list[Text | Call]) -> list[Text | Call]:
        for e in events:
            (self.calls.append(e) if isinstance(e, Call) else self.text_parts.append(e.text))
        return [e for e in events if not isinstance(e, Text) or e.text]

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def read_all(self, text: str) -> "Output":
        self.feed(text)
        self.finish()
        return self


class Shaper:
    """One response's shapes. Streams: `start`, then `delta` per piece of text, then `end`, or `error`
    instead; each returns SSE bytes. Whole: `full`. `output`: the answer as read so far."""
    output: Output

    @property
    def called(self) -> bool:
        """The answer has a tool call: the agent runs the tool and comes back (shared/messages.SessionTurn)."""
        return bool(self.output.calls)

    def start(self) -> bytes:
        return b""

    def add_logprobs(self, pairs) -> None:
        """Log-probabilities of tokens just received ((id, TokenLogprob) pairs), shaped with the next `delta`,
        `end` or `full`. Only the OpenAI APIs ask for them."""

    def delta(self, text: str) -> bytes:
        raise NotImplementedError

    def end(self, finish_reason: str, usage: dict) -> bytes:
        raise NotImplementedError

    def error(self, err: OpenAIError) -> bytes:
        raise NotImplementedError

    def full(self, text: str, finish_reason: str, usage: dict) -> dict:
        raise NotImplementedError


class Api:
    """One endpoint's protocol. `endpoint` labels its metrics and spans."""
    endpoint: str = ""
    chat: bool = True
    clamps_max_tokens: bool = False  # max_tokens past the context is cut to the room left, not a 400

    def parse(self, raw: bytes) -> Parsed:
        raise NotImplementedError

    def shaper(self, prepared: Prepared, request_id: str) -> Shaper:
        raise NotImplementedError

    def error_response(self, err: OpenAIError) -> JSONResponse:
        return err.response()

    @staticmethod
    def validate(model: type[BaseModel], raw: bytes):
        try:
            return model.model_validate_json(raw or b"null")
        except ValidationError as e:
            raise from_validation_error(e) from None
