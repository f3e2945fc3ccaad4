"""Decode through padded static batches (engine.cuda_graphs): the bookkeeping a CUDA graph replays, run
eagerly on CPU. The replay itself is checked on a device (tests/gpu/test_engine_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from shared.engine.decode_graphs import DecodeGraphs, batch_buckets, width_bucket
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams

def test_buckets():
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(30) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(5) == [1, 2, 4, 8]
    assert batch_buckets(1) == [1]
    assert [width_bucket(w) for w in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]


def test_bucket_for_and_what_runs_eagerly(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=64, max_num_seqs=6, cuda_graphs=True))
    g = engine.runner.graphs
    assert g.scratch == 64 and engine.pages[0].shape[0] == 65 and engine.block_manager.num_blocks == 64
    assert g.bucket_for(3, 3) == (4, 4)
    assert g.bucket_for(6, 1) == (8, 1)
    assert g.bucket_for(9, 1) is None                  # past the largest batch bucket: eager
    assert g.bucket_for(1, g.max_width + 1) is None    # wider than the model's context: eager
    assert g.bucket_for(1, g.max_width) == (1, g.max_width)
    with pytest.raises(ValueError, match="scratch block"):
        DecodeGraphs(engine.model, engine.pages, 16, 65, 4, 1024)


def _prompts(tokenizer, n: int) -> list[list[int]]:
    text = "def merge(a, b):\n    # merges two dicts recursively, lists concatenated\n"
    base = tokenizer.encode(text * 8)
    return [base[: 5 + 37 * i] for i in range(n)]


@pytest.mark.parametrize("model,stages", [("tiny", 1), ("tiny", 2), pytest.param("smollm2", 1, marks=pytest.mark.slow)],
                         indirect=["model"])
def test_greedy_is_identical_through_padded_static_batches(model, stages):
    """Seven sequences of different lengths ending at different steps: the batch shrinks 7 -> 1 through the
    buckets 8, 4, 2 and 1, and a bucket's rows that held a sequence one step are padding the next; with the KV
    split into two pipeline stages too (the scratch block is in each stage's pages)."""
    prompts = _prompts(model.tokenizer, 7)
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(7)]
    outs = {}
    for graphs in (False, True):
        engine = Engine(model, EngineConfig(num_blocks=256, max_num_seqs=8, stages=stages, cuda_graphs=graphs))
        outs[graphs] = [s.output_ids for s in engine.generate(prompts, params)]
        engine.block_manager.check_integrity()
    assert outs[True] == outs[False]
    stats = engine.runner.graphs.stats
    assert stats.padded > 20 and stats.eager == 0 and stats.replays == 0 and stats.recorded == 0  # CPU
    assert {b for b, _ in engine.runner.graphs.buckets} == {1, 2, 4, 8}


def test_padded_rows_write_only_the_scratch_block(tiny):
    """A step of 3 sequences in the bucket of 4: the only KV slots that change are the 3 new tokens' and the
    scratch block's first slot (the padded row's one-token context)."""
    engine = Engine(tiny, EngineConfig(num_blocks=64, max_num_seqs=4, cuda_graphs=True))
    for i, p in enumerate(_prompts(tiny.tokenizer, 3)):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while any(s.num_computed < len(s.prompt_ids) for s in engine.sequences.values()):
        engine.step()
    before = [p.clone() for p in engine.pages]
    seqs = list(engine.sequences.values())
    new_slots = {(s.block_table[s.num_computed // 16], s.num_computed % 16) for s in seqs}
    padded_before = engine.runner.graphs.stats.padded
    engine.step()
    assert engine.runner.graphs.stats.padded == padded_before + 1
    changed = set()
    for a, b in zip(before, engine.pages):
        diff = (a != b).flatten(4).any(-1).any(1).any(1)  # [blocks, block_size]: a slot whose K or V changed
        changed |= {tuple(ix) for ix in diff.nonzero().tolist()}
    assert changed == new_slots | {(64, 0)}



def test_recording_ahead_covers_every_bucket_largest_first_on_padding_rows(tiny, monkeypatch):
    """engine.cuda_graphs_ahead: every (batch, width) bucket is recorded at start-up, largest first, each after an
    eager step whose rows are all padding: that step writes nothing but the scratch block. CPU records nothing;
    here the recording itself is replaced (torch.cuda.graph needs a device: tests/gpu records for real)."""
    engine = Engine(tiny, EngineConfig(num_blocks=64, max_num_seqs=6, cuda_graphs=True))
    g = engine.runner.graphs
    assert g.record is False and g.stats.recorded == 0 and not g.buckets  # CPU: nothing ahead
    widths = [1 << i for i in range(g.max_width.bit_length())]
    assert g.all_buckets() == [(b, w) for b in (8, 4, 2, 1) for w in reversed(widths)]
    before = [p.clone() for p in engine.pages]
    order = []

    def record(b, key, eager):
        order.append(key)
        assert b.tables.shape == key and (b.tables == g.scratch).all()  # every row padding
        assert eager.shape == (key[0], tiny.config.vocab_size)  # the step run just before: the logits' shape
        b.graph = object()
        g.stats.recorded += 1
        if len(order) == 5:  # the fifth recording fails: graphs go off, nothing more is recorded
            g.record = False

    monkeypatch.setattr(g, "_record", record)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    g.record = True
    g.record_all()
    assert order == g.all_buckets()[:5] and g.stats.recorded == 5 and g.stats.padded == 0
    g.record = True
    g.record_all()  # goes on where it stopped: recorded buckets are not recorded again
    assert order == g.all_buckets() and g.stats.recorded == len(order) == 4 * len(widths)
    changed = set()
    for a, b in zip(before, engine.pages):
        diff = (a != b).flatten(4).any(-1).any(1).any(1)
        changed |= {blk for blk, _ in diff.nonzero().tolist()}
    assert changed == {g.scratch}
