"""Read a Hugging Face style model directory (config.json + *.safetensors) into our weight names."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from shared.engine.model_config import ModelConfig

_PREFIX = "model."


def read_hf_config(model_dir: Path, name: str) -> ModelConfig:
    cfg = json.loads((model_dir / "config.json").read_text())
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    if cfg.get("model_type", "llama") != "llama" and "LlamaForCausalLM" not in archs:
        raise ValueError(f"unsupported model_type {cfg.get('model_type')!r} (only llama)")
    scaling = cfg.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else scaling
    unsupported = {"rope_scaling": f"rope_scaling type {kind!r}" if kind != "default" else None,
                   "attention_bias": "q/k/v/o biases" if cfg.get("attention_bias") else None,
                   "mlp_bias": "MLP biases" if cfg.get("mlp_bias") else None,
                   "sliding_window": "a sliding window" if cfg.get("sliding_window") else None,
                   "head_dim": "a head_dim other than hidden_size / num_attention_heads"
                   if cfg.get("head_dim") not in (None, cfg["hidden_size"] // cfg["num_attention_heads"]) else None}
    refused = [f"{why} ({key})" for key, why in unsupported.items() if why]
    if refused:  # served silently wrong otherwise (Llama 3.1's llama3 RoPE scaling diverged at the first token)
        raise ValueError(f"{name}: this engine does not implement {', '.join(refused)}")
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelConfig(
        name=name,
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        vocab_size=cfg["vocab_size"],
        max_context=cfg.get("max_position_embeddings", 2048),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def load_hf_dir(model_dir: str | Path, name: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    model_dir = Path(model_dir)
    config = read_hf_config(model_dir, name or model_dir.name)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for key, tensor in load_file(str(f)).items():
            if key.endswith(".rotary_emb.inv_freq"):
                continue  # derived from rope_theta, never a weight
            name_ = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
            # "layers.3.self_attn.q_proj.weight" -> "layers.3.q_proj"
            name_ = name_.replace(".self_attn.", ".").replace(".mlp.", ".").removesuffix(".weight")
            weights[name_] = tensor.to(torch.float32)
    if config.tie_embeddings:
        weights.pop("lm_head", None)
    return config, weights


def save_hf_dir(model_dir: str | Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Write our weights as a HF directory (used to round-trip tests and to export the tiny preset)."""
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": config.num_layers, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_context, "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_eps, "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids),
    }
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    out = {}
    for k, v in weights.items():
        parts = k.split(".")
        if parts[0] == "layers":
            group = "self_attn" if parts[2].endswith("_proj") and parts[2][0] in "qkvo" else "mlp"
            if parts[2].endswith("layernorm"):
                out[f"model.{k}.weight"] = v.contiguous()
            else:
                out[f"model.layers.{parts[1]}.{group}.{parts[2]}.weight"] = v.contiguous()
        elif k == "lm_head":
            out["lm_head.weight"] = v.contiguous()
        else:
            out[f"model.{k}.weight"] = v.contiguous()
    save_file(out, str(model_dir / "model.safetensors"))
