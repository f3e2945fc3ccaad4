"""Read a llama-architecture GGUF file (e.g. the bundled SmolLM2) into our weight names.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized with the `gguf` package. llama.cpp's converter
permutes the rows of attn_q / attn_k so its RoPE can rotate adjacent pairs; we use the Hugging Face
rotate-half RoPE, so those rows are permuted back here (and only here).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from shared.engine.model_config import ModelConfig

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
_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


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


def read_config(reader: GGUFReader, name: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only 'llama')")
    tensor_names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        name=name,
        num_layers=int(_field(reader, "llama.block_count")),
        hidden_size=int(_field(reader, "llama.embedding_length")),
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_heads=int(_field(reader, "llama.attention.head_count")),
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        vocab_size=int(_field(reader, "llama.vocab_size", len(tokens) if tokens else 0)),
        max_context=int(_field(reader, "llama.context_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _tensor_to_numpy(t) -> np.ndarray:
    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims fastest-first
    arr = dequantize(t.data, t.tensor_type)
    return np.array(arr.reshape(shape), dtype=np.float32)  # owned, writable copy


def load_gguf(path: str | Path, name: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor], GGUFReader]:
    """Config, float32 weights under our names, and the reader (for tokenizer metadata)."""
    import torch

    reader = GGUFReader(str(path))
    config = read_config(reader, name or Path(path).stem)
    weights: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            layer, base = int(parts[1]), parts[2]
            if base not in _LAYER_NAMES or parts[3:] != ["weight"]:
                raise ValueError(f"unexpected GGUF tensor {t.name}")
            arr = _tensor_to_numpy(t)
            if base == "attn_q":
                arr = unpermute_rope_rows(arr, config.num_heads)
            elif base == "attn_k":
                arr = unpermute_rope_rows(arr, config.num_kv_heads)
            weights[f"layers.{layer}.{_LAYER_NAMES[base]}"] = torch.from_numpy(arr)
        elif parts[0] in _TOP_NAMES and parts[-1] == "weight":
            weights[_TOP_NAMES[parts[0]]] = torch.from_numpy(_tensor_to_numpy(t))
        else:
            raise ValueError(f"unexpected GGUF tensor {t.name}")
    return config, weights, reader
