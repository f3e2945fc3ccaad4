"""The cache is the product: KV reused from the prefix cache, recomputed in chunks, packed for the
store or handed off to another engine must continue to exactly the tokens computed from scratch."""

from __future__ import annotations

import pytest
import torch

from kernels import get_kv_kernels
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.hashing import CHUNK_TOKENS

MODELS = ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
KERNELS = get_kv_kernels("cpu")

QUESTION_1 = ("You are reviewing a Python repository. The file utils.py defines parse_config(path), which "
              "reads a TOML file and returns a dict, and merge(a, b), which merges two dicts recursively. "
              "Explain what could go wrong when merge is called with lists as values.")
QUESTION_2 = "Now write a unit test for merge that covers nested lists and empty dicts."


def scratch(loaded, prompt, params=GREEDY, **cfg):
    """Reference: no prefix cache, one stage, default chunking."""
    engine = Engine(loaded, EngineConfig(num_blocks=256, enable_prefix_cache=False, **cfg))
    [seq] = engine.generate([prompt], params)
    return seq


def two_turns(loaded, engine, params=GREEDY):
    tok = loaded.tokenizer
    history = [{"role": "user", "content": QUESTION_1}]
    turn1 = tok.chat_token_ids(history)
    [first] = engine.generate([turn1], params)
    history += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": QUESTION_2}]
    turn2 = tok.chat_token_ids(history)
    assert turn2[:len(turn1)] == turn1, "the chat template must make turn 2 extend turn 1"
    return turn1, turn2


