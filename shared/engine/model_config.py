"""The shape of a Llama-family decoder, whatever file its weights came from."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads (GQA)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads
