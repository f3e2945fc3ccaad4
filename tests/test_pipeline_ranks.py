"""Pipeline-parallel prefill as ranks (shared/engine/pipeline.py): real processes joined by gloo, each
running its stage's layers. Output must equal the one-process engine's token for token; a rank that dies
ends the group at once and leaks no KV; layouts that cannot work are refused naming the key."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from services.decode.config import DecodeConfig
from services.prefill.config import PrefillConfig
from shared.config import ConfigError, load_config
from shared.engine.engine import Engine, EngineConfig, StepFailed
from shared.engine.pipeline import MIN_MICROBATCH_ROWS, cut_microbatches
from shared.engine.ranks import RanksLost
from shared.engine.runner import StepInputs
from shared.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def prompts(n: int, lengths=(300, 45, 700, 17)) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, 250, (k,), generator=g).tolist() for k in lengths]


def test_microbatches_cut_segments_and_keep_sampling_rows_last():
    # two prompts: rows 0..99 (context 150: 50 cached), rows 100..159 (context 60); both sample
    inp = StepInputs(list(range(160)), list(range(50, 150)) + list(range(60)), [0] * 160, [0] * 160,
                     [(0, 100, 150, [1, 2]), (100, 60, 60, [3])], sample_rows=[99, 159])
    parts = cut_microbatches(inp, 2)
    assert [(r.start, r.stop) for r, _ in parts] == [(0, 80), (80, 160)]
    (_, a), (_, b) = parts
    assert a.segments == [(0, 80, 130, [1, 2])] and a.out_rows == []  # first 80 rows: context ends at row 79
    assert b.segments == [(0, 20, 150, [1, 2]), (20, 60, 60, [3])] and b.out_rows == [19, 79]
    assert a.positions == inp.positions[:80] and b.positions == inp.positions[80:]
    # every row is in exactly one part, and the rows each part returns are the sampling rows, in order
    assert sum(p.returned_rows for _, p in parts) == 2
    assert [r.start + x for r, p in parts for x in p.out_rows] == inp.sample_rows


def test_small_steps_and_decode_steps_stay_whole():
    small = StepInputs([1] * 40, list(range(40)), [0] * 40, [0] * 40, [(0, 40, 40, [0, 1, 2])], sample_rows=[39])
    assert len(cut_microbatches(small, 4)) == 40 // MIN_MICROBATCH_ROWS
    decode = StepInputs([5, 6], [10, 20], [0, 1], [10, 4], None, [[0], [1, 2]], [11, 21], [0, 1])
    [(rows, plan)] = cut_microbatches(decode, 4)
    assert rows == range(2) and plan.out_rows is None and plan.tables == [[0], [1, 2]]


@pytest.mark.parametrize("pp", [2, 4])
def test_ranks_equal_one_process(tiny, pp):
    """Cold prompts in one batch (micro-batched, chunked over several steps), then a second turn that hits the
    prefix cache; tokens equal, first-token logits within float noise."""
    cfg = dict(num_blocks=256, max_batched_tokens=512, record_prompt_logits=True)
    one = Engine(tiny, EngineConfig(**cfg))
    ranked = Engine(tiny, EngineConfig(**cfg, pp=pp))
    try:
        assert ranked.layout.stages == pp and len(ranked.pipeline.procs) == pp - 1
        ps = prompts(pp)
        a, b = one.generate(ps, GREEDY), ranked.generate(ps, GREEDY)
        assert [s.output_ids for s in a] == [s.output_ids for s in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(x.prompt_logits, y.prompt_logits, rtol=0, atol=1e-4)
        turn2 = [p + list(s.output_ids) + [7, 8, 9] for p, s in zip(ps, a)]
        a2, b2 = one.generate(turn2, GREEDY), ranked.generate(turn2, GREEDY)
        assert [s.output_ids for s in a2] == [s.output_ids for s in b2]
        assert ranked.stats.device_cached_tokens > 0
        st = ranked.pipeline.stats
        assert st.microbatches > st.steps  # some steps were cut into micro-batches
        assert all(b > 0 for b in st.busy_ms) and 0 <= st.bubble < 1
        # every stage's page was written by its own rank: no stage's KV is all zeros
        assert all(page.abs().sum() > 0 for page in ranked.pages)
    finally:
        ranked.close()
    assert all(not p.is_alive() for p in ranked.pipeline.procs)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [{"pp": 2}, {"dcp": 2}], ids=["pp2", "dcp2"])
def test_smollm2_ranks_equal_one_process(smollm2, ranks):
    """The real model, chat prompts, as pipeline ranks and as context-parallel ranks (tests/test_context_parallel.py)."""
    one = Engine(smollm2, EngineConfig(num_blocks=256))
    ranked = Engine(smollm2, EngineConfig(num_blocks=256, **ranks))
    try:
        ps = [smollm2.tokenizer.chat_token_ids([{"role": "user", "content": q}]) for q in
              ("Write a Python function that reverses a string.", "What does a code reviewer check?")]
        sp = SamplingParams(max_tokens=24, temperature=0)
        assert [s.output_ids for s in one.generate(ps, sp)] == [s.output_ids for s in ranked.generate(ps, sp)]
    finally:
        ranked.close()


def _wait_for(cond, timeout: float) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)
    return time.monotonic() - t0


def test_rank_killed_while_idle_ends_the_group_at_once(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=128, pp=2))
    lost = []
    engine.pipeline.on_lost.append(lost.append)
    try:
        os.kill(engine.pipeline.procs[0].pid, 9)
        assert _wait_for(lambda: lost, 1.0) < 1.0
        assert "pipeline rank 1" in lost[0] and "-9" in lost[0]
        engine.add_request("r", prompts(1)[0], GREEDY)
        with pytest.raises(StepFailed) as e:
            engine.step()
        assert isinstance(e.value.cause, RanksLost) and e.value.request_ids == ["r"]
        assert engine.block_manager.num_free_blocks == 128 and not engine.sequences  # nothing leaked
    finally:
        engine.close()


def test_rank_killed_mid_step_fails_the_step_within_a_second(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=2048, pp=3, max_batched_tokens=16384,
                                       long_prefill_tokens=0))
    try:
        engine.add_request("long", torch.randint(1, 250, (12000,)).tolist(), GREEDY)
        engine.add_request("short", [5, 6, 7], GREEDY)
        failed: list = []

        def step():
            try:
                engine.step()
            except StepFailed as e:
                failed.append((time.monotonic(), e))

        t = threading.Thread(target=step)
        t.start()
        time.sleep(0.3)  # the step is running: a 12K-token prefill on 3 ranks takes seconds here
        killed_at = time.monotonic()
        os.kill(engine.pipeline.procs[1].pid, 9)
        t.join(10)
        assert failed, "the step did not fail"
        ended, err = failed[0]
        assert ended - killed_at < 1.0
        assert sorted(err.request_ids) == ["long", "short"] and "rank 2" in str(err.cause)
        assert engine.block_manager.num_free_blocks == 2048
        assert all(not p.is_alive() for p in engine.pipeline.procs)  # the survivor was stopped too
    finally:
        engine.close()


def test_layouts_that_cannot_work_are_refused(tiny):
    with pytest.raises(ValueError, match=r"prefill.pp = 5: more pipeline ranks than the model's 4 layers"):
        Engine(tiny, EngineConfig(num_blocks=64, pp=5))
    with pytest.raises(ConfigError, match="pipeline ranks are prefill's"):
        load_config(DecodeConfig, overrides=["engine.pp=2"])
    with pytest.raises(ConfigError, match="CPU only"):
        load_config(PrefillConfig, overrides=["pp=2", "engine.device=cuda"])
    with pytest.raises(ConfigError, match="sets engine.pp and engine.stages"):
        load_config(PrefillConfig, overrides=["pp=2", "engine.stages=3"])
    cfg = load_config(PrefillConfig, overrides=["pp=3"])
    assert cfg.engine.pp == 3 and cfg.engine.stages == 3


def test_up_refuses_more_ranks_than_layers(tmp_path):
    from infra.up import UpConfig, check_layout

    cfg = load_config(UpConfig, overrides=["up.model=tiny", "prefill.pp=8"])
    with pytest.raises(ConfigError, match=r"prefill.pp = 8: more pipeline ranks than tiny's 4 layers"):
        check_layout(cfg)
