"""Read a GGUF file (llama: the bundled SmolLM2; gemma3: Gemma 3 270M; qwen2 / qwen3) into our weight names.

Quantized tensors (Q4_1, Q4_K, Q8_0, ...) are dequantized with the `gguf` package. llama.cpp's converter
permutes the rows of attn_q / attn_k of llama models so its RoPE can rotate adjacent pairs; we use the
Hugging Face rotate-half RoPE, so those rows are permuted back here (and only here; gemma3 and qwen are not).
Gemma's norms are stored with the +1 of its `x * (1 + w)` already added by the converter: they are plain
RMSNorm weights here. An architecture or a tensor this engine does not implement is an error naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from shared.engine.model_config import ModelConfig
from shared.engine.rope_scaling import RopeScaling

if TYPE_CHECKING:  # torch is needed for weights only, not for configs and tokenizers
    import torch

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
_GEMMA3_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "post_attention_norm": "post_attention_layernorm",   # on the attention's output
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
_QWEN3_LAYER_NAMES = {**_LAYER_NAMES, "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}
_LAYERS_BY_ARCH = {"llama": _LAYER_NAMES, "qwen2": _LAYER_NAMES, "qwen3": _QWEN3_LAYER_NAMES,
                   "gemma3": _GEMMA3_LAYER_NAMES}
_BIASES = {"qwen2": ("attn_q", "attn_k", "attn_v")}  # tensors that also come as .bias
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
ROPE_FREQS = "rope_freqs.weight"  # RoPE frequency factors (config, not a weight): read by read_config
# Gemma 3 constants llama.cpp does not store: local layers' RoPE base and which layers are global
GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_SLIDING_PATTERN = 6


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_heads)` on a [n_heads*head_dim, in] projection."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (used by tests that write GGUF files)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _rope_scaling(reader: GGUFReader, arch: str, name: str) -> RopeScaling:
    """llama.cpp's rope.scaling.* keys; Llama 3.1's llama3 scaling arrives as a rope_freqs tensor instead (one
    divisor per frequency, which llama.cpp's converter computed from the llama3 formula)."""
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        return RopeScaling(type="freq_factors", freq_factors=tuple(_tensor_to_numpy(freqs).reshape(-1).tolist()))
    rtype = _field(reader, f"{arch}.rope.scaling.type")
    if rtype in (None, "none"):
        return RopeScaling()
    if rtype not in ("linear", "yarn"):
        raise ValueError(f"{name}: unsupported RoPE scaling {rtype!r} ({arch}.rope.scaling.type)")
    return RopeScaling(type=rtype, factor=float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
                       original_max_positions=int(_field(reader, f"{arch}.rope.scaling.original_context_length", 0)
                                                  or _field(reader, f"{arch}.context_length")) if rtype == "yarn" else 0)


def read_config(reader: GGUFReader, name: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _LAYERS_BY_ARCH:
        raise ValueError(f"unsupported GGUF architecture {arch!r} (one of {', '.join(_LAYERS_BY_ARCH)})")
    tensor_names = {t.name for t in reader.tensors}
    scaling = _rope_scaling(reader, arch, name)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eos_ids = () if eos is None else (int(eos),)
    extra = {}
    if arch == "gemma3":
        end_of_turn = tokens.index("<end_of_turn>") if tokens and "<end_of_turn>" in tokens else None
        eos_ids += (end_of_turn,) if end_of_turn is not None else ()  # a chat turn ends there
        key_len = int(_field(reader, "gemma3.attention.key_length"))
        extra = dict(explicit_head_dim=key_len, sliding_window=int(_field(reader, "gemma3.attention.sliding_window", 0)),
                     sliding_window_pattern=GEMMA3_SLIDING_PATTERN, rope_local_theta=GEMMA3_LOCAL_ROPE_THETA,
                     query_scale=float(key_len))
    elif arch in ("qwen2", "qwen3"):
        key_len = _field(reader, f"{arch}.attention.key_length")
        extra = dict(explicit_head_dim=int(key_len or 0), qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3")
    return ModelConfig(
        name=name,
        num_layers=int(_field(reader, f"{arch}.block_count")),
        hidden_size=int(_field(reader, f"{arch}.embedding_length")),
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_heads=int(_field(reader, f"{arch}.attention.head_count")),
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv")),
        vocab_size=int(_field(reader, f"{arch}.vocab_size", len(tokens) if tokens else 0)),
        max_context=int(_field(reader, f"{arch}.context_length")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids, arch=arch, **extra,
    )


def _tensor_to_numpy(t) -> np.ndarray:
    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims fastest-first
    arr = dequantize(t.data, t.tensor_type)
    return np.array(arr.reshape(shape), dtype=np.float32)  # owned, writable copy


def gguf_weight_name(tensor: str, arch: str) -> str | None:
    """Our name for a GGUF tensor ("blk.3.attn_q.weight" -> "layers.3.q_proj"), None for rope_freqs (part of
    the config); one this architecture does not use raises, naming it."""
    if tensor == ROPE_FREQS and arch == "llama":
        return None
    parts = tensor.split(".")
    if parts[0] == "blk":
        names, base = _LAYERS_BY_ARCH[arch], parts[2]
        bias = parts[3:] == ["bias"] and base in _BIASES.get(arch, ())
        if base not in names or not (parts[3:] == ["weight"] or bias):
            raise ValueError(f"unexpected GGUF tensor {tensor} for architecture {arch!r}")
        return f"layers.{parts[1]}.{names[base]}{'.bias' if bias else ''}"
    if parts[0] in _TOP_NAMES and parts[1:] == ["weight"]:
        return _TOP_NAMES[parts[0]]
    raise ValueError(f"unexpected GGUF tensor {tensor}")


def load_gguf(path: str | Path, name: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFReader]:
    """Config, float32 weights under our names, and the reader (for tokenizer metadata)."""
    import torch

    reader = GGUFReader(str(path))
    config = read_config(reader, name or Path(path).stem)
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        ours = gguf_weight_name(t.name, config.arch)
        if ours is None:
            continue
        arr = _tensor_to_numpy(t)
        if config.arch == "llama" and ours.endswith((".q_proj", ".k_proj")):
            arr = unpermute_rope_rows(arr, config.num_heads if ours.endswith("q_proj") else config.num_kv_heads)
        weights[ours] = torch.from_numpy(arr)
    return config, weights, reader
