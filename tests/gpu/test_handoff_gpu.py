"""The staged handoff between two engines on one GPU, against its baseline (issue 31's goal: >= 80% of a bare
pinned D2H copy plus a Transfer Engine write of the same bytes).

Two engines with SmolLM2's shape (random weights, tests/random_oracle.py) on the device, prefill's HandoffSender and
decode's LandingZone wired as the services wire them, over a real nats-server and two real Transfer Engines (tcp):
an 8,000-token prompt's KV goes device pages -> gather -> pinned staging buffer -> write -> decode's pinned landing
slot -> scatter into decode's device pages, every byte CRC-checked, the whole prompt each time (decode reuse off).
Decode's answer must equal one engine's from scratch on the device. The baseline, timed between the handoffs: the
same bytes copied from a device tensor into a registered pinned buffer, then written in slot-sized pieces into a
registered pinned buffer of the other Transfer Engine (no checksums, no bus, no pipelining). Figures are reported,
not asserted (a timing is never a test's verdict)."""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest
import torch

from shared.device_staging import host_buffer
from shared.engine.engine import Engine, EngineConfig
from shared.engine.models import load_model
from shared.engine.sampling import SamplingParams
from shared.messages import HandoffDone
from shared.transfer import TransferConfig, plan_writes
from tests import random_oracle as oracle
from tests.decode_zone import collect_chunks, handoff_pair

pytestmark = pytest.mark.gpu


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


async def staged_handoff(path, url: str, device: str, dtype: str, tokens: int, repeats: int) -> dict:
    """The figures of `repeats` staged handoffs of a `tokens`-long prompt and of as many bare baselines."""
    loaded = load_model(str(path))
    blocks = tokens // 16 + 64
    make = lambda n: Engine(loaded, EngineConfig(device=device, dtype=dtype, num_blocks=n,  # noqa: E731
                                                  max_batched_tokens=2048, kv_warm_ahead="0"))
    p_engine, d_engine, scratch = make(blocks), make(blocks), make(blocks)
    prompt = oracle.prompts(oracle.SHAPES["smollm2"]["vocab_size"], (tokens,), seed=21)[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    [want] = scratch.generate([prompt], params)
    del scratch
    seq = p_engine.add_request("p", prompt, params, prefill_only=True, retain_kv=True)
    while not p_engine.step():
        pass
    table = list(seq.block_table)
    cfg = TransferConfig(register_pages=False, direct=False, decode_reuse=False, timeout_s=120)
    nbytes = tokens * p_engine.layout.bytes_per_token
    handoff_s, bare_s, answers = [], [], []
    async with handoff_pair(url, p_engine, d_engine, cfg) as h:
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
        host, dst = host_buffer(nbytes, device), host_buffer(nbytes, device)
        h.p_te.register(host)
        h.d_te.register(dst)
        pieces = plan_writes(nbytes, cfg.slot_bytes)

        def bare() -> float:
            _sync(device)
            t = time.perf_counter()
            host.copy_(src)
            _sync(device)
            h.p_te.write(h.d_te.endpoint, [host.data_ptr() + o for o, _ in pieces],
                         [dst.data_ptr() + o for o, _ in pieces], [n for _, n in pieces])
            return time.perf_counter() - t

        for r in range(repeats + 1):  # the first of each is a warm-up
            rid = f"h{r}"
            chunks, finished = await collect_chunks(h.p_bus, rid)
            done = HandoffDone(rid, seq.prompt_ids, seq.output_ids, seq.output_text, params,
                               {"device": 0, "store": 0, "computed": tokens})
            bare_s.append(await asyncio.to_thread(bare))
            t = time.perf_counter()
            stats = await h.sender.send("decode-0", rid, table, tokens, done)
            handoff_s.append(time.perf_counter() - t)
            await asyncio.wait_for(finished.wait(), 120)
            answers.append(done.output_ids + [t for c in chunks for t in c.token_ids])
            assert stats.bytes == nbytes and not any(c.error for c in chunks)
        assert torch.equal(dst, host)
        checks = h.decode.zone.checks
    p_engine.block_manager.release(reversed(table))
    handoff, base = statistics.median(handoff_s[1:]), statistics.median(bare_s[1:])
    return {"tokens": tokens, "mb": round(nbytes / 1e6, 1), "handoff_ms": round(handoff * 1e3, 1),
            "bare_d2h_write_ms": round(base * 1e3, 1), "handoff_over_bare": round(base / handoff, 2),
            "handoff_gbs": round(nbytes / handoff / 1e9, 2), "verified_pieces": checks.verified,
            "crc_failures": checks.failures, "identical_to_scratch": all(a == want.output_ids for a in answers)}


def test_staged_handoff_on_one_gpu_against_bare_d2h_and_write(tmp_path, report):
    from tests.natsbus import nats_url

    model = oracle.build_hf_model("smollm2", device="cuda")
    path = oracle.save_hf_model(model, tmp_path)
    with nats_url() as url:
        figures = asyncio.run(staged_handoff(path, url, "cuda", "bfloat16", 8000, repeats=3))
    report(**figures)
    assert figures["identical_to_scratch"] and figures["crc_failures"] == 0 and figures["verified_pieces"] > 0
