"""RoPE scaling: how a checkpoint stretches its rotary frequencies for a longer context (the `rope_scaling` types
Llama 3.x, Qwen and Mistral checkpoints use), as a config value; shared/engine/rope.py computes with it.
No torch here: the router reads model configs without it.

Supported types, with the same formulas as transformers' `modeling_rope_utils`:
- `default`: inv_freq_i = theta ** (-2i / d);
- `linear`: every frequency divided by `factor` (positions interpolated);
- `llama3`: Llama 3.1's: low frequencies divided by `factor`, high ones kept, a smooth ramp between;
- `yarn`: YaRN's ramp between interpolated and extrapolated frequencies, and cos/sin scaled by an attention factor;
- `freq_factors`: each frequency divided by its own factor, as llama.cpp stores Llama 3.1's llama3 scaling in a
  GGUF (the `rope_freqs` tensor).

Refused by name: `dynamic` (its frequencies change with the running sequence length, so KV written at one
length disagrees with KV written at another: no prefix cache, pool or handoff could keep it), `longrope`
(the same, switching at the original length), and a partial rotary dimension.
"""

from __future__ import annotations

from dataclasses import dataclass

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")


@dataclass(frozen=True)
class RopeScaling:
    type: str = "default"
    factor: float = 1.0
    original_max_positions: int = 0   # the pretraining context (llama3, yarn)
    low_freq_factor: float = 1.0      # llama3
    high_freq_factor: float = 4.0     # llama3
    beta_fast: float = 32.0           # yarn
    beta_slow: float = 1.0            # yarn
    attention_factor: float = 0.0     # yarn: cos/sin scale (0: from factor, mscale and mscale_all_dim)
    mscale: float = 0.0               # yarn
    mscale_all_dim: float = 0.0       # yarn
    truncate: bool = True             # yarn: round the ramp's bounds outward
    freq_factors: tuple[float, ...] = ()  # freq_factors: one divisor per frequency (head_dim / 2)

    def __post_init__(self) -> None:
        object.__setattr__(self, "freq_factors", tuple(float(f) for f in self.freq_factors))  # JSON gives a list
        if (self.type == "freq_factors") != bool(self.freq_factors) or any(not f > 0 for f in self.freq_factors):
            raise ValueError("rope freq_factors: one positive factor per frequency, with type 'freq_factors' only")
        if self.type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {self.type!r} (one of {', '.join(ROPE_TYPES)})")
        if self.type != "default" and not self.factor > 0:
            raise ValueError(f"rope_scaling factor must be positive, got {self.factor}")
        if self.type in ("llama3", "yarn") and self.original_max_positions <= 0:
            raise ValueError(f"rope_scaling type {self.type!r} needs original_max_position_embeddings")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("rope_scaling high_freq_factor must exceed low_freq_factor")


def scaling_from_hf(params: dict, max_positions: int) -> RopeScaling:
    """A RopeScaling from a config's rope_scaling / rope_parameters dict; what it cannot honour raises,
    naming the key."""
    rtype = params.get("rope_type", params.get("type", "default"))
    if rtype in ("dynamic", "longrope"):
        raise ValueError(f"rope_scaling type {rtype!r}: its frequencies change with the sequence length, so "
                         "KV cached at one length would be wrong at another")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("a partial rotary dimension (partial_rotary_factor)")
    if rtype == "default":
        return RopeScaling()
    factor = params.get("factor")
    # the pretraining context: as transformers, the whole context when a config leaves it out
    original = int(params.get("original_max_position_embeddings") or 0) or max_positions
    if factor is None and rtype == "yarn":
        factor = max_positions / original  # as transformers (DeepSeek-V3's configs)
    if factor is None:
        raise ValueError(f"rope_scaling type {rtype!r} without a factor")
    return RopeScaling(
        type=rtype, factor=float(factor), original_max_positions=original if rtype in ("llama3", "yarn") else 0,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),  # Llama 3.1's values when left out
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=float(params.get("attention_factor") or 0.0),
        mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        truncate=bool(params.get("truncate", True)))
