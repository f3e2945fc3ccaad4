"""What the model must produce, as an llguidance grammar the engines enforce token by token
(shared/engine/guide.py): a tool call when `tool_choice` is required or names a tool, JSON for
`response_format`. Built and checked here, once per request, with the same tokenizer the engines use: a
schema to enforce that the engine cannot (a keyword it does not implement, a dangling $ref) is a 400 naming
where it is, before anything reaches the bus. Tool schemas repeat every turn of an agent: their checks are
cached.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import cached_property

from services.router.conversation import Conversation
from services.router.schemas import OpenAIError
from services.router.tool_calls import ToolFormat
from shared.engine.guide import grammar_error, ll_tokenizer
from shared.engine.tokenizer import Tokenizer

_CHECKED_KEEP = 1024  # schemas whose verdict is remembered
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_ONE = ("items", "additionalItems", "not", "if", "then", "else", "contains")


# JSON written one way: json.dumps' separators, no other whitespace. With llguidance's default (any whitespace
# between tokens) a weak model can pad a call with newlines and tabs until max_tokens ends it unfinished
# (tiny, measured: 300+ whitespace tokens after "arguments":); with this every enforced call and answer ends.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def enforced(schema: dict) -> dict:
    """The schema as the grammar enforces it: listed objects closed, whitespace fixed (COMPACT)."""
    return {**closed(schema), "x-guidance": COMPACT}


def closed(schema):
    """The schema with every object that lists its `properties` and says nothing of others closed
    (`additionalProperties: false`), as xgrammar's strict mode does: what the grammar lets through still
    validates against the schema as given, but a small model can no longer nest invented keys until its
    max_tokens runs out (mini-swe-agent's bash tool, measured: 5 of 7 first calls cut off). Objects with no
    `properties` (free-form maps) stay open, and so do `allOf` branches (closing one would refuse the
    others' keys)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict) and not {"additionalProperties", "unevaluatedProperties",
                                                         "patternProperties"} & out.keys():
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(v) for k, v in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(v) for v in out[key]]
    for key in _SUBSCHEMA_ONE:
        if key in out:
            out[key] = closed(out[key])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed(out["additionalProperties"])
    return out


class Guidance:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._checked: OrderedDict[str, str | None] = OrderedDict()

    @cached_property
    def ll_tok(self):
        return ll_tokenizer(self.tokenizer)

    def _error(self, grammar: str) -> str | None:
        if grammar in self._checked:
            self._checked.move_to_end(grammar)
            return self._checked[grammar]
        error = grammar_error(self.ll_tok, grammar)
        self._checked[grammar] = error
        while len(self._checked) > _CHECKED_KEEP:
            self._checked.popitem(last=False)
        return error

    def _enforceable(self, schema: dict, where: str) -> str:
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(enforced(schema))
        except ValueError as e:
            raise OpenAIError(400, f"{where}: not a valid JSON schema: {e}", param=where) from None
        error = self._error(grammar)
        if error:
            raise OpenAIError(400, f"{where}: this schema cannot be enforced: {error}", param=where)
        return grammar

    def grammar(self, conv: Conversation, fmt: ToolFormat) -> str:
        """The request's grammar ("" = unconstrained). The schemas it enforces must be enforceable (a 400
        naming the keyword); a tool the model may merely call (auto) is not held to that: Claude Code's
        own tools use `propertyNames`, which no grammar engine here implements."""
        import llguidance

        if conv.response_schema is not None:
            return self._enforceable(conv.response_schema, "response_format")
        choice = conv.tool_choice
        if choice.mode not in ("required", "named"):
            return ""
        tools = [t for t in conv.tools if choice.mode == "required" or t.name == choice.name]
        for t in tools:
            self._enforceable(t.parameters, f"tools[{conv.tools.index(t)}] ({t.name}) parameters")
        shapes = [{"type": "object", "properties": {"name": {"const": t.name}, fmt.args_key: t.parameters},
                   "required": ["name", fmt.args_key], "additionalProperties": False} for t in tools]
        call = enforced(shapes[0] if len(shapes) == 1 else {"anyOf": shapes})  # closes each tool's parameters too
        grammar = llguidance.LLMatcher.grammar_from_lark(fmt.lark(call, choice.mode == "required" and
                                                                  conv.parallel_tool_calls))
        error = self._error(grammar)
        if error:
            raise OpenAIError(400, f"tools: the call cannot be enforced: {error}", param="tools")
        return grammar
