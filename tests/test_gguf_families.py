"""GGUF files of the families agents run, against transformers (issue 28):

- tokenizers: a byte-level BPE vocabulary trained here, written as GGUF with each family's pre-tokenizer name
  (`tokenizer.ggml.pre`); moorage's tokenizer and transformers' own GGUF tokenizer (AutoTokenizer with
  gguf_file) read the same file and must give the same ids on a corpus of code, prose, non-Latin scripts,
  numbers and whitespace edge cases;
- weights: random-weight Llama, Qwen 2 and Qwen 3 checkpoints built by transformers, written as GGUF the way
  llama.cpp's converter names them; greedy output from the GGUF equals transformers' on the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from gguf import TokenType

from shared.engine.engine import Engine, EngineConfig
from shared.engine.hf_loader import load_hf_dir
from shared.engine.models import load_model
from shared.engine.rope_scaling import RopeScaling
from shared.engine.sampling import SamplingParams
from tests import random_oracle as oracle
from tests.test_loaders import write_gguf

CORPUS = [
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 12345\n",
    "for (let i = 0; i < arr.length; i++) { sum += arr[i] * 1000000; }\r\n",
    "The quick brown fox jumps over 1,234,567 lazy dogs. It's 3.14159 o'clock, isn't it? THEY'LL SEE.",
    "日本語のテキスト、中文文本和한국어 텍스트 — العربية русский ελληνικά हिन्दी",
    "emoji 🙂🚀 and ZWJ 👩‍💻, combining e\u0301 vs é, naïve café Ünïcödé",
    "   leading spaces\n\n\n\ttabs\t\tand   trailing   \n \n",
    "CamelCaseIdentifier snake_case_name SCREAMING_CASE x86_64 v2.0.1-rc3 0xDEADBEEF",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
]
PRE_TOKENIZERS = ("gpt2", "smollm", "llama-bpe", "qwen2", "tekken")
# transformers' GGUF mapping has no entry for 'smollm' and splits it as GPT-2; SmolLM2's own tokenizer.json
# isolates every digit, as moorage does (tests/test_tokenizer.py checks SmolLM2's known ids).
TRANSFORMERS_AGREES = tuple(p for p in PRE_TOKENIZERS if p != "smollm")


def trained_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE learned on the corpus with no split at all, so its merges cross digits, spaces and
    punctuation: each family's split then decides which of them apply, and a wrong split shows in the ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [int(TokenType.NORMAL)] * len(tokens)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types += [int(TokenType.CONTROL)] * 3
    return tokens, types, merges


def _with_vocab(config, weights, vocab):
    """The checkpoint cut to the trained vocabulary, its BOS and EOS on control tokens as real files have them
    (transformers makes BOS and EOS special whatever their type, which would split text at them)."""
    n = len(vocab[0])
    config = dataclasses.replace(config, vocab_size=n, bos_token_id=n - 3, eos_token_ids=(n - 1,))
    return config, {**weights, "embed_tokens": weights["embed_tokens"][:n]}


def _qwen2_files(tmp_path_factory, pres) -> dict:
    """One GGUF per pre-tokenizer name: the trained vocabulary on a small Qwen 2 shaped model."""
    vocab = trained_vocab()
    model = oracle.build_hf_model("qwen2-small")
    config, weights = load_hf_dir(oracle.save_hf_model(model, tmp_path_factory.mktemp("hf")))
    config, weights = _with_vocab(config, weights, vocab)
    return {pre: write_gguf(tmp_path_factory.mktemp(pre) / "m.gguf", config, weights, arch="qwen2", vocab=vocab,
                            pre=pre) for pre in pres}


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    return _qwen2_files(tmp_path_factory, PRE_TOKENIZERS)


def _theirs(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("pre", TRANSFORMERS_AGREES)
def test_token_ids_equal_transformers_for_each_pre_tokenizer(tokenizer_files, pre):
    ours, theirs = load_model(str(tokenizer_files[pre])).tokenizer, _theirs(tokenizer_files[pre])
    for text in CORPUS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), (pre, text)
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_the_corpus_tells_the_pre_tokenizers_apart(tokenizer_files):
    """Sensitivity of the check above: every pair of splits gives different ids somewhere in the corpus,
    so tokenizing one family as if it were another (what moorage did with every unknown pre-tokenizer
    before) cannot pass it."""
    ids = {pre: [load_model(str(f)).tokenizer.encode(t) for t in CORPUS] for pre, f in tokenizer_files.items()}
    for a in PRE_TOKENIZERS:
        for b in PRE_TOKENIZERS:
            assert a == b or ids[a] != ids[b], (a, b)


def test_an_unknown_pre_tokenizer_is_refused_by_name(tmp_path_factory):
    [path] = _qwen2_files(tmp_path_factory, ["deepseek-llm"]).values()
    with pytest.raises(ValueError, match="unsupported BPE pre-tokenizer 'deepseek-llm'"):
        load_model(str(path))


def llama_cpp_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """The rope_freqs tensor llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors)
    writes for a llama3 rope_scaling, transcribed: a divisor per frequency."""
    base = rope["rope_theta"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_a_llama_3_1_gguf_with_rope_freqs_equals_transformers(tmp_path):
    """Llama 3.1's llama3 RoPE scaling as GGUF files carry it (a rope_freqs tensor, not config keys)."""
    model = oracle.build_hf_model("llama31-small")
    config, weights = load_hf_dir(oracle.save_hf_model(model, tmp_path / "hf"))
    rope = oracle.SHAPES["llama31-small"]["rope_parameters"]
    factors = llama_cpp_rope_factors(rope, config.head_dim)
    plain = dataclasses.replace(config, rope_scaling=RopeScaling())  # the GGUF's config keys: no scaling
    path = write_gguf(tmp_path / "l31.gguf", plain, weights, extra={"rope_freqs.weight": factors})
    loaded = load_model(str(path))
    assert loaded.config.rope_scaling.type == "freq_factors"
    engine = Engine(loaded, EngineConfig(num_blocks=128, kv_warm_ahead="0", max_batched_tokens=64))
    prompts = oracle.prompts(oracle.SHAPES["llama31-small"]["vocab_size"], (9, 70))
    want = oracle.hf_greedy(model, prompts, 16)
    seqs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [s.output_ids for s in seqs] == want
    assert not np.allclose(factors, 1.0)  # the scaling is there to be honoured (dropping it: tests/test_random_oracle.py)


_GGUF_ARCH = {"smollm2-small": "llama", "qwen2-small": "qwen2", "qwen3-small": "qwen3"}


@pytest.mark.parametrize("shape", sorted(_GGUF_ARCH))
def test_gguf_greedy_equals_transformers(shape, tmp_path):
    model = oracle.build_hf_model(shape)
    config, weights = load_hf_dir(oracle.save_hf_model(model, tmp_path / "hf"))
    path = write_gguf(tmp_path / f"{shape}.gguf", config, weights, arch=_GGUF_ARCH[shape])
    loaded = load_model(str(path))
    assert (loaded.config.arch, loaded.config.head_dim, loaded.config.qkv_bias, loaded.config.qk_norm) == \
        (_GGUF_ARCH[shape], config.head_dim, config.qkv_bias, config.qk_norm)
    engine = Engine(loaded, EngineConfig(num_blocks=128, kv_warm_ahead="0", max_batched_tokens=64))
    prompts = oracle.prompts(oracle.SHAPES[shape]["vocab_size"], (9, 70))
    want = oracle.hf_greedy(model, prompts, 16)
    seqs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [s.output_ids for s in seqs] == want
