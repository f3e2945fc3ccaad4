"""Context-parallel decode as ranks (shared/engine/context_parallel.py): rank r of C holds tokens t % C == r; the
attention shares merge exactly, and an engine with C ranks says what one process says, token for token."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F

from services.decode.config import DecodeConfig
from services.prefill.config import PrefillConfig
from shared.config import ConfigError, load_config
from shared.engine.context_parallel import DcpPlan, RankShare, local_count, merge, partial
from shared.engine.engine import Engine, EngineConfig, StepFailed
from shared.engine.ranks import RanksLost
from shared.engine.runner import StepInputs
from shared.engine.sampling import SamplingParams


def full_attention(q, k, v, qpos, kpos, scale, window=0):
    """One softmax over all keys (the oracle): SDPA with the same visibility."""
    visible = kpos[None, :] <= qpos[:, None]
    if window:
        visible &= kpos[None, :] > qpos[:, None] - window
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=visible[None, None], scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("world,window", [(2, 0), (4, 0), (4, 7), (3, 0)])
def test_shares_merge_to_one_softmax(world, window):
    g = torch.Generator().manual_seed(world * 10 + window)
    S, T, hq, hkv, d = 45, 6, 4, 2, 8
    k, v = torch.randn(S, hkv, d, generator=g), torch.randn(S, hkv, d, generator=g)
    q = torch.randn(T, hq, d, generator=g)
    kpos = torch.arange(S)
    qpos = torch.tensor([0, 1, 5, 20, 43, 44])  # position 0 sees one key: the other ranks' shares are empty
    shares = []
    for r in range(world):
        mine = kpos % world == r
        shares.append(partial(q, k[mine], v[mine], qpos, kpos[mine], 0.3, window))
    assert torch.isinf(shares[1][1][0]).all()  # rank 1 holds nothing position 0 sees
    torch.testing.assert_close(merge(shares, q.dtype), full_attention(q, k, v, qpos, kpos, 0.3, window),
                               rtol=1e-5, atol=1e-5)


def test_local_counts_and_a_rank_s_slots():
    assert [local_count(10, r, 4) for r in range(4)] == [3, 3, 2, 2]
    assert [local_count(1, r, 2) for r in range(2)] == [1, 0]
    # rank 1 of 2 writes positions 17 and 19 (block 1, local offsets 0 and 1 of its 8-token half of the block)
    inp = StepInputs([1, 2, 3, 4], [16, 17, 18, 19], [5, 5, 5, 5], [0, 1, 2, 3], [(0, 4, 20, [9, 5])], sample_rows=[3])
    share = RankShare(1, 2, torch.zeros(10, 1, 2, 8, 1, 4), DcpPlan.of(inp))
    assert share.rows.tolist() == [1, 3] and share.slot_blocks.tolist() == [5, 5]
    assert share.slot_offsets.tolist() == [0, 1]
    [(q0, n, count, table, kpos)] = share.keys
    assert (q0, n, count, table.tolist()) == (0, 4, 10, [9, 5]) and kpos.tolist() == list(range(1, 20, 2))


@pytest.mark.parametrize("dcp", [2, 4])
def test_ranks_equal_one_process(tiny, dcp):
    """Chunked prefill on the ranks, decode, a second turn from the prefix cache, log-probabilities, and
    preemption (KV runs out: the newest request is recomputed) all equal the one-process engine."""
    cfg = dict(num_blocks=60, max_batched_tokens=256, record_prompt_logits=True)
    g = torch.Generator().manual_seed(dcp)
    ps = [torch.randint(1, 250, (n,), generator=g).tolist() for n in (300, 45, 500, 17)]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=3)
    one = Engine(tiny, EngineConfig(**cfg))
    ranked = Engine(tiny, EngineConfig(**cfg, dcp=dcp))
    try:
        assert len(ranked.pages) == dcp and ranked.pages[0].shape[3] == 16 // dcp
        a, b = one.generate(ps, sp), ranked.generate(ps, sp)
        assert [s.output_ids for s in a] == [s.output_ids for s in b]
        assert ranked.stats.preemptions > 0  # 60 blocks hold 960 tokens: the batch (1022) does not fit at once
        for x, y in zip(a, b):
            torch.testing.assert_close(x.prompt_logits, y.prompt_logits, rtol=0, atol=1e-4)
            for u, w in zip(x.output_logprobs, y.output_logprobs):
                assert abs(u.logprob - w.logprob) < 1e-4 and [t for t, _ in u.top] == [t for t, _ in w.top]
        turn2 = [ps[0] + list(a[0].output_ids) + [7, 8]]
        sp2 = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        hit = ranked.stats.device_cached_tokens
        assert [s.output_ids for s in one.generate(turn2, sp2)] == [s.output_ids for s in ranked.generate(turn2, sp2)]
        assert ranked.stats.device_cached_tokens > hit
        assert all(p.abs().sum() > 0 for p in ranked.pages)  # every rank holds KV
    finally:
        ranked.close()
    assert all(not p.is_alive() for p in ranked.context.procs)


def test_rank_killed_ends_the_group_and_leaks_nothing(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=64, dcp=2))
    lost = []
    engine.context.on_lost.append(lost.append)
    try:
        engine.add_request("r", list(range(1, 40)), SamplingParams(max_tokens=4, temperature=0))
        engine.step()  # the prompt, on both ranks
        os.kill(engine.context.procs[0].pid, 9)
        t0 = time.monotonic()
        while not lost and time.monotonic() - t0 < 1:
            time.sleep(0.01)
        assert lost and "dcp rank 1" in lost[0] and "-9" in lost[0]
        with pytest.raises(StepFailed) as e:
            engine.step()
        assert isinstance(e.value.cause, RanksLost) and e.value.request_ids == ["r"]
        assert engine.block_manager.num_free_blocks == 64 and not engine.sequences
    finally:
        engine.close()


def test_layouts_that_cannot_work_are_refused():
    with pytest.raises(ConfigError, match=r"decode.dcp = 3: dcp must divide the block size 16"):
        load_config(DecodeConfig, overrides=["dcp=3"])
    with pytest.raises(ConfigError, match="context-parallel ranks are decode's"):
        load_config(PrefillConfig, overrides=["engine.dcp=2"])
    with pytest.raises(ConfigError, match="CPU only"):
        load_config(DecodeConfig, overrides=["dcp=2", "engine.device=cuda"])
    assert load_config(DecodeConfig, overrides=["dcp=4"]).engine.dcp == 4
