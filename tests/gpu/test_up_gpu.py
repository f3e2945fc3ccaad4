"""`moorage up` with both engines on the GPU, driven by the openai SDK: KV sized from the device's memory,
prompts computed on the device, the KV handed from prefill's process to decode's through the staged path
(device pages -> gather -> pinned host buffer -> Transfer Engine write -> decode's pinned landing ->
scatter into its device pages, every byte CRC-checked), decode's steps replayed from CUDA graphs, a returning
turn served from the cache, its handoff sending only what decode lacks (decode reuse through the staged path),
and the answer equal, token for token, to one engine computing the same prompt from scratch on the same device.

The model: MOORAGE_GPU_MODEL (a path or a bundled name), else the bundled SmolLM2."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from infra.up import UpConfig, launched
from shared.config import load_config
from shared.engine.engine import Engine, EngineConfig
from shared.engine.models import load_model
from shared.engine.sampling import SamplingParams
from tests.natsbus import latest_reports

pytestmark = pytest.mark.gpu

MODEL = os.environ.get("MOORAGE_GPU_MODEL", "smollm2-135m")
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in at most {i + 3} words." for i in range(60))


def test_up_on_cuda_serves_the_openai_client(tmp_path, report):
    from openai import OpenAI

    cfg = load_config(UpConfig, overrides=["up.port=0", f"up.run_dir={tmp_path}", f"up.model={MODEL}",
                                           "prefill.engine.device=cuda", "decode.engine.device=cuda",
                                           "decode.engine.cuda_graphs=true"], env={})
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a harbour in Norway."}]
    with launched(cfg) as (launcher, url):
        kv = launcher.kv
        oai = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        first = oai.chat.completions.create(model=MODEL, messages=turn1, temperature=0, max_tokens=24)
        turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And one in Chile?"}]
        second = oai.chat.completions.create(model=MODEL, messages=turn2, temperature=0, max_tokens=24)
        sampled = oai.chat.completions.create(model=MODEL, messages=turn2, max_tokens=16)  # temperature 1
        reports = asyncio.run(latest_reports(launcher.nats_address, credential=launcher.credential, enough=lambda
                                             seen: {r.role for r in seen.values()} >= {"prefill", "decode"}))
        handoffs = next(r.detail for r in reports.values() if r.role == "prefill")
        graphs = next(r.detail for r in reports.values() if r.role == "decode")["decode_graphs"]
    loaded = load_model(MODEL)
    engine = Engine(loaded, EngineConfig(device="cuda", num_blocks=512, kv_warm_ahead="0"))
    ids = loaded.tokenizer.chat_token_ids(turn2)
    want = engine.generate([ids], SamplingParams(temperature=0, max_tokens=24))[0].output_text
    cached = second.usage.prompt_tokens_details.cached_tokens
    report(kv_decode_gib=round(kv.decode_bytes / 2**30, 1), kv_available_gib=round(kv.available / 2**30, 1),
           turn2_prompt=second.usage.prompt_tokens, turn2_cached=cached,
           identical_to_scratch=second.choices[0].message.content == want,
           handoffs=handoffs["handoffs_done"], handoff_mb=round(handoffs["handoff_bytes"] / 1e6, 1),
           handoff_reused_blocks=handoffs["handoff_reused_blocks"], graphs_recorded=graphs["recorded"],
           graph_replays=graphs["replays"])
    assert kv.available > 16 * 2**30  # the device's memory, not the host's
    assert cached >= first.usage.prompt_tokens // 2
    assert second.choices[0].message.content == want
    assert sampled.usage.completion_tokens > 0
    assert handoffs["handoffs_done"] == 3 and handoffs["handoff_reused_blocks"] > 0  # turn 2 and its sample reused
    assert graphs["replays"] > 0  # decode replayed its steps from CUDA graphs (the answer above is theirs)
    assert graphs["padded"] == 0 and graphs["recorded"] > 0  # all recorded at start-up: none in service
    assert torch.cuda.is_available()
