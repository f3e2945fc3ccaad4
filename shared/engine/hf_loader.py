"""Read a Hugging Face style model directory (config.json + *.safetensors) into our weight names: Llama
(SmolLM2 and the like; Llama 3.x's RoPE scaling), Mistral, Qwen 2 / 2.5 / 3 and Gemma 3 text models; what the engine does not implement is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from shared.engine.model_config import ModelConfig
from shared.engine.rope_scaling import RopeScaling, scaling_from_hf

_PREFIX = "model."


_GEMMA3_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "q_norm", "k_norm")


def _rope(cfg: dict) -> tuple[float, float, RopeScaling, list[str]]:
    """(global base, local base, the global layers' scaling, refusals): transformers 5 nests RoPE under
    rope_parameters (per layer type for Gemma 3), 4.x spells rope_theta / rope_local_base_freq / rope_scaling."""
    params = cfg.get("rope_parameters") or {}
    if params and "rope_type" not in params and "type" not in params:  # per layer type
        full, local = params.get("full_attention", {}), params.get("sliding_attention", {})
    else:
        full = params or {"rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_scaling") or {})}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    refused, scaling = [], RopeScaling()
    try:
        if cfg.get("original_max_position_embeddings"):  # Phi-3 style, outside the RoPE dict: it wins
            full = {**full, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
        scaling = scaling_from_hf(full, int(cfg.get("max_position_embeddings", 2048)))
    except ValueError as e:
        refused.append(f"{e} (rope_scaling)")
    if local.get("rope_type", local.get("type", "default")) != "default":
        refused.append(f"local rope_scaling type {local.get('rope_type', local.get('type'))!r} (rope_scaling)")
    return float(full.get("rope_theta", 10000.0)), float(local.get("rope_theta", 10000.0)), scaling, refused


def _gemma3_fields(cfg: dict, head_dim: int) -> tuple[dict, list[str]]:
    """Gemma 3's ModelConfig fields (its layer pattern as one period) and what this engine refuses of it."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    refused = []
    if types is not None:
        expect = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
        if list(types) != expect:
            refused.append("layer_types other than one global layer every "
                           f"{pattern} (layer_types)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key):
            refused.append(f"logit soft-capping ({key})")
    if cfg.get("use_bidirectional_attention"):
        refused.append("bidirectional attention (use_bidirectional_attention)")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        refused.append(f"activation {cfg.get('hidden_activation')!r} (hidden_activation)")
    return dict(arch="gemma3", explicit_head_dim=head_dim, sliding_window=int(cfg.get("sliding_window") or 0),
                sliding_window_pattern=pattern,
                query_scale=float(cfg.get("query_pre_attn_scalar", head_dim))), refused


def read_hf_config(model_dir: Path, name: str) -> ModelConfig:
    cfg = json.loads((model_dir / "config.json").read_text())
    model_type = cfg.get("model_type", "llama")
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    gemma = model_type == "gemma3_text"
    qwen = model_type in ("qwen2", "qwen3")
    mistral = model_type == "mistral"
    if not (gemma or qwen or mistral) and model_type != "llama" and "LlamaForCausalLM" not in archs:
        raise ValueError(f"unsupported model_type {model_type!r} (llama, mistral, qwen2, qwen3 or gemma3_text)")
    rope_theta, local_theta, scaling, refused = _rope(cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    unsupported = {"attention_bias": "q/k/v/o biases" if cfg.get("attention_bias") else None,
                   "mlp_bias": "MLP biases" if cfg.get("mlp_bias") else None}
    if gemma:
        extra, more = _gemma3_fields(cfg, head_dim)
        extra["rope_local_theta"] = local_theta
        refused += more
    elif qwen:  # Qwen 2 always has q/k/v biases; Qwen 3 has none (attention_bias would add o_proj's too)
        extra = dict(arch=model_type, explicit_head_dim=head_dim, qkv_bias=model_type == "qwen2",
                     qk_norm=model_type == "qwen3")
        unsupported["attention_bias"] = "q/k/v/o biases" if model_type == "qwen3" and cfg.get("attention_bias") else None
        unsupported["use_sliding_window"] = "a sliding window" if cfg.get("use_sliding_window") else None
    elif mistral:  # Llama's block; every layer windowed when sliding_window is set (v0.1), none when null
        extra = dict(arch="mistral", explicit_head_dim=head_dim, sliding_window=int(cfg.get("sliding_window") or 0))
    else:
        extra = {}
        unsupported["sliding_window"] = "a sliding window" if cfg.get("sliding_window") else None
        unsupported["head_dim"] = ("a head_dim other than hidden_size / num_attention_heads"
                                   if head_dim != cfg["hidden_size"] // cfg["num_attention_heads"] else None)
    if not gemma and cfg.get("hidden_act", "silu") != "silu":
        refused.append(f"activation {cfg.get('hidden_act')!r} (hidden_act)")
    refused += [f"{why} ({key})" for key, why in unsupported.items() if why]
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
        rope_theta=rope_theta,
        rope_scaling=scaling,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6 if gemma else 1e-5)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        **extra,
    )


def hf_weight_name(key: str) -> str | None:
    """Our name for a checkpoint tensor ("model.layers.3.self_attn.q_proj.weight" -> "layers.3.q_proj"), or
    None for a derived buffer (RoPE's inv_freq)."""
    if key.endswith(".rotary_emb.inv_freq"):
        return None  # derived from rope_theta, never a weight
    name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
    return name.replace(".self_attn.", ".").replace(".mlp.", ".").removesuffix(".weight")


def load_hf_dir(model_dir: str | Path, name: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    model_dir = Path(model_dir)
    config = read_hf_config(model_dir, name or model_dir.name)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        for key, tensor in load_file(str(f)).items():
            if (ours := hf_weight_name(key)) is not None:
                weights[ours] = tensor.to(torch.float32)
    if config.gemma:  # Gemma's RMSNorm scales by (1 + w); ours by w, as the GGUF converter stores it
        for key in weights:
            if key == "norm" or key.rsplit(".", 1)[-1] in _GEMMA3_NORMS:
                weights[key] = weights[key] + 1.0
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
