"""transformers as an oracle for architectures whose real weights are not at hand: it builds a model of the
named shape with seeded random weights and saves it as a Hugging Face directory; moorage loads that
directory through its own loader (shared/engine/hf_loader.py) and both run greedy from the same prompt ids.
transformers' Llama and Gemma 3 code (its RoPE, norms, GQA, sliding-window masks) is independent of ours,
so agreement token for token is a real check of the engine's math on whatever device both run on.

Shapes: `smollm2` and `gemma3-270m` are the bundled models' real layer shapes (vocab included); `small`
variants (and the Qwen 2 / Qwen 3 ones) cut layers and vocabulary so a CPU test runs in seconds. Random weights give flat logits, so the
initialiser is widened (INIT_STD) until the top two logits are far apart compared with fp32 error.
"""

from __future__ import annotations

from pathlib import Path

import torch

INIT_STD = 0.1  # transformers' 0.02 leaves top-2 logit gaps near 1e-4: a reduction-order tie-break, not a check

SHAPES = {
    "smollm2": dict(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "gemma3-270m": dict(arch="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048,
                        num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                        sliding_window=512, query_pre_attn_scalar=256, max_position_embeddings=32768,
                        rms_norm_eps=1e-6),
    "smollm2-small": dict(arch="llama", vocab_size=2048, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096,
                          rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "qwen2-small": dict(arch="qwen2", vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen3-small": dict(arch="qwen3", vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # RoPE scaling: small original contexts so that the scaled frequencies matter inside a short prompt
    "llama31-small": dict(arch="llama", vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                          rms_norm_eps=1e-5, tie_word_embeddings=True,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 256}),
    "llama-linear-small": dict(arch="llama", vocab_size=2048, hidden_size=128, intermediate_size=384,
                               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
                               rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    "qwen2-yarn-small": dict(arch="qwen2", vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                             rms_norm_eps=1e-6, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                              "original_max_position_embeddings": 1024}),
    # Mistral: every layer windowed (v0.1's 4096, cut to 24) and a head_dim of its own (Nemo's shape)
    "mistral-small": dict(arch="mistral", vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=48, sliding_window=24,
                          max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-5,
                          tie_word_embeddings=False),
    # 7 layers: six local (window 24) and one global, as the real model's period
    "gemma3-small": dict(arch="gemma3", vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=7,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=64, sliding_window=24,
                         query_pre_attn_scalar=64, max_position_embeddings=4096, rms_norm_eps=1e-6),
    # Gemma 3 4B and up: linear scaling (factor 8) on the global layers only
    "gemma3-linear-small": dict(arch="gemma3", vocab_size=2048, hidden_size=128, intermediate_size=256,
                                num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                                sliding_window=24, query_pre_attn_scalar=64, max_position_embeddings=4096,
                                rms_norm_eps=1e-6,
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                    "rope_theta": 1000000.0}}),
}


def hf_config(shape: str):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    fields = dict(SHAPES[shape])
    arch = fields.pop("arch")
    fields.update(initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "gemma3":
        fields["rope_parameters"] = fields.get("rope_parameters") or {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}
        return Gemma3TextConfig(**fields)
    return {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch](**fields)


def build_hf_model(shape: str, device: str = "cpu", seed: int = 0, dtype: torch.dtype = torch.float32):
    """transformers' model of `shape` with seeded random weights, in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: Gemma's 262K-row embedding takes seconds on a CPU
        model = AutoModelForCausalLM.from_config(hf_config(shape), dtype=torch.float32)
    with torch.no_grad():  # norms start at 1 (Gemma's at 0) and Qwen 2's biases at 0: make them count
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0 if "gemma" in shape else 1.0, 0.2)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model.to(device=device, dtype=dtype).eval()


def save_hf_model(model, out_dir: Path) -> Path:
    """The model as config.json + model.safetensors (fp32), the directory moorage's loader reads."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (its own generate, contiguous KV cache)."""
    device = next(model.parameters()).device
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


def hf_last_logits(model, prompt: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(torch.tensor([prompt], device=device)).logits[0, -1].float().cpu()


def prompts(vocab: int, lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    """Seeded prompt ids (3 and up: 0-2 are pad/bos/eos)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
