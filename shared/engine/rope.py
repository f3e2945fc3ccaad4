"""Rotary position embeddings: the frequencies (plain, or stretched for a longer context by one of the
`rope_scaling` types Llama 3.x, Qwen and Mistral checkpoints use) and their cos/sin tables.

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

import math
from dataclasses import dataclass

import torch

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


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling = RopeScaling()) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] in fp64, the factor cos and sin are multiplied by)."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    s = scaling
    if s.type == "default":
        return base, 1.0
    if s.type == "linear":
        return base / s.factor, 1.0
    if s.type == "freq_factors":
        if len(s.freq_factors) != len(base):
            raise ValueError(f"rope freq_factors: {len(s.freq_factors)} factors for {len(base)} frequencies")
        return base / torch.tensor(s.freq_factors, dtype=torch.float64), 1.0
    if s.type == "llama3":
        low_wavelen = s.original_max_positions / s.low_freq_factor
        high_wavelen = s.original_max_positions / s.high_freq_factor
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > low_wavelen, base / s.factor, base)
        smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    return _yarn(head_dim, theta, base, s)


def _yarn(head_dim: int, theta: float, base: torch.Tensor, s: RopeScaling) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.attention_factor:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    else:
        attention = mscale(s.factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        return head_dim * math.log(s.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # share of each frequency kept as it is
    return base / s.factor * (1 - extrapolated) + base * extrapolated, attention


class RotaryEmbedding:
    def __init__(self, head_dim: int, theta: float, max_positions: int, device, dtype=torch.float32,
                 scaling: RopeScaling = RopeScaling()):
        freq, attention = inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), freq)
        # cos/sin of the half, then duplicated: the same values as of cat([freqs, freqs]) at half the cost
        # (tiny's 65536 positions: 0.4 s of an engine's start-up on a busy host)
        cos, sin = (freqs.cos() * attention).to(dtype=dtype), (freqs.sin() * attention).to(dtype=dtype)
        self.cos = torch.cat([cos, cos], dim=-1).to(device=device)
        self.sin = torch.cat([sin, sin], dim=-1).to(device=device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D]; positions: [T]."""
        return self.apply(x, *self.tables(positions))

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions`, shaped [T, 1, D]: gathered once per forward, used by every layer."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
