"""Property-based fuzzing of the router's published OpenAPI schema (issue 10) against the real system
(`moorage up --model tiny`: nats-server, gate, prefill, decode, router).

schemathesis generates request bodies from /openapi.json for the four generation endpoints (OpenAI chat and
completions, Anthropic messages, OpenAI responses), valid ones
(positive: most get `model` set to the served one, so they reach the engines) and invalid ones (negative:
wrong types, missing fields, non-JSON bytes). Every response must be an answer, never a 5xx and never a
hang (a per-request timeout), then the service must still answer a normal request exactly as the greedy
reference does, and the gate's budget and the engines' KV must be back to idle.
Generation is capped server-side (router.max_request_tokens) so the run stays short.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from shared.config import load_config
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from infra.up import UpConfig, launched
from tests.natsbus import latest_reports, nats_url

PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
PER_MODE = {GenerationMode.POSITIVE: 160, GenerationMode.NEGATIVE: 100}  # per endpoint: 1,040 in all
MAX_REQUEST_TOKENS = 96   # prompt + completion: every generated request is short work
REQUEST_TIMEOUT_S = 60.0  # a request still open after this counts as a hang
WORKERS = 8
# each a 400 naming it unless neutral (schemas.py), or (tools, tool_choice, response_format) rarely valid when
# drawn at random: taken out of the half of the valid cases meant to reach the engines
UNSUPPORTED = ("n", "logprobs", "top_logprobs", "best_of", "echo", "suffix", "tools", "tool_choice", "functions",
               "function_call", "response_format", "parallel_tool_calls", "previous_response_id", "text")


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fuzz")
    with nats_url() as url:
        cfg = load_config(UpConfig, overrides=[
            "up.model=tiny", "up.port=0", f"up.nats_url={url}", f"up.run_dir={run_dir}",
            "up.ready_timeout_s=120", "up.pool=false", f"router.router.max_request_tokens={MAX_REQUEST_TOKENS}",
            "router.router.default_max_tokens=8",
        ])
        with launched(cfg) as (_launcher, base):
            yield base, url


def generate_cases(schema, path: str, mode: GenerationMode, n: int) -> list:
    """n cases drawn by hypothesis from the operation's schema (drawn first, sent later, concurrently)."""
    cases: list = []

    @settings(max_examples=n, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=schema[path]["POST"].as_strategy(generation_mode=mode))
    def collect(case) -> None:
        body = case.body
        if mode is GenerationMode.POSITIVE and isinstance(body, dict) and len(cases) % 10:
            body["model"] = "tiny"  # 9 in 10 reach the engines; the rest try a random model name
            if len(cases) % 2:  # half of them: within the small context, no unsupported feature
                for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
                    if isinstance(body.get(key), int) and body[key] > 16:
                        body[key] = body[key] % 16 + 1
                for key in UNSUPPORTED:
                    body.pop(key, None)
                if isinstance(body.get("messages"), list):  # tool turns answer calls made before: rarely so at random
                    body["messages"] = [m for m in body["messages"] if isinstance(m, dict) and m.get("role") != "tool"
                                        and not m.get("tool_calls")] or [{"role": "user", "content": "hi"}]
                if isinstance(body.get("input"), list):  # the same for the Responses API's items
                    body["input"] = [i for i in body["input"] if isinstance(i, dict) and i.get("type", "message")
                                     == "message"] or "hi"
        cases.append(case)

    collect()
    return cases


def send(base: str, case) -> tuple[str, int | str, float, str]:
    """(path, status or what went wrong, seconds, the error's param for a 4xx)"""
    t0, param = time.monotonic(), ""
    try:
        resp = case.call(base_url=base, timeout=REQUEST_TIMEOUT_S)
        status: int | str = resp.status_code
        if 400 <= status < 500:  # an error object of the endpoint's API, whatever went wrong
            err = resp.json()["error"]
            param = str(err["param"]) if "param" in err else f"({err['type']})"  # Anthropic's has no param
    except requests.Timeout:
        status = "timeout"
    except requests.ConnectionError as e:
        status = f"connection error: {e}"
    return case.operation.path, status, time.monotonic() - t0, param


def idle_reports(nats: str) -> dict:
    """The latest gate / prefill / decode reports once nothing is reserved or held (or after 20 s)."""
    def idle(seen: dict) -> bool:
        by_role = {r.role: r for r in seen.values()}
        if not {"gate", "prefill", "decode"} <= set(by_role):
            return False
        gate = by_role["gate"].detail
        return (gate["reservations"] == 0 and gate["waiting"] == 0
                and all(by_role[r].free_tokens == by_role[r].capacity_tokens for r in ("prefill", "decode")))
    seen = asyncio.run(latest_reports(nats, seconds=1.1, enough=idle))
    return {r.role: r for r in seen.values()}


def test_fuzzed_requests_never_get_a_5xx_or_hang_and_the_service_still_answers(system, tiny):
    base, nats = system
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    cases = [c for path in PATHS for mode, n in PER_MODE.items() for c in generate_cases(schema, path, mode, n)]
    assert len(cases) >= 1000

    t0 = time.monotonic()
    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(lambda c: send(base, c), cases))
    elapsed = time.monotonic() - t0

    histogram = Counter((path, status) for path, status, _, _ in results)
    by_status = Counter(status for _, status, _, _ in results)
    params = Counter(param for *_, param in results if param)
    print(f"\nfuzz: {len(results)} requests in {elapsed:.1f} s, slowest {max(r[2] for r in results):.1f} s")
    for path in PATHS:
        print(f"  {path}: " + ", ".join(f"{s}: {n}" for (p, s), n in sorted(histogram.items(), key=str)
                                         if p == path))
    print("  4xx by error.param:", dict(params.most_common(12)))
    bad = [(p, s) for p, s, _, _ in results if not isinstance(s, int) or s >= 500]
    assert not bad, f"5xx or no answer: {Counter(bad)}"
    assert by_status[200] >= 100, by_status  # the fuzz reached the engines, not only the validator

    # the service still answers, exactly as the greedy reference does
    prompt = "def fuzz(x):"
    r = httpx.post(base + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    engine = Engine(tiny, EngineConfig(num_blocks=32, enable_prefix_cache=False))
    [ref] = engine.generate([tiny.tokenizer.encode(prompt)], SamplingParams(max_tokens=8, ignore_eos=True))
    assert r.json()["choices"][0]["text"] == ref.output_text

    reports = idle_reports(nats)
    gate = reports["gate"].detail
    assert gate["reservations"] == 0 and gate["waiting"] == 0, gate
    assert set(gate["reserved_tokens"].values()) == {0}, gate
    for role in ("prefill", "decode"):
        assert reports[role].free_tokens == reports[role].capacity_tokens, (role, reports[role])
