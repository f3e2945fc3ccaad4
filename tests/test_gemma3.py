"""Gemma 3 270M, the second bundled model (issue 28): 32K context, sliding-window layers, SentencePiece
tokenizer, all read from its GGUF file, and exact against transformers, which loads the same file itself
(`gguf_file=`: its own tensor mapping, tokenizer conversion and Gemma 3 code).

Checked on a prompt past the sliding window (512 tokens): token ids, the first token's logits (max abs
difference <= LOGIT_ATOL; measured 1.4e-4), and a greedy continuation token for token. moorage's own paths
must not change a token: chunked prefill (a window boundary inside a step) and a prefix-cache hit.
"""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import Engine, EngineConfig
from shared.engine.models import gemma3_gguf_path, load_model, load_tokenizer
from shared.engine.sampling import SamplingParams

pytestmark = pytest.mark.slow
LOGIT_ATOL = 1e-3
TOKENS = 24
TEXT = ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n' * 40
        + "# Now a function that sorts a list:\ndef")


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m")


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gemma3_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_the_config_is_gemma3_s(gemma):
    c = gemma.config
    assert (c.arch, c.num_layers, c.head_dim, c.num_kv_heads, c.sliding_window, c.max_context) == \
        ("gemma3", 18, 256, 1, 512, 32768)
    assert [i for i in range(c.num_layers) if not c.layer_window(i)] == [5, 11, 17]  # global every 6th
    assert gemma.tokenizer.eos_token_ids == (1, 106)  # <eos>, <end_of_turn>


@pytest.mark.parametrize("text", [TEXT, "  spaces\tand\ttabs\n\nüñíçødé 🍕 日本語 1234567 <start_of_turn>x<end_of_turn>"])
def test_the_tokenizer_is_transformers(hf, text):
    tok, _ = load_tokenizer("gemma3-270m")
    ids = tok.encode(text)
    assert ids == hf[1].encode(text) and ids[0] == 2  # <bos> first, as the file says
    assert tok.decode(ids) == hf[1].decode(ids, skip_special_tokens=True)


def test_each_token_s_bytes_join_into_the_text(gemma):
    """SentencePiece's spelling (▁ for a space, <0xE2> byte-fallback pieces) undone per token
    (Tokenizer.token_bytes, what log-probabilities' `bytes` are): joined, the text's own UTF-8."""
    tok = gemma.tokenizer
    for text in ("Hello, wörld! 你好 🙂 — naïve café\n\tdef f(x): return x**2", "<start_of_turn>user\nhi",
                 "𓀀𓂀 ꙮ"):  # 𓀀 and ꙮ: not in the vocabulary, so byte-fallback pieces
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == tok.decode(ids, skip_special_tokens=False).encode()


def test_greedy_output_past_the_window_equals_transformers(gemma, hf):
    ids = gemma.tokenizer.encode(TEXT)
    assert len(ids) > 512
    engine = Engine(gemma, EngineConfig(num_blocks=256, record_prompt_logits=True))
    [seq] = engine.generate([ids], SamplingParams(max_tokens=TOKENS))
    with torch.no_grad():
        want = hf[0].generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False)[0, len(ids):].tolist()
        logits = hf[0](torch.tensor([ids])).logits[0, -1]
    diff = (logits - seq.prompt_logits).abs().max().item()
    print(f"\ngemma3-270m, {len(ids)}-token prompt: first-token logits max |diff| {diff:.2e}; {seq.output_text!r}")
    assert diff <= LOGIT_ATOL
    assert seq.output_ids == want


def test_chunked_prefill_and_a_prefix_cache_hit_change_no_token(gemma):
    ids = gemma.tokenizer.encode(TEXT)
    [whole] = Engine(gemma, EngineConfig(num_blocks=256)).generate([ids], SamplingParams(max_tokens=TOKENS))
    chunked = Engine(gemma, EngineConfig(num_blocks=256, max_batched_tokens=96, long_prefill_tokens=96))
    [a] = chunked.generate([ids], SamplingParams(max_tokens=TOKENS))
    [b] = chunked.generate([ids + whole.output_ids[:5]], SamplingParams(max_tokens=TOKENS - 5))
    assert a.output_ids == whole.output_ids and b.num_device_cached > 512
    assert b.output_ids == whole.output_ids[5:]


def test_what_the_engine_does_not_implement_is_refused_by_name(gemma, tmp_path):
    from shared.engine.model import LlamaModel
    from shared.kv_layout import KVLayout

    c = gemma.config
    layout = KVLayout(c.num_layers, c.num_kv_heads, c.head_dim)
    with pytest.raises(ValueError, match="does not use: \\['layers.0.extra_bias'\\]"):
        LlamaModel(c, {**gemma.weights, "layers.0.extra_bias": torch.zeros(1)}, layout)
    with pytest.raises(ValueError, match="unsupported architecture 'mamba'"):
        from dataclasses import replace
        replace(c, arch="mamba")
