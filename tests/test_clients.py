"""Real clients against the default system (issue 27): `moorage up` with SmolLM2, driven by the openai SDK
(Chat Completions and Responses), the anthropic SDK (Messages) and the OpenAI Agents SDK, as an agent
would: tools auto, required and named, streamed tool calls, tool results sent back, JSON answers. A required
or named call must parse and match its tool's schema every time, even from a 135M model (the engines enforce
the grammar); bad input is a 400 naming the field."""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest
from openai import BadRequestError, OpenAI

from infra.up import UpConfig, launched
from shared.config import load_config

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
ASK = [{"role": "system", "content": "You are a helpful assistant."},
       {"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    cfg = load_config(UpConfig, overrides=["up.port=0", f"up.run_dir={tmp_path_factory.mktemp('clients')}"], env={})
    with launched(cfg) as (launcher, url):
        yield url


@pytest.fixture(scope="module")
def oai(base):
    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


def valid_weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    assert isinstance(args, dict) and isinstance(args["city"], str) and set(args) <= {"city", "days"}, args
    assert "days" not in args or isinstance(args["days"], int)
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_and_named_calls_are_valid_against_the_schema(oai, choice):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                    temperature=0, max_tokens=80, parallel_tool_calls=False)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        if call.function.name == "get_weather":
            valid_weather_args(call.function.arguments)
        else:
            assert isinstance(json.loads(call.function.arguments)["tz"], str)


def test_sampled_required_calls_are_valid_too(oai):
    """Temperature 1 explores tokens greedy never picks: the grammar still holds every one to the schema."""
    for seed in range(4):
        r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", seed=seed,
                                        temperature=1.0, max_tokens=80, parallel_tool_calls=False)
        [call] = r.choices[0].message.tool_calls
        valid_weather_args(call.function.arguments)


def test_auto_answers_with_text_or_a_valid_call(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60)
    c = r.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        valid_weather_args(c.message.tool_calls[0].function.arguments)
    else:
        assert c.finish_reason in ("stop", "length") and c.message.content


def test_streamed_tool_calls_follow_openai_s_delta_shape(oai):
    stream = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                        temperature=0, max_tokens=80, stream=True, parallel_tool_calls=False)
    deltas, finish = [], None
    for chunk in stream:
        if chunk.choices:
            deltas += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id and first.function.name == "get_weather" and first.function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in rest)
    valid_weather_args("".join(d.function.arguments for d in rest))


def test_a_tool_result_sent_back_is_answered_from_the_cached_history(oai):
    first = oai.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                        temperature=0, max_tokens=80, parallel_tool_calls=False)
    [call] = first.choices[0].message.tool_calls
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18C and sunny"}]
    second = oai.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=30)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the system prompt with the tools and the question came back unchanged: their blocks were cached
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 2, second.usage


def test_json_schema_answers_match_the_schema(oai):
    schema = {"type": "object", "properties": {  # bounded: a 135M model would list tags until max_tokens
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
              "required": ["name", "age", "tags"], "additionalProperties": False}
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a cat as JSON."}],
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "cat", "schema": schema, "strict": True}},
                                    temperature=0, max_tokens=200)
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age", "tags"} and isinstance(obj["age"], int)
    assert all(isinstance(t, str) for t in obj["tags"])
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Reply with a JSON object "
                                    "with the key answer set to yes."}], response_format={"type": "json_object"},
                                    temperature=0, max_tokens=150)
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}], "tool_choice": "required"},
     "tools[0] (f) parameters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
     "response_format"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_unknown", "content": "x"}]}, "messages[2].tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     "messages.0.content"),
])
def test_bad_agent_input_is_a_400_naming_the_field(oai, extra, param):
    with pytest.raises(BadRequestError) as e:
        oai.chat.completions.create(**{"model": MODEL, "messages": ASK, "max_tokens": 8, **extra})
    assert e.value.status_code == 400 and (e.value.body or {}).get("param", "").startswith(param), e.value.body


# ---- Anthropic Messages -----------------------------------------------------------------------------------
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Get the weather in a city", "input_schema":
                  WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def claude(base):
    return anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=300)


def test_anthropic_text_and_usage(claude):
    m = claude.messages.create(model=MODEL, max_tokens=24, system="Be brief.",
                               messages=[{"role": "user", "content": "Say hello."}], extra_body={"temperature": 0})
    assert m.type == "message" and m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.output_tokens > 0
    again = claude.messages.create(model=MODEL, max_tokens=8, system="Be brief.",
                                   messages=[{"role": "user", "content": "Say hello."}], extra_body={"temperature": 0})
    assert again.usage.cache_read_input_tokens > 0  # moorage's own cached-token count


def test_anthropic_tool_use_then_tool_result_round_trip(claude):
    ask = [{"role": "user", "content": "What is the weather in Rome?"}]
    m = claude.messages.create(model=MODEL, max_tokens=80, tools=[ANTHROPIC_TOOL], tool_choice={"type": "any"},
                               messages=ask, extra_body={"temperature": 0})
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]  # parallel calls are allowed (disable_parallel_tool_use unset)
    assert uses and len({u.id for u in uses}) == len(uses)
    for use in uses:
        assert use.id.startswith("toolu_") and use.name == "get_weather" and isinstance(use.input["city"], str)
    results = [{"type": "tool_result", "tool_use_id": u.id, "content": "21C, clear"} for u in uses]
    reply = claude.messages.create(model=MODEL, max_tokens=24, tools=[ANTHROPIC_TOOL], extra_body={"temperature": 0},
                                   messages=ask + [{"role": "assistant", "content": m.content},
                                                   {"role": "user", "content": results}])
    assert reply.type == "message" and reply.content


def test_anthropic_streaming_follows_its_event_order(claude):
    with claude.messages.stream(model=MODEL, max_tokens=80, tools=[ANTHROPIC_TOOL],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                extra_body={"temperature": 0}) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.index("content_block_start") < kinds.index("content_block_stop") < kinds.index("message_delta")
    [use] = final.content
    assert use.type == "tool_use" and isinstance(use.input["city"], str) and final.stop_reason == "tool_use"


def test_anthropic_errors_have_anthropic_s_shape(claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}]).input_tokens > 0


# ---- OpenAI Responses and the Agents SDK -----------------------------------------------------------------
def test_responses_text_function_call_and_its_output(oai):
    r = oai.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=16,
                             temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text
    tool = {"type": "function", "name": "get_weather", "description": "weather", "parameters":
            WEATHER["function"]["parameters"]}
    r = oai.responses.create(model=MODEL, input="Weather in Paris?", tools=[tool], tool_choice="required",
                             parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    [call] = [i for i in r.output if i.type == "function_call"]
    valid_weather_args(call.arguments)
    events = [e.type for e in oai.responses.create(
        model=MODEL, tools=[tool], max_output_tokens=16, temperature=0, stream=True, input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "20C"}])]
    assert events[:2] == ["response.created", "response.in_progress"] and events[-1] in ("response.completed",
                                                                                          "response.incomplete")


def test_an_agents_sdk_agent_with_a_function_tool_runs_to_a_final_output(base):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"It is 20C and sunny in {city}."

    async def run():
        client = AsyncOpenAI(base_url=base + "/v1", api_key="unused")
        agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                      model=OpenAIResponsesModel(MODEL, client), tool_use_behavior="stop_on_first_tool",
                      model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80,
                                                   parallel_tool_calls=False))
        return await Runner.run(agent, "What is the weather in Paris?")

    result = asyncio.run(run())
    assert calls and result.final_output == f"It is 20C and sunny in {calls[0]}."
