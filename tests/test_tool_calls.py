"""Tool calls (issue 27), as pure logic: each model family's call text parsed back while it streams, the
prompt a conversation with tools renders to, and the grammars that make a call certain, checked with the
same llguidance the engines run."""

from __future__ import annotations

import json

import pytest

from services.router.conversation import TOOLS_PROMPT, Conversation, ToolChoice, render_prompt, tool
from services.router.guided import Guidance
from services.router.schemas import OpenAIError
from services.router.tool_calls import FORMATS, Call, Text, format_for
from shared.engine.guide import Guides
from shared.engine.models import load_tokenizer

WEATHER = tool("get_weather", "Weather in a city", {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}, "tools[0]")
TIME = tool("get_time", None, {"type": "object", "properties": {"tz": {"type": "string"}}}, "tools[1]")
NAMES = frozenset({"get_weather", "get_time"})


def run(parser, text: str, step: int) -> list:
    """Feed `text` in pieces of `step` characters; merge adjacent Text events (their split is free)."""
    events = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    events += parser.finish()
    merged: list = []
    for e in events:
        if isinstance(e, Text) and merged and isinstance(merged[-1], Text):
            merged[-1] = Text(merged[-1].text + e.text)
        else:
            merged.append(e)
    return [e if isinstance(e, Text) else (e.index, e.name, json.loads(e.arguments)) for e in merged]


HERMES_CASES = [
    ("Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
     [Text("Let me look.\n"), (0, "get_weather", {"city": "Paris"})]),
    ("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n"
     "{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n",
     [(0, "get_weather", {"city": "Oslo"}), (1, "get_time", {})]),
    ("plain answer, no call < tool", [Text("plain answer, no call < tool")]),
    ("<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>",  # not one of the tools: content
     [Text("<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>")]),
    ("<tool_call>\n{not json}\n</tool_call> done", [Text("<tool_call>\n{not json}\n</tool_call> done")]),
    ("<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}",  # ended at EOS, unclosed
     [(0, "get_time", {"tz": "UTC"})]),
    ("<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_w",
     [(0, "get_time", {})]),  # a second call cut off by max_tokens
    ("<tool_call>\n{\"name\": \"get_w", [Text("<tool_call>\n{\"name\": \"get_w")]),  # no call at all: content
    ("<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}\n</",  # max_tokens cut the closing tag
     [(0, "get_time", {"tz": "UTC"})]),
    ("<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_ca", [(0, "get_time", {})]),
    ("<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}} and then </",  # not just the tag: content
     [Text("<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}} and then </")]),
]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("text,want", HERMES_CASES)
def test_hermes_calls_parse_the_same_however_the_text_streams(text, want, step):
    assert run(FORMATS["hermes"].parser(NAMES), text, step) == want


def test_text_that_may_open_a_call_is_held_never_taken_back():
    p = FORMATS["hermes"].parser(NAMES)
    assert p.feed("Sure <tool") == [Text("Sure ")]
    assert p.feed("box is not a call") == [Text("<toolbox is not a call")]
    assert p.finish() == []


@pytest.mark.parametrize("text,want", [
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', [(0, "get_weather", {"city": "Rome"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "A"}}',
     [(0, "get_time", {}), (1, "get_weather", {"city": "A"})]),
    ("It is sunny.", [Text("It is sunny.")]),
    ('{"answer": 42}', [Text('{"answer": 42}')]),
])
def test_llama3_calls(text, want):
    assert run(FORMATS["llama3"].parser(NAMES), text, 2) == want


def test_llama3_streams_plain_text_at_once():
    p = FORMATS["llama3"].parser(NAMES)
    assert p.feed("The") == [Text("The")]


@pytest.mark.parametrize("text,want", [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima"}}, {"name": "get_time", "arguments": {}}]',
     [(0, "get_weather", {"city": "Lima"}), (1, "get_time", {})]),
    ("[TOOL_CALLS] nonsense", [Text("[TOOL_CALLS] nonsense")]),
])
def test_mistral_calls(text, want):
    assert run(FORMATS["mistral"].parser(NAMES), text, 5) == want


