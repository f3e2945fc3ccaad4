"""Rotary position embeddings: the frequencies (plain, or stretched for a longer context as a RopeScaling
says: shared/engine/rope_scaling.py) and their cos/sin tables. Formulas as transformers' `modeling_rope_utils`."""

from __future__ import annotations

import math

import torch

from shared.engine.rope_scaling import RopeScaling


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
