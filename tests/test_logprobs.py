"""Per-token log-probabilities (SamplingParams.logprobs): each output token's number is the log-softmax of the
logits a from-scratch forward pass gives at that position, with the most likely alternatives, whether the
token was chosen greedily or sampled, in a batch beside requests that did not ask, and before a grammar's mask.
Through the whole system (openai SDK, prefill's first token, decode's next ones, a cached turn):
tests/test_e2e.py::test_logprobs_through_the_system_equal_the_engine_s."""

from __future__ import annotations

import llguidance
import msgspec
import pytest
import torch

from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprob
from shared.messages import TokenChunk

PROMPT = "def merge(a, b):\n    # merges two dicts recursively\n"


def from_scratch(tiny, ids: list[int]) -> torch.Tensor:
    """The log-softmax of the logits after `ids`, from a fresh engine (no prefix cache, no decode step)."""
    engine = Engine(tiny, EngineConfig(num_blocks=128, enable_prefix_cache=False, record_prompt_logits=True))
    [seq] = engine.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
    return torch.log_softmax(seq.prompt_logits.float(), -1)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=5),
                                    SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3, temperature=8.0,
                                                   seed=7)], ids=["greedy", "sampled"])
def test_each_token_s_logprobs_are_the_from_scratch_distribution(tiny, params):
    prompt = tiny.tokenizer.encode(PROMPT)
    engine = Engine(tiny, EngineConfig(num_blocks=256))
    [seq] = engine.generate([prompt], params)
    assert len(seq.output_logprobs) == len(seq.output_ids) == 10
    for i, (token, lp) in enumerate(zip(seq.output_ids, seq.output_logprobs)):
        ref = from_scratch(tiny, prompt + seq.output_ids[:i])  # position i: the first token on prefill, the rest decode
        top = torch.topk(ref, params.logprobs)
        assert lp.logprob == pytest.approx(ref[token].item(), abs=1e-4)
        assert [a for a, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        if params.greedy:
            assert lp.top[0] == (token, lp.logprob)
    if not params.greedy:  # sampling at 8 left the argmax at least once: the numbers are the model's, not T's
        assert any(lp.top[0][0] != t for t, lp in zip(seq.output_ids, seq.output_logprobs))


def test_only_the_requests_that_ask_get_logprobs_and_nobody_s_tokens_change(tiny):
    prompts = [tiny.tokenizer.encode(PROMPT), tiny.tokenizer.encode("import os\nimport sys\n")]
    plain = [SamplingParams(max_tokens=8, ignore_eos=True)] * 2
    asked = [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0), plain[1]]
    base = [s.output_ids for s in Engine(tiny, EngineConfig(num_blocks=256)).generate(prompts, plain)]
    seqs = Engine(tiny, EngineConfig(num_blocks=256)).generate(prompts, asked)
    assert [s.output_ids for s in seqs] == base
    assert len(seqs[0].output_logprobs) == 8 and all(lp.top == () for lp in seqs[0].output_logprobs)
    assert seqs[1].output_logprobs == []


def test_logprobs_are_taken_before_a_grammar_masks_the_logits(tiny):
    """A grammar that allows one digit only: the token is a digit, but its log-probability and the alternatives
    are the model's own (the alternatives include tokens the grammar forbids)."""
    grammar = llguidance.LLMatcher.grammar_from_lark('start: /[0-9]/')
    prompt = tiny.tokenizer.encode(PROMPT)
    [guided] = Engine(tiny, EngineConfig(num_blocks=256)).generate(
        [prompt], SamplingParams(max_tokens=4, logprobs=4, grammar=grammar))
    ref = from_scratch(tiny, prompt)
    token, lp = guided.output_ids[0], guided.output_logprobs[0]
    assert chr(token) in "0123456789"
    assert lp.logprob == pytest.approx(ref[token].item(), abs=1e-4)
    assert [a for a, _ in lp.top] == torch.topk(ref, 4).indices.tolist()
    assert any(not chr(a).isdigit() for a, _ in lp.top if a < 256)


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 2.0])
def test_bad_logprobs_counts_are_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        SamplingParams(logprobs=bad)


def test_logprobs_ride_the_bus_with_their_tokens():
    chunk = TokenChunk("r", [5, 6], "ab", logprobs=[TokenLogprob(-0.25, ((5, -0.25), (9, -2.0))), TokenLogprob(-1.5)])
    back = TokenChunk.decode(chunk.encode())
    assert back.logprobs == chunk.logprobs and back.token_ids == [5, 6]
    assert TokenChunk.decode(TokenChunk("r", [5], "a").encode()).logprobs is None
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"logprobs": 100}, SamplingParams)


TEXTS = ["Hello, wörld! 你好 🙂 — naïve café\n\tdef f(x): return x**2", "<|im_start|>user\nhi<|im_end|>"]


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)], indirect=True)
def test_each_token_s_bytes_join_into_the_text(model):
    """Tokenizer.token_bytes (what `bytes` and the token texts are made of): a text's tokens' bytes, joined, are
    the text's own UTF-8, multi-byte characters split across tokens and special tokens included; Gemma's
    SentencePiece spelling is checked in tests/test_gemma3.py."""
    tok = model.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == tok.decode(ids, skip_special_tokens=False).encode()


def test_completion_offsets_count_the_answer_s_characters(tiny):
    """text_offset: the characters of the answer before each token, a character split over byte tokens counted
    where it completes, a special token (left out of the text) counted as nothing; across chunks too."""
    from services.router.logprobs import LogprobRender

    tok, lp = tiny.tokenizer, TokenLogprob(-1.0)
    render = LogprobRender(tok)
    ids = tok.encode("aé<|im_end|>€b")
    first = render.completion([(i, lp) for i in ids])
    assert first["text_offset"] == [0, 1, 1, 2, 2, 2, 2, 3]
    assert first["tokens"][1:4] == ["bytes:\\xc3", "bytes:\\xa9", "<|im_end|>"]
    assert render.completion([(ord("c"), lp)])["text_offset"] == [4] == [len(tok.decode(ids))]
