"""transfer.register_pages = false: the engines' KV pages are never registered with the transfer engine or the
pool client, as a GPU's memory is where GPUDirect is not available (issue 31). The whole system then moves KV
the way it leaves a device (shared/device_staging.py): prefill gathers each handoff window through a scratch
buffer into a registered staging buffer, writes it into decode's landing slots, and decode checks each window's
CRC and scatters it into its pages through a scratch buffer; the pool's saves pack through a scratch buffer into
the put buffer, and its restores land in registered read buffers and are unpacked through one. Real processes
(`moorage up`, tiny model, the pool on), the openai client and plain completions: greedy output must equal the
engine's from scratch, turn after turn and after a restore from the pool; a byte decode's fault hook flips in
the first landed window fails that handoff (the router retries it) and never reaches a token; and afterwards
no KV budget is held anywhere."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import torch

from infra.up import UpConfig, launched
from shared.config import load_config
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.handoff_check import FAULT_ENV
from shared.hashing import CHUNK_TOKENS
from shared.tracing import read_spans
from shared.transfer import TransferConfig
from tests.natsbus import latest_reports, nats_url

QUESTION = "List three things a code reviewer checks in a pull request, and why each matters."


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    with nats_url() as url, pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, "1")  # decode flips a byte of the first window that lands (only decode reads it)
        cfg = load_config(UpConfig, overrides=[
            "up.model=tiny", "up.port=0", f"up.nats_url={url}", f"up.run_dir={tmp_path_factory.mktemp('foreign')}",
            "up.restart=no",  # a restarted decode would corrupt anew
            "prefill.transfer.register_pages=false", "decode.transfer.register_pages=false",
            "prefill.transfer.slot_bytes=262144", "decode.transfer.slot_bytes=262144",  # several windows a handoff
            "prefill.engine.num_blocks=80",  # 1280 tokens of device KV: another history evicts the first
        ], env={})
        with launched(cfg) as (launcher, base):
            mp.delenv(FAULT_ENV)
            yield launcher, base, url


def _scratch(loaded, prompt_ids, n):
    engine = Engine(loaded, EngineConfig(num_blocks=256, enable_prefix_cache=False))
    return engine.generate([prompt_ids], SamplingParams(max_tokens=n, ignore_eos=True))[0]


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _complete(base: str, prompt: list[int], session: str) -> dict:
    r = httpx.post(base + "/v1/completions", timeout=120, headers={"X-Session-ID": session}, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_corrupted_window_is_refused_and_the_retry_answers_right(system, tiny):
    """First in this module: the fault hook corrupts the first window that lands, which is this request's."""
    _, base, url = system
    prompt = _tokens(30, 200)
    assert _complete(base, prompt, "s-crc")["choices"][0]["text"] == _scratch(tiny, prompt, 12).output_text
    reports = asyncio.run(latest_reports(url, enough=lambda seen: any(r.role == "decode" for r in seen.values())))
    [decode] = [r for r in reports.values() if r.role == "decode"]
    assert decode.detail["handoff_crc_failures"] == 1 and decode.detail["handoff_crc_verified"] >= 1


def test_turns_through_staging_buffers_equal_scratch(system, tiny):
    launcher, base, _ = system
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
    # every handoff that completed took the staged path: gathered, written in windows, scattered on decode
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        handoffs = [s["attributes"] for s in read_spans(launcher.run_dir / "traces.jsonl")
                    if s["name"] == "kv.handoff" and "mode" in s["attributes"]]
        if len(handoffs) >= 3:
            break
        time.sleep(0.5)
    assert len(handoffs) >= 3
    assert all(h["mode"] != "direct" and h["writes"] >= 2 and h["scatter_ms"] > 0 for h in handoffs), handoffs


def test_history_saved_and_restored_through_scratch_buffers_equals_scratch(system, tiny):
    _, base, _ = system
    history = _tokens(1, 700)
    assert _complete(base, history, "s-pool")["choices"][0]["text"] == _scratch(tiny, history, 12).output_text
    _complete(base, _tokens(10_001, 1200), "s-pool")  # fills the prefill's 80 blocks: the history leaves the device
    turn2 = history + _tokens(2, 60)
    second = _complete(base, turn2, "s-pool")
    assert second["usage"]["moorage"]["store"] == 2 * CHUNK_TOKENS  # both full chunks came back from the pool
    assert second["choices"][0]["text"] == _scratch(tiny, turn2, 12).output_text


def test_no_kv_budget_is_left_held(system):
    _, _, url = system

    def idle(seen: dict) -> bool:
        kv = [r for r in seen.values() if r.role in ("gate", "prefill", "decode")]
        return len(kv) == 3 and all(r.free_tokens == r.capacity_tokens and r.running == 0 for r in kv)

    reports = asyncio.run(latest_reports(url, enough=idle))
    assert idle(reports), reports
    [decode] = [r for r in reports.values() if r.role == "decode"]
    assert decode.detail["landing"] == 0 and decode.detail["free_slots"] == TransferConfig().slots
