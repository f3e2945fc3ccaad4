"""Paged attention: K/V are written to and read from the page pool through block tables.

Both batch kinds read every context token (cached prefix included) from pages, so a prefix that came
from the prefix cache, the store or a handoff is used exactly like one computed in this request.
- prefill: per-sequence segments of new tokens; each attends to its whole context with a causal mask
  aligned to the end (query i of q_len sits at position ctx_len - q_len + i).
- decode: one new token per sequence; one batched call over block tables padded to the longest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSegment:
    q_start: int          # offset of this sequence's new tokens in the flattened batch
    q_len: int            # new tokens computed this step
    ctx_len: int          # tokens of context after this step (cached + new)
    block_table: torch.Tensor  # [ceil(ctx_len / block_size)] int64


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


def _read_context(pages: torch.Tensor, local_layer: int, kv: int, block_table: torch.Tensor) -> torch.Tensor:
    """[..., n_blocks] table -> [..., n_blocks * block_size, H, D]."""
    x = pages[block_table, local_layer, kv]  # [..., nb, B, H, D]
    return x.flatten(-4, -3)


def paged_attention(q: torch.Tensor, pages: torch.Tensor, local_layer: int, batch: AttentionBatch,
                    scale: float) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. K/V for the new tokens must already be written."""
    dtype = q.dtype
    if batch.is_decode:
        bt, lens = batch.decode_block_tables, batch.decode_ctx_lens
        k = _read_context(pages, local_layer, 0, bt).to(dtype).transpose(1, 2)  # [B, H, S, D]
        v = _read_context(pages, local_layer, 1, bt).to(dtype).transpose(1, 2)
        mask = torch.arange(k.shape[2], device=q.device)[None, :] < lens[:, None]  # [B, S]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                             scale=scale, enable_gqa=True)
        return out.squeeze(2)
    out = torch.empty_like(q)
    for seg in batch.prefill:
        qs = q[seg.q_start:seg.q_start + seg.q_len].transpose(0, 1)  # [Hq, q_len, D]
        k = _read_context(pages, local_layer, 0, seg.block_table)[:seg.ctx_len].to(dtype).transpose(0, 1)
        v = _read_context(pages, local_layer, 1, seg.block_table)[:seg.ctx_len].to(dtype).transpose(0, 1)
        if seg.q_len == seg.ctx_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            first = seg.ctx_len - seg.q_len
            qpos = torch.arange(first, seg.ctx_len, device=q.device)[:, None]
            mask = torch.arange(seg.ctx_len, device=q.device)[None, :] <= qpos
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[seg.q_start:seg.q_start + seg.q_len] = o.transpose(0, 1)
    return out
