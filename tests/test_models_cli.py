"""`moorage models`: what it says a model is, and whether it would load, agrees with what loading does; a
model moorage cannot serve is named with the loader's reason and the command exits 1."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from infra.cli import main
from shared.engine.engine import Engine, EngineConfig
from shared.engine.models import load_model
from tests import random_oracle as oracle


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return oracle.save_hf_model(oracle.build_hf_model("qwen3-small"), tmp_path_factory.mktemp("qwen3"))


def _run(capsys, *argv) -> tuple[int, list[dict]]:
    rc = main(["models", "--json", *argv])
    return rc, [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_a_loadable_directory_is_described_as_the_engine_would_load_it(capsys, qwen3_dir):
    rc, [r] = _run(capsys, str(qwen3_dir))
    assert rc == 0 and r["loadable"], r["reason"]
    c = load_model(str(qwen3_dir)).config
    assert (r["arch"], r["layers"], r["heads"], r["context"]) == ("qwen3", c.num_layers, "4/2 x 64", c.max_context)
    assert r["kv_bytes_per_token"] == {"float32": 2 * 3 * 2 * 64 * 4, "bfloat16": 2 * 3 * 2 * 64 * 2}
    assert r["stored_dtypes"] == {"F32": 3 * 11 + 3}  # 11 per layer (q/k norms), embeddings, final norm, lm_head
    assert r["parameters"] == sum(t.numel() for t in load_model(str(qwen3_dir)).weights.values())
    assert r["tokenizer"] == "bytes (no tokenizer.json)"


def test_the_text_form_names_the_essentials(capsys, qwen3_dir):
    assert main(["models", str(qwen3_dir)]) == 0
    out = capsys.readouterr().out
    assert "loadable (hf)" in out and "qwen3, 3 layers, heads 4/2 x 64" in out and "3,072 B (float32)" in out


def _copy_with(tmp_path, src, config_changes=None, extra_tensor=None):
    dst = tmp_path / "m"
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **(config_changes or {})}))
    tensors = load_file(str(src / "model.safetensors"))
    if extra_tensor:
        tensors[extra_tensor] = torch.zeros(4)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("changes, extra, named", [
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}, None, "'dynamic'"),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, None, "unsupported model_type 'mixtral'"),
    (None, "model.layers.0.self_attn.o_proj.bias", "does not use: ['layers.0.o_proj.bias']"),
    (None, None, None),
])
def test_what_moorage_would_refuse_is_named_and_exits_1(capsys, tmp_path, qwen3_dir, changes, extra, named):
    path = _copy_with(tmp_path, qwen3_dir, changes, extra)
    rc, [r, tiny] = _run(capsys, str(path), "tiny")
    assert tiny["loadable"]  # one refused model among loadable ones still fails the command
    if named is None:  # the unchanged copy loads: the refusals above come from the changes
        assert rc == 0 and r["loadable"]
        return
    assert rc == 1 and not r["loadable"] and named in r["reason"]
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]").replace("'", ".")):
        Engine(load_model(str(path)), EngineConfig(num_blocks=8))  # loading refuses it for the same reason


def test_an_unknown_path_is_not_a_model(capsys, tmp_path):
    rc, [r] = _run(capsys, str(tmp_path / "nothing"))
    assert rc == 1 and "not a model" in r["reason"]
