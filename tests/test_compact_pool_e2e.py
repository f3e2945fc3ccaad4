"""Compact pool objects end to end (issue 29): `moorage up` with `prefill.pool.dtype = "bfloat16"` or
`"float8_e4m3fn"` on float32 KV, a real master and store. A turn whose history left the device restores it
from compact objects, a half or a quarter of the bytes of lossless ones, in a namespace of their own, and
answers exactly what the model says with that history rounded to that type (the KV a restore leaves in its
blocks; the handoff then carries it to decode)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from shared.config import load_config
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.hashing import CHUNK_TOKENS, chunk_hashes, namespace_seed
from shared.kv_object import HEADER_BYTES, object_key
from shared.kv_layout import KVLayout
from shared.pool import PoolClient, PoolConfig
from infra.up import UpConfig, launched
from tests.natsbus import latest_reports, nats_url
from tests.test_pool_e2e import complete, tokens

pytestmark = pytest.mark.slow
MAX_TOKENS = 12


def rounded_history_text(tiny, prompt: list[int], history: int, dtype: torch.dtype) -> str:
    """The answer with the first `history` tokens' KV rounded to `dtype`, the rest computed."""
    engine = Engine(tiny, EngineConfig(num_blocks=256))
    engine.generate([prompt[:history]], SamplingParams(max_tokens=1, ignore_eos=True))
    held = engine.block_manager.match_prefix(prompt[:history]).block_ids
    for pages in engine.pages:
        pages[held] = pages[held].to(dtype).to(pages.dtype)
    [seq] = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert seq.num_device_cached == history
    return seq.output_text


@pytest.mark.parametrize("dtype,suffix,shrink", [("bfloat16", "bf16", 2), ("float8_e4m3fn", "fp8", 4)])
def test_a_turn_restores_its_history_from_compact_objects(tmp_path, tiny, dtype, suffix, shrink):
    with nats_url() as url:
        cfg = load_config(UpConfig, overrides=[
            "up.model=tiny", "up.port=0", f"up.nats_url={url}", f"up.run_dir={tmp_path / 'run'}",
            "up.store_bytes=67108864", "up.ready_timeout_s=120", "prefill.engine.num_blocks=80",
            f"prefill.pool.dtype={dtype}", "prefill.pool.min_restore_tokens=256", "decode.engine.num_blocks=512",
            # decode would keep turn 1's lossless blocks and be sent only the rest (decode reuse): the answer
            # would mix both histories. Off, decode gets the whole prompt as prefill holds it, rounded.
            "decode.transfer.decode_reuse=false"])
        with launched(cfg) as (launcher, base):
            history = tokens(31, 700)
            complete(base, history, "s-compact")
            complete(base, tokens(10_031, 1200), "s-compact")  # fills the 80-block device cache: evicts it
            turn2 = history + tokens(32, 60)
            second = complete(base, turn2, "s-compact")
            assert second["usage"]["moorage"]["store"] == 2 * CHUNK_TOKENS
            assert second["choices"][0]["text"] == rounded_history_text(tiny, turn2, 2 * CHUNK_TOKENS, getattr(torch, dtype))

            reports = asyncio.run(latest_reports(url, enough=lambda seen: any(r.role == "prefill" for r in seen.values())))
            prefill = next(r for r in reports.values() if r.role == "prefill")
            ns = prefill.detail["kv_namespace"]
            assert prefill.detail["pool"]["verify_failures"] == 0 and prefill.detail["pool_dtype"] == dtype
            client = PoolClient(PoolConfig(master_addr=launcher.configs["prefill-0"].pool.master_addr))
            try:
                digests = chunk_hashes(history, namespace_seed(ns))
                compact = [object_key(ns + f"-{suffix}", 0, 1, d) for d in digests]
                assert client.exists(compact) == [True, True]
                assert client.exists([object_key(ns, 0, 1, d) for d in digests]) == [False, False]  # no lossless twin
                buf = torch.zeros(8 << 20, dtype=torch.uint8)
                client.register(buf)
                [n] = client.get_into(compact[:1], [buf.data_ptr()], [buf.numel()])
                layout = KVLayout(num_layers=tiny.config.num_layers, num_kv_heads=tiny.config.num_kv_heads,
                                  head_dim=tiny.config.head_dim)
                assert n - HEADER_BYTES == CHUNK_TOKENS * layout.bytes_per_token // shrink  # of float32's
            finally:
                client.close()
