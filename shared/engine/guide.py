"""Constrained decoding: a request's `SamplingParams.grammar` (an llguidance grammar, built and checked by
the router) becomes one matcher per sequence, and each step the tokens the grammar forbids are masked out of
its logits before sampling.

The matcher's state is a function of the tokens emitted so far, so it crosses the disaggregation boundary
by replay: prefill samples the first token under the grammar; decode builds a fresh matcher and feeds it
the output tokens the handoff carries (a retried request, or one whose KV came from the pool, is the
same). llguidance is a Rust library with no Python dependencies; it reads the model's own tokenizer
(`tokenizers` JSON, or a byte vocabulary for the `tiny` preset).

Masks are filled on a thread of their own while the forward pass runs (`Guides.start_masks`), then applied
with the sampler (`apply`). A grammar that cannot be compiled, or a token it refuses, fails that request only
(`GuideError`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from concurrent.futures import Future
from functools import cached_property
from typing import TYPE_CHECKING

from shared.engine.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer
from shared.threads import started_executor

if TYPE_CHECKING:  # the router checks grammars with this module and never loads torch
    import torch


class GuideError(ValueError):
    """The request's grammar cannot be used: compiling it failed, or it refused a token."""


class _ByteVocab:
    """llguidance's TokenizerWrapper protocol over the `tiny` preset's byte tokenizer."""

    def __init__(self, tok: ByteTokenizer):
        self.tokens = [bytes([i]) for i in range(256)] + [t.encode() for t in tok.SPECIALS]
        self.eos_token_id = tok.eos_token_ids[0]
        self.bos_token_id = None
        self.special_token_ids = list(tok.special_tokens.values())
        self._tok = tok

    def __call__(self, text: bytes) -> list[int]:
        return self._tok.encode(text.decode("utf-8", errors="replace"))


def ll_tokenizer(tok: Tokenizer):
    """The llguidance tokenizer for a moorage tokenizer (built once per process; ~0.5 s for 49K tokens)."""
    import llguidance

    eos = list(tok.eos_token_ids)
    if isinstance(tok, BPETokenizer):
        return llguidance.LLTokenizer(tok._tok.to_str(), eos_token=eos)
    if isinstance(tok, ByteTokenizer):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab(tok)), eos_token=eos)
    raise GuideError(f"constrained decoding does not support the tokenizer {type(tok).__name__}")


def grammar_error(ll_tok, grammar: str) -> str | None:
    """Why `grammar` cannot be used with this tokenizer, or None."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tok)
    if is_error:
        return messages[0] if messages else "invalid grammar"
    unsupported = [m for m in messages if "nsupported" in m or "not supported" in m]
    return unsupported[0] if unsupported else None  # a keyword it would not enforce counts as an error


class Guides:
    """The engine's side: matchers for sequences with a grammar, and their token masks."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    @cached_property
    def ll_tok(self):
        return ll_tokenizer(self.tokenizer)

    @cached_property
    def _pool(self):
        return started_executor(1, "guide-mask")

    def matcher(self, grammar: str, output_ids: Seq[int] = ()):
        """A matcher at the state after `output_ids` (decode: the tokens prefill already sampled)."""
        import llguidance

        m = llguidance.LLMatcher(self.ll_tok, grammar)
        if m.is_error():
            raise GuideError(f"the request's grammar cannot be used: {m.get_error()}")
        for t in output_ids:
            self.consume(m, t)
        return m

    @staticmethod
    def consume(matcher, token: int) -> None:
        if not matcher.consume_token(token):
            raise GuideError(f"the grammar refused token {token}: {matcher.get_error() or 'not allowed here'}")

    def start_masks(self, matchers: list) -> Future:
        """Fill one mask row per matcher on the mask thread (beside the forward pass). The result: an int32
        bitmask [len(matchers), ceil(V / 32)]."""
        return self._pool.submit(self._fill, list(matchers))

    def _fill(self, matchers: list) -> torch.Tensor:
        import llguidance.torch as llt

        masks = llt.allocate_token_bitmask(len(matchers), self.ll_tok.vocab_size)
        for row, m in enumerate(matchers):
            llt.fill_next_token_bitmask(m, masks, row)
        return masks

    def apply(self, logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
        """Mask logits[rows[i]] with masks[i], in place (-inf where the grammar forbids the token)."""
        import llguidance.torch as llt
        import torch

        with torch.inference_mode():  # the model's logits are inference tensors
            n = self.ll_tok.vocab_size
            sub = logits[rows].float()
            head = sub[:, :n].contiguous()
            llt.apply_token_bitmask_inplace(head, masks.to(head.device, non_blocking=True))
            sub[:, :n] = head
            sub[:, n:] = float("-inf")  # ids the tokenizer does not have (a padded model vocabulary)
            logits[rows] = sub.to(logits.dtype)
