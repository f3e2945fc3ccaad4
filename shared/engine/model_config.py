"""The shape of a decoder, whatever file its weights came from: Llama (SmolLM2, the `tiny` preset, Llama 3.x with
its RoPE scaling), Mistral, Qwen 2 and 3, and Gemma 3, whose differences are fields here rather than classes (shared/engine/model.py reads them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.engine.rope_scaling import RopeScaling

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_context: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    arch: str = "llama"
    explicit_head_dim: int = 0        # 0: hidden_size // num_heads (Gemma 3 sets its own)
    # Gemma 3: local layers attend to the last `sliding_window` tokens with their own RoPE base; every
    # `sliding_window_pattern`-th layer is global. Mistral: pattern 0, every layer windowed. Window 0: none.
    sliding_window: int = 0
    sliding_window_pattern: int = 0
    rope_local_theta: float = 0.0     # Gemma 3's local layers' RoPE base (0: windowed layers use rope_theta, as Mistral)
    query_scale: float = 0.0          # attention scale is query_scale ** -0.5 (0: head_dim, as Llama)
    qkv_bias: bool = False            # q/k/v projections with biases (Qwen 2)
    qk_norm: bool = False             # RMSNorm of each head's q and k before RoPE (Qwen 3; Gemma 3 always)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # the global layers' (Llama 3.x: llama3)

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # read back from JSON (the model cache's meta)
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.arch!r} (one of {', '.join(ARCHITECTURES)})")
        if not self.explicit_head_dim and self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.rope_scaling.freq_factors and len(self.rope_scaling.freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope frequency factors: {len(self.rope_scaling.freq_factors)} for "
                             f"{self.head_dim // 2} frequencies (head_dim {self.head_dim})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads (GQA)")

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def uses_qk_norm(self) -> bool:
        return self.qk_norm or self.gemma

    @property
    def gemma(self) -> bool:
        """Gemma 3's block: q/k norms, norms after attention and MLP too, GeGLU, scaled embeddings."""
        return self.arch == "gemma3"

    @property
    def recompute_knee_tokens(self) -> float:
        """The context length at which a token's attention costs as much as its weight matmuls, in
        multiply-adds: per layer, the projections (q, k, v, o) and the gated MLP against 2 x q-width per context
        token (QK and AV) on each layer that attends over the whole context. Recomputing N tokens (causal: each
        attends to N/2 on average) so costs ~ N * (1 + N / (2 * knee)): the KV of a long session is dearer to lose
        per byte than a short one's. inf: every layer is windowed. SmolLM2-135M: 3,072 tokens."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        linear = self.num_layers * self.hidden_size * (2 * q + 2 * kv + 3 * self.intermediate_size)
        attention = 2 * q * sum(self.layer_window(i) == 0 for i in range(self.num_layers))
        return linear / attention if attention else math.inf

    def layer_window(self, layer: int) -> int:
        """Tokens a layer attends back over, its own included (0: the whole context)."""
        if not self.sliding_window or (self.sliding_window_pattern and (layer + 1) % self.sliding_window_pattern == 0):
            return 0
        return self.sliding_window
