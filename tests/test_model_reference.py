"""The model's math against transformers' Llama on the SAME weights (moorage's own dequantized,
un-permuted tensors, saved as a Hugging Face directory), and a regression snapshot of the pinned SmolLM2.

Neither is an independent check of loading: the first shares moorage's loader, the snapshot
(fixtures/smollm2_regression_snapshot.json, made by fixtures/make_smollm2_regression_snapshot.py) was
recorded by moorage itself and only catches changes. The independent oracle (transformers loading the
GGUF with its own loader, tokenizer and chat template) is tests/test_oracle_transformers.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shared.engine.engine import Engine, EngineConfig
from shared.engine.hf_loader import save_hf_dir
from shared.engine.sampling import SamplingParams

SNAPSHOT = json.loads((Path(__file__).parent / "fixtures" / "smollm2_regression_snapshot.json").read_text())
MODELS = ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("model", MODELS, indirect=True)
def test_math_matches_transformers_on_moorage_weights(model, tmp_path):
    transformers = pytest.importorskip("transformers")
    save_hf_dir(tmp_path, model.config, model.weights)
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    ids = model.tokenizer.chat_token_ids([{"role": "user", "content": "Name three prime numbers."}])
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0, -1]
        ref_tokens = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    engine = Engine(model, EngineConfig(num_blocks=64, record_prompt_logits=True))
    [seq] = engine.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))
    torch.testing.assert_close(seq.prompt_logits, ref_logits, rtol=1e-4, atol=5e-4)
    assert seq.output_ids == ref_tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SNAPSHOT["slices"]))
def test_gguf_weights_match_regression_snapshot(smollm2, name):
    s = SNAPSHOT["slices"][name]
    w = smollm2.weights[name]
    vec = w[s["col"]:s["col"] + len(s["values"])] if s["row"] is None else w[s["row"], s["col"]:s["col"] + len(s["values"])]
    torch.testing.assert_close(vec, torch.tensor(s["values"]), rtol=0, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("case", SNAPSHOT["completions"], ids=lambda c: c["prompt"][:20])
def test_smollm2_greedy_matches_regression_snapshot(smollm2, case):
    ids = smollm2.tokenizer.chat_token_ids([{"role": "user", "content": case["prompt"]}])
    assert ids == case["prompt_ids"]
    engine = Engine(smollm2, EngineConfig(num_blocks=64))
    [seq] = engine.generate([ids], SamplingParams(max_tokens=24))
    assert seq.output_ids == case["output_ids"]
    assert seq.output_text == case["text"]
