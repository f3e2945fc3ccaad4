"""Paged attention: K/V are written to and read from the page pool through block tables.

Both batch kinds read every context token (cached prefix included) from pages, so a prefix that came
from the prefix cache, the store or a handoff is used exactly like one computed in this request.
- prefill: per-sequence segments of new tokens; each attends to its whole context with a causal mask
  aligned to the end (query i of q_len sits at position ctx_len - q_len + i).
- decode: one new token per sequence; one batched call over block tables padded to the longest.
The math lives in kernels/ (`get_attention_kernels`): the torch reference gathers the context and runs
SDPA; the CPU kernel reads decode K/V in place through the block tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels import AttentionKernels, get_attention_kernels


@dataclass
class PrefillSegment:
    q_start: int          # offset of this sequence's new tokens in the flattened batch
    q_len: int            # new tokens computed this step
    ctx_len: int          # tokens of context after this step (cached + new)
    block_table: torch.Tensor  # [ceil(ctx_len / block_size)] int64
    # scratch for attention backends, valid for one forward (all layers): e.g. the reference's mask
    cache: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class AttentionBatch:
    slot_blocks: torch.Tensor   # [T] block id where each new token's K/V goes
    slot_offsets: torch.Tensor  # [T] offset within that block
    prefill: list[PrefillSegment] | None = None
    # decode only: block tables padded with block 0, and true context lengths
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_ctx_lens: torch.Tensor | None = None      # [B]

    @property
    def is_decode(self) -> bool:
        return self.prefill is None


def write_kv(pages: torch.Tensor, local_layer: int, batch: AttentionBatch, k: torch.Tensor, v: torch.Tensor) -> None:
    """pages: one stage's [N, Ls, 2, B, H, D]; k, v: [T, H, D]."""
    pages[batch.slot_blocks, local_layer, 0, batch.slot_offsets] = k.to(pages.dtype)
    pages[batch.slot_blocks, local_layer, 1, batch.slot_offsets] = v.to(pages.dtype)


def paged_attention(q: torch.Tensor, pages: torch.Tensor, local_layer: int, batch: AttentionBatch,
                    scale: float, kernels: AttentionKernels | None = None, window: int = 0) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. K/V for the new tokens must already be written. `kernels`: the
    backend (kernels.get_attention_kernels(q.device) when None; the model resolves it once). `window`:
    each query attends to the last `window` positions, its own included (0: all of its context)."""
    k = kernels or get_attention_kernels(q.device)
    if batch.is_decode:
        return k.paged_decode(q, pages, local_layer, batch.decode_block_tables, batch.decode_ctx_lens, scale,
                              window)
    return k.paged_prefill(q, pages, local_layer, batch.prefill, scale, window)