def test_the_format_comes_from_the_chat_template():
    assert format_for("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert format_for("{% if message.role == 'ipython' %}").name == "llama3"
    assert format_for(load_tokenizer("smollm2-135m")[0].chat_template).name == "hermes"


@pytest.fixture(scope="module")
def smollm():
    return load_tokenizer("smollm2-135m")[0]


def conversation(**kw) -> Conversation:
    msgs = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Weather in Paris?"}]
    return Conversation(kw.pop("messages", msgs), [WEATHER, TIME], **kw)


def test_a_template_without_tools_gets_them_in_the_system_prompt_and_calls_as_text(smollm):
    fmt = FORMATS["hermes"]
    turn1 = conversation()
    text1 = render_prompt(smollm, turn1, fmt)
    assert "You are a coding agent.\n\n# Tools" in text1 and '"name": "get_weather"' in text1
    assert text1.count("<|im_start|>system") == 1  # ours replaced the template's default system prompt
    call = {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    turn2 = conversation(messages=turn1.messages + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "18C, sunny", "tool_call_id": "call_1"}])
    turn2.check()
    text2 = render_prompt(smollm, turn2, fmt)
    assert text2.startswith(text1.removesuffix("<|im_start|>assistant\n"))  # the cached prefix stays valid
    assert fmt.render_call("get_weather", call["arguments"]) in text2
    assert "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>" in text2
    assert render_prompt(smollm, turn2, fmt) == text2  # the same every time


@pytest.mark.parametrize("kw,param", [
    (dict(tool_choice=ToolChoice("named", "delete_everything")), "tool_choice"),
    (dict(messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "r", "tool_call_id": "nope"}]),
     "messages[1].tool_call_id"),
    (dict(tool_choice=ToolChoice("required"), response_schema={"type": "object"}), "response_format"),
])
def test_conversations_that_cannot_be_served_are_a_400_naming_the_field(kw, param):
    with pytest.raises(OpenAIError) as e:
        conversation(**kw).check()
    assert e.value.status == 400 and e.value.param == param


def test_malformed_tools_are_a_400_naming_them():
    with pytest.raises(OpenAIError, match="tools\\[3\\].name"):
        tool("has space", None, None, "tools[3]")
    with pytest.raises(OpenAIError, match="type 'object'"):
        tool("f", None, {"type": "array"}, "tools[0]")


@pytest.fixture(scope="module")
def tiny_tok():
    return load_tokenizer("tiny")[0]


def test_a_schema_the_engine_cannot_enforce_is_a_400_naming_the_keyword(tiny_tok):
    g = Guidance(tiny_tok)
    bad = tool("f", None, {"type": "object", "properties": {"x": {"not": {"type": "string"}}}}, "tools[0]")
    with pytest.raises(OpenAIError, match='"not"') as e:
        g.grammar(Conversation([{"role": "user", "content": "x"}], [WEATHER, bad], ToolChoice("required")),
                  FORMATS["hermes"])
    assert e.value.param == "tools[1] (f) parameters"
    # a tool the model may merely call is not enforced, so not refused (Claude Code's use `propertyNames`)
    assert g.grammar(Conversation([{"role": "user", "content": "x"}], [WEATHER, bad]), FORMATS["hermes"]) == ""
    assert g.grammar(Conversation([{"role": "user", "content": "x"}], [WEATHER, bad], ToolChoice("named", "get_weather")),
                     FORMATS["hermes"])
    with pytest.raises(OpenAIError, match="response_format"):
        g.grammar(Conversation([{"role": "user", "content": "x"}], response_schema={"$ref": "#/nowhere"}),
                  FORMATS["hermes"])


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_s_grammar_accepts_its_own_call_text_and_the_parser_reads_it_back(tiny_tok, name):
    fmt, guidance = FORMATS[name], Guidance(tiny_tok)
    grammar = guidance.grammar(conversation(tool_choice=ToolChoice("named", "get_weather")), fmt)
    text = fmt.render_call("get_weather", '{"city": "Paris", "days": 3}')
    matcher = Guides(tiny_tok, tiny_tok.vocab_size).matcher(grammar, tiny_tok.encode(text))
    assert matcher.is_accepting()
    assert run(fmt.parser(NAMES), text, 4) == [(0, "get_weather", {"city": "Paris", "days": 3})]
    wrong = fmt.render_call("get_time", "{}")  # the named tool only
    with pytest.raises(ValueError):
        Guides(tiny_tok, tiny_tok.vocab_size).matcher(grammar, tiny_tok.encode(wrong))


