"""moorage against transformers on random-weight checkpoints (Llama, Llama 3.x's llama3 RoPE scaling, linear
and YaRN scaling, Mistral, Qwen 2, Qwen 3, Gemma 3) loaded from Hugging Face directories (tests/random_oracle.py):
greedy output token for token, past Gemma 3's and Mistral's sliding windows, with prompts batched together and across block boundaries; and what the loader refuses of a config.
The same checks run on a GPU at the real models' shapes in tests/gpu/test_engine_gpu.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shared.engine.engine import Engine, EngineConfig
from shared.engine.hf_loader import read_hf_config
from shared.engine.model_config import ModelConfig
from shared.engine.rope_scaling import RopeScaling
from shared.engine.models import load_model
from shared.engine.sampling import SamplingParams
from tests import random_oracle as oracle

NEW_TOKENS = 24
LOGIT_ATOL = 1e-4  # fp32 on CPU: measured 2e-6..1e-5


@pytest.fixture(scope="module", params=["smollm2-small", "qwen2-small", "qwen3-small", "gemma3-small", "llama31-small",
                                        "llama-linear-small", "qwen2-yarn-small", "mistral-small",
                                        "gemma3-linear-small"])
def checkpoint(request, tmp_path_factory):
    model = oracle.build_hf_model(request.param)
    path = oracle.save_hf_model(model, tmp_path_factory.mktemp(request.param))
    return request.param, model, path


def test_greedy_equals_transformers(checkpoint):
    shape, model, path = checkpoint
    loaded = load_model(str(path))
    assert loaded.config.arch == oracle.SHAPES[shape]["arch"]
    engine = Engine(loaded, EngineConfig(num_blocks=256, kv_warm_ahead="0", max_batched_tokens=64))
    # 70 + 24 tokens run past gemma3-small's 24-token window; 64-token steps split the long prompt
    prompts = oracle.prompts(oracle.SHAPES[shape]["vocab_size"], (5, 17, 40, 70))
    want = oracle.hf_greedy(model, prompts, NEW_TOKENS)
    seqs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [s.output_ids for s in seqs] == want


def test_first_token_logits_match(checkpoint):
    shape, model, path = checkpoint
    engine = Engine(load_model(str(path)), EngineConfig(num_blocks=64, kv_warm_ahead="0", record_prompt_logits=True))
    prompt = oracle.prompts(oracle.SHAPES[shape]["vocab_size"], (50,), seed=7)[0]
    seq = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    ours = seq.prompt_logits.float().cpu()
    theirs = oracle.hf_last_logits(model, prompt)
    err = float((ours - theirs).abs().max())
    print(f"{shape}: max |logit diff| {err:.2e}")
    assert err < LOGIT_ATOL


# What each scaled shape would lose if the engine ignored it: the same check must then fail.
_IGNORED = {"llama31-small": {"rope_scaling": RopeScaling()}, "llama-linear-small": {"rope_scaling": RopeScaling()},
            "qwen2-yarn-small": {"rope_scaling": RopeScaling()}, "gemma3-linear-small": {"rope_scaling": RopeScaling()},
            "mistral-small": {"sliding_window": 0}}


@pytest.mark.parametrize("shape", sorted(_IGNORED))
def test_the_logit_check_sees_an_ignored_rope_scaling_or_window(shape, tmp_path):
    """The checks above are sensitive: serving these checkpoints without their scaling (as moorage did
    before) or without Mistral's window moves the first token's logits far past the tolerance."""
    model = oracle.build_hf_model(shape)
    path = oracle.save_hf_model(model, tmp_path / shape)
    loaded = load_model(str(path))
    loaded.config = dataclasses.replace(loaded.config, **_IGNORED[shape])
    engine = Engine(loaded, EngineConfig(num_blocks=64, kv_warm_ahead="0", record_prompt_logits=True))
    prompt = oracle.prompts(oracle.SHAPES[shape]["vocab_size"], (50,), seed=7)[0]
    seq = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    err = float((seq.prompt_logits.float().cpu() - oracle.hf_last_logits(model, prompt)).abs().max())
    print(f"{shape} without {list(_IGNORED[shape])}: max |logit diff| {err:.2e}")
    assert err > 100 * LOGIT_ATOL


def test_rope_types_that_change_with_the_sequence_length_are_refused(tmp_path):
    for rtype in ("dynamic", "longrope"):
        cfg = {**oracle.hf_config("smollm2-small").to_dict(),
               "rope_parameters": {"rope_type": rtype, "factor": 2.0, "rope_theta": 1e5}}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=f"rope_scaling type '{rtype}'.*sequence length"):
            read_hf_config(tmp_path, "l")


def test_rope_scaling_survives_the_model_cache_s_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(oracle.hf_config("llama31-small").to_dict()))
    c = read_hf_config(tmp_path, "l")
    assert (c.rope_scaling.type, c.rope_scaling.factor, c.rope_scaling.original_max_positions) == ("llama3", 8.0, 256)
    again = ModelConfig(**json.loads(json.dumps(dataclasses.asdict(c))))
    assert again.rope_scaling == c.rope_scaling


def _gemma_dir(tmp_path, **changes):
    cfg = oracle.hf_config("gemma3-small").to_dict()
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("changes, named", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"layer_types": ["full_attention"] * 7}, "layer_types"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e4}}},
     "local rope_scaling type 'linear'"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
])
def test_gemma3_configs_the_engine_cannot_serve_are_refused(tmp_path, changes, named):
    with pytest.raises(ValueError, match=named):
        read_hf_config(_gemma_dir(tmp_path, **changes), "g")


def test_gemma3_config_fields(tmp_path):
    c = read_hf_config(_gemma_dir(tmp_path), "g")
    assert (c.arch, c.head_dim, c.sliding_window, c.sliding_window_pattern) == ("gemma3", 64, 24, 6)
    assert (c.rope_theta, c.rope_local_theta, c.query_scale, c.tie_embeddings) == (1e6, 1e4, 64.0, True)
    assert [c.layer_window(i) for i in range(7)] == [24] * 5 + [0, 24]


@pytest.mark.parametrize("shape, changes, named", [
    ("qwen2-small", {"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
    ("qwen3-small", {"attention_bias": True}, "attention_bias"),
    ("qwen2-small", {"hidden_act": "gelu"}, "hidden_act"),
])
def test_qwen_configs_the_engine_cannot_serve_are_refused(tmp_path, shape, changes, named):
    cfg = {**oracle.hf_config(shape).to_dict(), **changes}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=named):
        read_hf_config(tmp_path, "q")


def test_qwen_config_fields(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(oracle.hf_config("qwen3-small").to_dict()))
    c = read_hf_config(tmp_path, "q")
    assert (c.arch, c.head_dim, c.qk_norm, c.qkv_bias, c.rope_theta, c.tie_embeddings) == ("qwen3", 64, True, False, 1e6, False)
    (tmp_path / "config.json").write_text(json.dumps(oracle.hf_config("qwen2-small").to_dict()))
    c = read_hf_config(tmp_path, "q")
    assert (c.arch, c.qk_norm, c.qkv_bias, c.sliding_window) == ("qwen2", False, True, 0)
