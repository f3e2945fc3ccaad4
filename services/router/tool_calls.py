"""Tool calls in the model's own words, and back: each model family writes a call its own way, and the
router parses that text, as it streams, into OpenAI / Anthropic / Responses tool calls.

Formats (`FORMATS`; the model's chat template picks one, `format_for`):
- `hermes` (Hermes, Qwen2.5/Qwen3, and moorage's own for templates without tools, e.g. SmolLM2):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call.
- `llama3` (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by `;`.
- `mistral` (Mistral, Devstral): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

`CallParser.feed(text)` returns what can be shown now: `Text` (content) and `Call` events. Text that may
still become a call's opening is held back, never taken back later; text that turns out not to be a
well-formed call (bad JSON, an unknown tool) stays content, except an unclosed call after complete ones
(the output ran out of max_tokens mid-call). A call whose JSON is whole but whose closing tag max_tokens
cut is that call. `finish()` flushes what is held.

A format also writes the grammar that makes a call certain (`tool_choice` required or named: see
services/router/guided.py) and renders earlier calls into the history, identically every turn.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Call:
    index: int
    id: str
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's `function.arguments`)


def call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)


def _call_from(obj, names: frozenset[str] | None, args_key: str) -> tuple[str, str] | None:
    """(name, arguments JSON) when `obj` is a call to a known tool, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


class CallParser:
    """Base: the streaming contract. Subclasses implement `_scan`."""

    def __init__(self, names: frozenset[str] | None = None, id_prefix: str = "call_"):
        self.names, self.id_prefix = names, id_prefix
        self.buf = ""
        self.calls = 0

    def _call(self, name: str, arguments: str) -> Call:
        self.calls += 1
        return Call(self.calls - 1, call_id(self.id_prefix), name, arguments)

    def feed(self, text: str) -> list[Text | Call]:
        self.buf += text
        return self._scan(final=False)

    def finish(self) -> list[Text | Call]:
        return self._scan(final=True)

    def _scan(self, final: bool) -> list[Text | Call]:
        raise NotImplementedError


def _held(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesParser(CallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _scan(self, final: bool) -> list[Text | Call]:
        out: list[Text | Call] = []
        while True:
            start = self.buf.find(self.OPEN)
            if start < 0:
                rest = self.buf.lstrip()
                if self.calls and not rest:  # whitespace after a call: dropped unless text follows
                    self.buf = "" if final else self.buf
                    return out
                if self.calls and not final and self.OPEN.startswith(rest):
                    return out  # whitespace, then perhaps the next call
                keep = 0 if final else _held(self.buf, self.OPEN)
                if len(self.buf) > keep:
                    out.append(Text(self.buf[:len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                return out
            if self.calls and not self.buf[:start].strip():
                self.buf = self.buf[start:]  # only whitespace between two calls
                start = 0
            if start:
                out.append(Text(self.buf[:start]))
                self.buf = self.buf[start:]
            end = self.buf.find(self.CLOSE)
            if end < 0 and not final:
                return out  # inside a call: wait for its end
            body = self.buf[len(self.OPEN):end if end >= 0 else len(self.buf)]
            consumed = end + len(self.CLOSE) if end >= 0 else len(self.buf)
            try:
                if end >= 0:
                    obj = json.loads(body)
                else:  # max_tokens ran out: a whole call cut only in its closing tag is still that call
                    rest = body.lstrip()
                    obj, i = json.JSONDecoder().raw_decode(rest)
                    if not self.CLOSE.startswith(rest[i:].strip()):
                        raise ValueError("text after the call")
                parsed = _call_from(obj, self.names, "arguments")
            except ValueError:
                parsed = None
            block, self.buf = self.buf[:consumed], self.buf[consumed:]
            if parsed is None and end < 0 and self.calls:
                continue  # a further call cut off by max_tokens: not an answer either
            out.append(Text(block) if parsed is None else self._call(*parsed))  # not a call after all: content


class WholeOutputParser(CallParser):
    """Formats whose calls are the whole output (Llama 3 JSON, Mistral's marker): an output that may be a
    call is held until the end; one that cannot be is streamed as content."""
    prefixes: tuple[str, ...] = ()
    content = False  # decided: the output is not a call, it streams as it comes

    def _could_be_call(self) -> bool | None:
        s = self.buf.lstrip()
        if not s:
            return None
        if any(s.startswith(p) for p in self.prefixes):
            return True
        return None if any(p.startswith(s) for p in self.prefixes) else False

    def _scan(self, final: bool) -> list[Text | Call]:
        maybe = None if self.content else self._could_be_call()
        if self.content or maybe is False:
            self.content = True
            text, self.buf = self.buf, ""
            return [Text(text)] if text else []
        if not final:
            return []
        text, self.buf = self.buf, ""
        calls = self._parse(text.strip()) if maybe else None
        if not calls:
            return [Text(text)] if text else []
        return [self._call(*c) for c in calls]

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError


class Llama3Parser(WholeOutputParser):
    prefixes = ("{", "<|python_tag|>")

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        text = text.removeprefix("<|python_tag|>").strip()
        calls, decoder, i = [], json.JSONDecoder(), 0
        while i < len(text):
            try:
                obj, i = decoder.raw_decode(text, i)
            except ValueError:
                return None
            call = _call_from(obj, self.names, "parameters")
            if call is None:
                return None
            calls.append(call)
            while i < len(text) and text[i] in " \n;":
                i += 1
        return calls or None


class MistralParser(WholeOutputParser):
    prefixes = ("[TOOL_CALLS]",)

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        try:
            items = json.loads(text.removeprefix("[TOOL_CALLS]").strip())
        except ValueError:
            return None
        calls = [_call_from(o, self.names, "arguments") for o in (items if isinstance(items, list) else [items])]
        return None if not calls or None in calls else calls


@dataclass(frozen=True)
class ToolFormat:
    name: str
    parser: type[CallParser]

    def render_call(self, name: str, arguments: str) -> str:
        """An earlier call of the conversation, as the model would have written it."""
        args = json.loads(arguments or "{}")
        if self.name == "llama3":
            return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)
        if self.name == "mistral":
            return "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": args}], ensure_ascii=False)
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n</tool_call>"

    def lark(self, call_schema: dict, parallel: bool) -> str:
        """A Lark grammar (llguidance) whose every sentence is one call (or several, when `parallel`) in
        this format, each matching `call_schema` ({"name": ..., "arguments"/"parameters": ...})."""
        body = json.dumps(call_schema)
        if self.name == "hermes":
            call = f'"<tool_call>\\n" %json {body} "\\n</tool_call>"'
            return f'start: call ("\\n" call)*\ncall: {call}' if parallel else f"start: {call}"
        if self.name == "llama3":
            return (f'start: call ("; " call)*\ncall: %json {body}' if parallel else f"start: %json {body}")
        return f'start: "[TOOL_CALLS][" call ("," call)* "]"\ncall: %json {body}' if parallel else \
            f'start: "[TOOL_CALLS][" %json {body} "]"'

    @property
    def args_key(self) -> str:
        return "parameters" if self.name == "llama3" else "arguments"


FORMATS = {"hermes": ToolFormat("hermes", HermesParser), "llama3": ToolFormat("llama3", Llama3Parser),
           "mistral": ToolFormat("mistral", MistralParser)}


def format_for(chat_template: str) -> ToolFormat:
    """The call format of a model, from its chat template; Hermes (moorage's own) when it shows none."""
    if "[TOOL_CALLS]" in chat_template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return FORMATS["llama3"]
    return FORMATS["hermes"]