def test_required_allows_any_tool_and_parallel_calls(tiny_tok):
    fmt = FORMATS["hermes"]
    grammar = Guidance(tiny_tok).grammar(conversation(tool_choice=ToolChoice("required")), fmt)
    two = fmt.render_call("get_time", "{}") + "\n" + fmt.render_call("get_weather", '{"city": "B"}')
    assert Guides(tiny_tok, tiny_tok.vocab_size).matcher(grammar, tiny_tok.encode(two)).is_accepting()
    assert Guidance(tiny_tok).grammar(conversation(), fmt) == ""  # auto: unconstrained


def test_responses_tools_as_codex_sends_them():
    """Codex CLI groups tools in a namespace and always offers the hosted web_search: the namespace's
    functions are tools of their own, the hosted tool is not offered (moorage runs none); other types: 400."""
    from services.router.api_responses import ResponsesRequest, conversation

    fn = {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}
    body = ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [
        fn, {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents", "tools": [
            {**fn, "name": "spawn_agent"}, {**fn, "name": "close_agent"}]},
        {"type": "web_search", "external_web_access": False}]})
    assert [t.name for t in conversation(body).tools] == ["exec_command", "spawn_agent", "close_agent"]
    from pydantic import ValidationError
    with pytest.raises(ValidationError, match="local_shell"):
        ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": [{"type": "local_shell"}]})


def test_objects_that_list_their_properties_are_closed_in_the_grammar():
    """As xgrammar's strict mode: a listed object takes no invented keys; free-form maps, explicit
    additionalProperties and allOf branches are left as written; the input is not changed."""
    from services.router.guided import closed

    schema = {"type": "object", "properties": {"command": {"type": "string"},
                                               "env": {"type": "object"},
                                               "opts": {"type": "object", "properties": {"x": {"type": "integer"}}},
                                               "list": {"type": "array", "items": {"type": "object", "properties": {"y": {}}}},
                                               "open": {"type": "object", "properties": {}, "additionalProperties": True}},
              "$defs": {"d": {"properties": {"z": {}}}},
              "allOf": [{"properties": {"a": {}}}], "anyOf": [{"properties": {"b": {}}}]}
    out = closed(schema)
    assert out["additionalProperties"] is False and "additionalProperties" not in schema
    p = out["properties"]
    assert "additionalProperties" not in p["env"] and p["opts"]["additionalProperties"] is False
    assert p["list"]["items"]["additionalProperties"] is False and p["open"]["additionalProperties"] is True
    assert out["$defs"]["d"]["additionalProperties"] is False and out["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in out["allOf"][0]


def test_a_required_call_cannot_invent_argument_keys(tiny_tok):
    """mini-swe-agent's bash tool (no additionalProperties): its one argument, nothing nested beside it."""
    fmt = FORMATS["hermes"]
    bash = tool("bash", None, {"type": "object", "properties": {"command": {"type": "string"}},
                               "required": ["command"]}, "tools[0]")
    grammar = Guidance(tiny_tok).grammar(Conversation([{"role": "user", "content": "x"}], [bash],
                                                      ToolChoice("required")), fmt)
    guides = Guides(tiny_tok, tiny_tok.vocab_size)
    assert guides.matcher(grammar, tiny_tok.encode(fmt.render_call("bash", '{"command": "ls"}'))).is_accepting()
    with pytest.raises(ValueError):
        guides.matcher(grammar, tiny_tok.encode(fmt.render_call("bash", '{"command": "ls", "arguments": {}}')))


def test_enforced_json_has_one_spacing_so_a_weak_model_cannot_pad_it_for_ever(tiny_tok):
    """Any whitespace between JSON tokens let the random-weight model write 300+ whitespace tokens inside a
    required call until max_tokens; the grammar now takes json.dumps' spacing only (calls and JSON answers)."""
    fmt, guides = FORMATS["hermes"], Guides(tiny_tok, tiny_tok.vocab_size)
    grammar = Guidance(tiny_tok).grammar(conversation(tool_choice=ToolChoice("named", "get_weather")), fmt)
    canonical = fmt.render_call("get_weather", '{"city": "Paris", "days": 3}')
    assert guides.matcher(grammar, tiny_tok.encode(canonical)).is_accepting()
    padded = canonical.replace('{"name"', '{\n  \t"name"', 1)
    with pytest.raises(ValueError):
        guides.matcher(grammar, tiny_tok.encode(padded))
    answer = Guidance(tiny_tok).grammar(Conversation([{"role": "user", "content": "x"}], response_schema={
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}), fmt)
    assert guides.matcher(answer, tiny_tok.encode('{"ok": true}')).is_accepting()
    with pytest.raises(ValueError):
        guides.matcher(answer, tiny_tok.encode('{ "ok": true}'))
