"""The expected output length hint (nvext.agent_hints.osl, issue 30) through the whole system: the gate
reserves what a request says it will write, so more requests share a decode than max_tokens would allow;
requests that then write far more than they said outgrow decode's KV, and decode preempts and recomputes
instead of failing. Every answer still equals the engine's from scratch, and afterwards decode has all its
KV back (nothing leaked)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from infra.up import UpConfig, launched
from shared.config import load_config
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from tests.natsbus import latest_reports, nats_url

PROMPT, OUTPUT, N = 200, 160, 4  # 4 x 360 tokens on a decode of 1024: only with the osl hint do they all fit


def _decode(url: str) -> dict:
    reports = asyncio.run(latest_reports(url, enough=lambda seen: any(r.role == "decode" for r in seen.values())))
    return next(r for r in reports.values() if r.role == "decode")


def test_requests_that_outgrow_their_osl_are_preempted_not_failed_and_leak_nothing(tmp_path, tiny):
    prompts = [torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(40 + i)).tolist()
               for i in range(N)]
    with nats_url() as url:
        cfg = load_config(UpConfig, overrides=[
            "up.model=tiny", "up.port=0", f"up.nats_url={url}", f"up.run_dir={tmp_path / 'run'}", "up.pool=false",
            "decode.engine.num_blocks=64", "prefill.engine.num_blocks=256", "gate.gate.budget_fraction=1.0"], env={})
        with launched(cfg) as (_, base):
            def ask(prompt: list[int]) -> httpx.Response:
                return httpx.post(base + "/v1/completions", timeout=300, json={
                    "model": "tiny", "prompt": prompt, "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True,
                    "nvext": {"agent_hints": {"osl": 8}}})

            with ThreadPoolExecutor(N) as ex:
                answers = list(ex.map(ask, prompts))
            assert [r.status_code for r in answers] == [200] * N, [r.text[:200] for r in answers]
            decode = _decode(url)
            assert decode.capacity_tokens < N * (PROMPT + OUTPUT)  # they could not all have fit at once
            assert decode.detail["preemptions"] > 0                # and did outgrow decode's KV
            assert decode.free_tokens == decode.capacity_tokens and decode.running == 0
    engine = Engine(tiny, EngineConfig(num_blocks=256, enable_prefix_cache=False))
    want = engine.generate(prompts, SamplingParams(max_tokens=OUTPUT, ignore_eos=True))
    assert [r.json()["choices"][0]["text"] for r in answers] == [w.output_text for w in want]
    assert [r.json()["usage"]["completion_tokens"] for r in answers] == [OUTPUT] * N