@pytest.mark.parametrize("model", MODELS, indirect=True)
@pytest.mark.parametrize("stages", [1, 2])
def test_turn2_from_prefix_cache_equals_scratch(model, stages):
    engine = Engine(model, EngineConfig(num_blocks=256, stages=stages))
    turn1, turn2 = two_turns(model, engine)
    computed_before = engine.stats.prefill_tokens_computed
    [second] = engine.generate([turn2], GREEDY)
    cached = second.num_device_cached
    assert cached >= (len(turn1) // 16) * 16 > 0
    # the hit really skipped compute: only the uncached tail was prefilled
    assert engine.stats.prefill_tokens_computed - computed_before == len(turn2) - cached
    assert second.output_ids == scratch(model, turn2).output_ids
    engine.block_manager.check_integrity()


def test_corrupted_cached_kv_changes_output(tiny):
    """Negative control: the comparison above can fail, because cached KV is really read."""
    engine = Engine(tiny, EngineConfig(num_blocks=256))
    turn1, turn2 = two_turns(tiny, engine)
    for block in engine.block_manager.match_prefix(turn2).block_ids:
        engine.pages[0][block].normal_()
    [second] = engine.generate([turn2], GREEDY)
    assert second.num_device_cached > 0
    assert second.output_ids != scratch(tiny, turn2).output_ids


@pytest.mark.parametrize("model,chunk", [("tiny", 37), pytest.param("smollm2", 50, marks=pytest.mark.slow)],
                         indirect=["model"])
def test_chunked_prefill_equals_one_shot(model, chunk):
    prompt = model.tokenizer.chat_token_ids([{"role": "user", "content": QUESTION_1}])
    outs = {}
    for name, mbt in (("one_shot", 4096), ("chunked", chunk)):
        engine = Engine(model, EngineConfig(num_blocks=256, max_batched_tokens=mbt, long_prefill_tokens=0,
                                            record_prompt_logits=True, enable_prefix_cache=False))
        [seq] = engine.generate([prompt], GREEDY)
        outs[name] = (seq, engine.stats.prefill_steps)
    (one, one_steps), (chunked, chunked_steps) = outs["one_shot"], outs["chunked"]
    assert one_steps == 1 and chunked_steps == -(-len(prompt) // chunk)
    assert chunked.output_ids == one.output_ids
    torch.testing.assert_close(chunked.prompt_logits, one.prompt_logits, rtol=1e-4, atol=1e-3)


def test_batched_decode_equals_single(tiny):
    prompts = [tiny.tokenizer.encode(f"request {i}: " + "lorem ipsum " * (i * 7 + 1)) for i in range(5)]
    engine = Engine(tiny, EngineConfig(num_blocks=256))
    batched = engine.generate(prompts, GREEDY)
    assert engine.stats.decode_steps < sum(s.params.max_tokens for s in batched)  # decoded together
    for prompt, seq in zip(prompts, batched):
        assert seq.output_ids == scratch(tiny, prompt).output_ids


def test_preemption_recomputes_to_same_tokens(tiny):
    prompts = [tiny.tokenizer.encode(f"session {i} " * 20) for i in range(4)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine = Engine(tiny, EngineConfig(num_blocks=40))  # 640 tokens for 4 x ~(180 + 40): must preempt
    seqs = engine.generate(prompts, params)
    assert engine.stats.preemptions > 0
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_ids == scratch(tiny, prompt, params).output_ids
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == 40


def test_preemption_takes_the_lowest_priority_first(tiny):
    """Decode's eviction order (agent hints, issue 30): out of KV, the lowest priority loses its blocks first,
    not simply the newest. Two requests of priority 0 run, then one of priority 5 joins (the newest): it is
    never preempted, the newer priority-0 one is (the old rule took the newest), and every output is still
    the scratch one."""
    prompts = [tiny.tokenizer.encode(f"session {i} " * 20) for i in range(3)]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    engine = Engine(tiny, EngineConfig(num_blocks=42))  # 3 prompts of 200 fit (39 blocks); 3 x 260 do not
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts[:2])]
    for _ in range(4):
        engine.step()
    seqs.append(engine.add_request("r2", prompts[2], params, priority=5))
    while engine.has_unfinished():
        engine.step()
    assert [s.num_preemptions for s in seqs] == [0, 1, 0]
    for prompt, seq in zip(prompts, seqs):
        assert seq.output_ids == scratch(tiny, prompt, params).output_ids
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == 42


def _long_prompt(loaded, n_tokens):
    text = " ".join(f"step {i}: call tool read_file on src/module_{i % 13}.py and summarise it." for i in range(400))
    ids = loaded.tokenizer.encode(text)
    assert len(ids) >= n_tokens
    return ids[:n_tokens]


@pytest.mark.parametrize("model", MODELS, indirect=True)
def test_pack_unpack_restore_continues_identically(model):
    """Chunks packed from one engine and unpacked into another (what a store restore does) are
    matched as a prefix there and continue to the scratch tokens."""
    prompt = _long_prompt(model, 2 * CHUNK_TOKENS + 40)
    src = Engine(model, EngineConfig(num_blocks=64, stages=2))
    [done] = src.generate([prompt], SamplingParams(max_tokens=1))
    src_blocks = src.block_manager.match_prefix(prompt).block_ids
    dst = Engine(model, EngineConfig(num_blocks=64, stages=2))
    per_chunk = CHUNK_TOKENS // 16
    table: list[int] = []
    for c in range(2):
        fresh = dst.block_manager.allocate(per_chunk)
        for s in range(2):
            payload = KERNELS.pack_chunk(src.pages[s], src_blocks[c * per_chunk:(c + 1) * per_chunk])
            dst.pages[s][fresh].fill_(float("nan"))
            KERNELS.unpack_chunk(payload.flatten(), dst.pages[s], fresh)
        table += fresh
        dst.block_manager.register_full_blocks(table, prompt, len(table), start_block=len(table) - per_chunk)
    dst.block_manager.release(reversed(table))
    extended = prompt + model.tokenizer.encode(" Continue.")
    [restored] = dst.generate([extended], GREEDY)
    assert restored.num_device_cached == 2 * CHUNK_TOKENS
    assert dst.stats.prefill_tokens_computed == len(extended) - 2 * CHUNK_TOKENS
    assert restored.output_ids == scratch(model, extended).output_ids
    dst.block_manager.check_integrity()


@pytest.mark.parametrize("model", MODELS, indirect=True)
def test_gather_scatter_handoff_continues_identically(model):
    """Prefill engine (2 stages) -> gather -> scatter into a decode engine (1 stage) -> decode."""
    prompt = _long_prompt(model, 300)  # not a multiple of the block size: partial last block
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prefill = Engine(model, EngineConfig(num_blocks=64, stages=2))
    seq = prefill.add_request("r1", prompt, SamplingParams(max_tokens=1, ignore_eos=True), retain_kv=True)
    while not seq.is_finished:
        prefill.step()
    [buf] = KERNELS.gather_for_ranks(prefill.pages, seq.block_table, len(prompt), 1, prefill.layout)
    prefill.block_manager.release(seq.block_table)  # the "being sent" owner lets go
    prefill.block_manager.check_integrity()

    decode = Engine(model, EngineConfig(num_blocks=64, stages=1))
    landing = decode.block_manager.allocate(-(-len(prompt) // 16))
    decode.pages[0][landing].fill_(float("nan"))
    KERNELS.scatter_from_rank(buf, decode.pages[0], landing, len(prompt))
    cont = decode.adopt_prefilled("r1", prompt, seq.output_ids, params, landing)
    while not cont.is_finished:
        decode.step()
    assert decode.stats.prefill_tokens_computed <= 1  # only the first output token, never the prompt
    assert cont.output_ids == scratch(model, prompt, params).output_ids
    decode.block_manager.check_integrity()


def test_kv_events_mirror_the_index(tiny):
    events = []
    engine = Engine(tiny, EngineConfig(num_blocks=32), on_kv_event=events.append)
    prompt = _long_prompt(tiny, 200)
    engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    stored = [h for e in events if type(e).__name__ == "BlockStored" for h in e.block_hashes]
    assert stored[:200 // 16] == engine.block_manager.block_hashes(prompt)
    assert all(engine.block_manager.lookup(h) is not None for h in stored)


def test_context_and_capacity_limits(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=8))
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("a", [1] * 100, SamplingParams(max_tokens=tiny.config.max_context))
    with pytest.raises(ValueError, match="KV capacity"):
        engine.add_request("b", [1] * 100, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("c", [10**6], SamplingParams())
    assert not engine.has_unfinished()


def test_pinned_blocks_survive_until_admission_and_are_released(tiny):
    """What a pool restore does: blocks registered and pinned before the request is queued are matched
    at admission and then handed back; a rejected request releases them too."""
    prompt = _long_prompt(tiny, 100)
    engine = Engine(tiny, EngineConfig(num_blocks=16))
    [first] = engine.generate([prompt], SamplingParams(max_tokens=1))
    bm = engine.block_manager
    pinned = bm.match_prefix(prompt).block_ids
    bm.acquire(pinned)
    seq = engine.add_request("p", prompt, SamplingParams(max_tokens=4, ignore_eos=True), pinned_blocks=pinned,
                             restored_range=(0, 64))
    while not seq.is_finished:
        engine.step()
    assert seq.num_device_cached == len(pinned) * 16 and seq.num_store_tokens == 64
    bm.check_integrity()
    assert bm.num_free_blocks == 16
    bm.acquire(pinned)
    with pytest.raises(ValueError):
        engine.add_request("q", prompt, SamplingParams(max_tokens=10**6), pinned_blocks=pinned)
    assert bm.num_free_blocks == 16


def test_pins_of_queued_requests_never_starve_the_head(tiny):
    """Restored-and-pinned blocks of requests waiting behind the head are given up when the head
    cannot otherwise be scheduled: no deadlock, same output."""
    engine = Engine(tiny, EngineConfig(num_blocks=24, max_num_seqs=1))
    bm = engine.block_manager
    warm = [_long_prompt(tiny, 160)[i:] + [7] * i for i in (1, 2)]  # two distinct 160-token histories
    for p in warm:
        engine.generate([p], SamplingParams(max_tokens=1))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    head = engine.add_request("head", _long_prompt(tiny, 300), params)
    queued = []
    for i, p in enumerate(warm):  # pinned like a restore would: 10 blocks each, 20 of 24
        pinned = bm.match_prefix(p).block_ids
        bm.acquire(pinned)
        queued.append(engine.add_request(f"q{i}", p + [1, 2, 3], params, pinned_blocks=pinned))
    for _ in range(500):
        if not engine.has_unfinished():
            break
        engine.step()
    assert head.is_finished and all(q.is_finished for q in queued)
    assert head.output_ids == scratch(tiny, _long_prompt(tiny, 300), params).output_ids
    bm.check_integrity()
    assert bm.num_free_blocks == 24


def test_pins_never_stall_a_running_chunked_prefill(tiny):
    """A prompt being prefilled in chunks needs more blocks while requests queued behind it hold
    pins on the rest: the pins go, the prompt finishes."""
    engine = Engine(tiny, EngineConfig(num_blocks=24, max_batched_tokens=64, max_num_seqs=1))
    bm = engine.block_manager
    warm = _long_prompt(tiny, 160)[3:] + [9, 9, 9]
    engine.generate([warm], SamplingParams(max_tokens=1))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    head = engine.add_request("head", _long_prompt(tiny, 300), params)
    engine.step()  # head is running: 64 of its 300 tokens computed
    pinned = bm.match_prefix(warm).block_ids
    bm.acquire(pinned)
    engine.add_request("queued", warm + [1], params, pinned_blocks=pinned)
    for _ in range(500):
        if not engine.has_unfinished():
            break
        engine.step()
    assert head.is_finished and not engine.has_unfinished()
    assert head.output_ids == scratch(tiny, _long_prompt(tiny, 300), params).output_ids
    bm.check_integrity()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_runs_the_same_after_its_model_lets_go_of_the_loaded_weights(dtype):
    """What prefill and decode do once their engine is built (LoadedModel.release_weights): one copy of the
    weights stays resident, and the engine's output does not change."""
    from shared.engine.models import load_model

    loaded = load_model("tiny", max_context=512)
    prompt = loaded.tokenizer.encode(QUESTION_1)
    before = scratch(loaded, prompt, dtype=dtype).output_ids
    engine = Engine(loaded, EngineConfig(num_blocks=256, enable_prefix_cache=False, dtype=dtype))
    loaded.release_weights()
    assert loaded.weights == {}
    [seq] = engine.generate([prompt], GREEDY)
    assert seq.output_ids == before
