"""Agent hints as each API's parser reads them (services/router/hints.py): the same fields through OpenAI Chat
Completions and Completions, OpenAI Responses and Anthropic Messages, then the header and the tenant's ceiling."""

from __future__ import annotations

import json

import pytest

from services.router.api_anthropic import Messages
from services.router.api_openai import ChatCompletions, Completions
from services.router.api_responses import Responses
from services.router.hints import Hints, resolve
from services.router.schemas import OpenAIError

BODIES = {
    ChatCompletions: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    Completions: {"model": "m", "prompt": "hi"},
    Responses: {"model": "m", "input": "hi"},
    Messages: {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
}


@pytest.mark.parametrize("api", list(BODIES), ids=lambda a: a.__name__)
def test_every_api_reads_the_same_hints(api):
    def parsed(**extra) -> Hints:
        return api().parse(json.dumps({**BODIES[api], **extra}).encode()).hints

    assert parsed() == Hints()
    assert parsed(priority=-3) == Hints(3, 0.0, "priority")
    assert parsed(nvext={"agent_hints": {"priority": 2, "latency_sensitivity": 0.5}}) == \
        Hints(2, 0.5, "nvext.agent_hints.priority")
    assert parsed(priority=1, nvext={"agent_hints": {"osl": 300}}) == Hints(-1, 0.0, "priority", osl=300)
    with pytest.raises(OpenAIError) as e:
        parsed(nvext={"agent_hints": {"priority": 1001}})
    assert e.value.param == "nvext.agent_hints.priority"


def test_the_header_wins_and_the_ceiling_is_the_tenant_s():
    body = Hints(2, 1.0, "nvext.agent_hints.priority")
    assert resolve(body, None, 10) == body
    assert resolve(body, " 7 ", 10) == Hints(7, 1.0, "x-request-priority")
    assert resolve(Hints(0, 0.0, osl=40, close_session=True), "1", 10) == \
        Hints(1, 0.0, "x-request-priority", True, 40)  # the header replaces the priority only
    assert resolve(Hints(-50), None, 0) == Hints(-50)        # lower is always allowed
    with pytest.raises(OpenAIError, match="at most 1 served first"):
        resolve(body, None, 1)
    with pytest.raises(OpenAIError, match="priority >= -1"):  # vLLM's field: its own sign in the message
        resolve(Hints(2), None, 1)
    with pytest.raises(OpenAIError, match="must be an integer"):
        resolve(body, "2.5", 10)
    with pytest.raises(OpenAIError, match="at most 2 s") as e:  # a ceiling of 1 allows 2 s of head start
        resolve(Hints(0, 3.0), None, 1)
    assert e.value.param == "nvext.agent_hints.latency_sensitivity"
    assert resolve(Hints(0, 2.0), None, 1) == Hints(0, 2.0)


def test_ceilings_are_configured_per_tenant_and_checked():
    from services.router.config import RouterSettings
    from shared.config import ConfigError

    s = RouterSettings(max_priority=3, api_key_tenants={"k1": "batch"}, tenant_max_priority={"batch": -1})
    assert (s.priority_ceiling(""), s.priority_ceiling("batch")) == (3, -1)
    with pytest.raises(ConfigError, match="router.tenant_max_priority.batch"):
        RouterSettings(tenant_max_priority={"batch": 5000})
