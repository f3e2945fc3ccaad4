"""transfer.register_pages = false: the engines' KV pages are never registered with the transfer engine or the
pool client, as a GPU's memory is where GPUDirect is not available (issue 31). The whole system then moves KV
the way it leaves a device: prefill gathers each handoff window into a registered staging buffer, writes it
into decode's landing slots, and decode checks each window's CRC and scatters it into its pages; the pool's
restores land in registered read buffers and are unpacked. Real processes (`moorage up`, tiny model), the
openai client; greedy output must equal the engine's from scratch, turn after turn."""

from __future__ import annotations

import time

import openai
import pytest

from infra.up import UpConfig, launched
from shared.config import load_config
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.tracing import read_spans

QUESTION = "List three things a code reviewer checks in a pull request, and why each matters."


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    cfg = load_config(UpConfig, overrides=[
        "up.model=tiny", "up.port=0", f"up.run_dir={tmp_path_factory.mktemp('foreign')}",
        "prefill.transfer.register_pages=false", "decode.transfer.register_pages=false",
        "prefill.transfer.slot_bytes=262144", "decode.transfer.slot_bytes=262144",  # several windows a handoff
    ], env={})
    with launched(cfg) as (launcher, base):
        yield launcher, base


def _scratch(loaded, prompt_ids, n):
    engine = Engine(loaded, EngineConfig(num_blocks=256, enable_prefix_cache=False))
    return engine.generate([prompt_ids], SamplingParams(max_tokens=n, ignore_eos=True))[0]


def test_turns_through_staging_buffers_equal_scratch(system, tiny):
    launcher, base = system
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    history = [{"role": "user", "content": QUESTION * 6}]
    for turn in range(3):
        r = c.chat.completions.create(model="tiny", messages=history, max_tokens=24, temperature=0,
                                      extra_headers={"X-Session-ID": "foreign"}, extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == _scratch(tiny, tiny.tokenizer.chat_token_ids(history), 24).output_text
        if turn:
            assert r.usage.prompt_tokens_details.cached_tokens > 0
        history += [{"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": f"And the {turn + 4}th thing?"}]
    # every handoff took the staged path: gathered, written in windows, scattered on decode
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        handoffs = [s["attributes"] for s in read_spans(launcher.run_dir / "traces.jsonl") if s["name"] == "kv.handoff"]
        if len(handoffs) >= 3:
            break
        time.sleep(0.5)
    assert len(handoffs) >= 3
    assert all(h["mode"] != "direct" and h["writes"] >= 2 and h["scatter_ms"] > 0 for h in handoffs), handoffs
