"""Sampling parameters and the sampler: greedy, temperature, top-p, per-request seed; and the log-probabilities
a request may ask for with its tokens."""

from __future__ import annotations

import hashlib
import math
import os
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:  # torch is imported where sampling runs: the router validates params without it
    import torch

# Below this a temperature is treated as greedy (vLLM's _SAMPLING_EPS): dividing logits by it would
# overflow, and the distribution is one token anyway.
GREEDY_EPS = 1e-5
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 1024
MAX_LOGPROBS = 20  # most alternatives a token's log-probabilities list (OpenAI's top_logprobs bound)


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The one sampling contract, end to end: the router builds it from the API request (after the API's own
    schema) and it travels typed inside PrefillSubmit and HandoffDone (shared/messages.py). Every way in
    (constructed here, decoded off the bus) runs `__post_init__`, so prefill and decode hold the same checked
    value the router made; a field this version does not know is refused, never dropped."""
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    grammar: str = ""  # constrained decoding: an llguidance grammar (shared/engine/guide.py); "" = none
    logprobs: int | None = None  # each output token's log-probability and this many most likely alternatives

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _require_finite("temperature", self.temperature)
        _require_finite("top_p", self.top_p)
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.temperature < GREEDY_EPS:
            msgspec.structs.force_setattr(self, "temperature", 0.0)  # frozen: normalised once, here
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        if not isinstance(self.grammar, str):
            raise ValueError("grammar must be a string")
        if self.grammar and self.ignore_eos:
            raise ValueError("a grammar ends the output itself: ignore_eos cannot be set with it")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_resolved_seed(self) -> "SamplingParams":
        """Random sampling without a seed gets one now, so every later draw is reproducible."""
        if self.greedy or self.seed is not None:
            return self
        return msgspec.structs.replace(self, seed=int.from_bytes(os.urandom(8), "little") >> 1)

    def make_generator(self, position: int = 0, device: torch.device | str = "cpu") -> torch.Generator | None:
        """The generator for output token `position`, on the logits' device (a CPU generator cannot draw
        for CUDA tensors). Seeded by (seed, position), not by history, so a token sampled on prefill and
        the next ones sampled on decode form one stream, and a request's samples never depend on its
        batch neighbours. The same seed gives the same stream on one device type; a CPU and a CUDA
        generator give different ones."""
        import torch

        if self.greedy:
            return None
        seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        mixed = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
        return torch.Generator(device=device).manual_seed(int.from_bytes(mixed, "little") >> 1)


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One output token's log-probability under the model (the log-softmax of its logits, before temperature,
    top-p or a grammar's mask, as vLLM reports them by default), and the `logprobs` most likely tokens with
    theirs, most likely first: what a request with SamplingParams.logprobs gets per token."""
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], counts: list[int]) -> list[TokenLogprob]:
    """logits: [n, V] (the rows that asked, unmasked); tokens: the ids chosen from them; counts: the
    alternatives each asked for. One log-softmax and one top-k on the logits' device; only the numbers
    asked for come back."""
    import torch

    lp = torch.nan_to_num(torch.log_softmax(logits.float(), dim=-1), neginf=-9999.0)  # OpenAI's floor; JSON has no -inf
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(counts)
    vals, ids = (lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long()))
    vals, ids = vals.tolist(), ids.tolist()
    return [TokenLogprob(c, tuple(zip(ids[r][:n], vals[r][:n]))) for r, (c, n) in enumerate(zip(chosen, counts))]


def _require_finite(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [V] float32 -> token id. Everything runs on the logits' device; only the id comes back."""
    import torch

    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest head whose mass reaches top_p; the most probable token always stays, even
        # when top_p rounds to 0 in float32
        keep = (torch.cumsum(sorted_probs, 0) - sorted_probs) < params.top_p
        keep[0] = True
        sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
        idx = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[idx])
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> list[int]:
    """logits: [B, V]. Greedy rows share one argmax; others sample with their own generator."""
    import torch

    if all(p.greedy for p in params):
        return torch.argmax(logits, dim=-1).tolist()
    return [sample_one(logits[i], p, g) for i, (p, g) in enumerate(zip(params, generators))]
