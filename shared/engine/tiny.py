"""The `tiny` preset: a seeded random Llama (4 layers x 256 hidden) with a byte tokenizer.

For long-context load tests, where SmolLM2 would be too slow on CPU. Weights are drawn with
variance-preserving scales so logits are peaked: greedy choices are far from ties, which keeps
cache-vs-scratch comparisons meaningful instead of hostage to float noise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shared.engine.model_config import ModelConfig
from shared.engine.tokenizer import ByteTokenizer

if TYPE_CHECKING:  # torch is needed for weights only, not for configs and tokenizers
    import torch

TINY_SEED = 1234


def tiny_config(max_context: int = 65536) -> ModelConfig:
    tok = ByteTokenizer()
    return ModelConfig(
        name="tiny", num_layers=4, hidden_size=256, intermediate_size=768, num_heads=4, num_kv_heads=2,
        vocab_size=tok.vocab_size, max_context=max_context, rope_theta=1e6, rms_eps=1e-5,
        tie_embeddings=False, bos_token_id=None, eos_token_ids=tok.eos_token_ids,
    )


def tiny_weights(config: ModelConfig, seed: int = TINY_SEED) -> dict[str, torch.Tensor]:
    import torch

    g = torch.Generator().manual_seed(seed)

    def mat(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / in_f ** 0.5

    h, f, d = config.hidden_size, config.intermediate_size, config.head_dim
    w = {"embed_tokens": torch.randn(config.vocab_size, h, generator=g), "norm": torch.ones(h),
         "lm_head": torch.randn(config.vocab_size, h, generator=g) * 0.5}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        w[p + "input_layernorm"] = torch.ones(h)
        w[p + "post_attention_layernorm"] = torch.ones(h)
        w[p + "q_proj"] = mat(config.num_heads * d, h)
        w[p + "k_proj"] = mat(config.num_kv_heads * d, h)
        w[p + "v_proj"] = mat(config.num_kv_heads * d, h)
        w[p + "o_proj"] = mat(h, config.num_heads * d)
        w[p + "gate_proj"] = mat(f, h)
        w[p + "up_proj"] = mat(f, h)
        w[p + "down_proj"] = mat(h, f)
    return w
