"""Reference paged attention in torch (the oracle; any device): gathers the context through the block
table into new tensors, then SDPA. Every attention backend exposes these two functions:

    paged_decode(q, pages, local_layer, block_tables, ctx_lens, scale, window=0) -> Tensor
        q [B, Hq, D] (one new token per sequence, its K/V already written); pages: one stage's
        [N, Ls, 2, block_size, Hkv, D]; block_tables [B, max_blocks] int64 (rows padded with any valid
        block id); ctx_lens [B] int64 (>= 1). Returns [B, Hq, D] in q's dtype. Query head i reads
        KV head i // (Hq // Hkv) (GQA, as SDPA's enable_gqa).
    paged_prefill(q, pages, local_layer, segments, scale, window=0) -> Tensor
        q [T, Hq, D]; segments: objects with q_start, q_len, ctx_len, block_table (see
        shared.engine.attention.PrefillSegment); causal, aligned to the end of each context.
    window > 0: a query attends only to the last `window` positions, its own included (a sliding-window
    layer); 0: to all of its context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def read_context(pages: torch.Tensor, local_layer: int, kv: int, block_table: torch.Tensor) -> torch.Tensor:
    """[..., n_blocks] table -> [..., n_blocks * block_size, H, D] (a new tensor)."""
    x = pages[block_table, local_layer, kv]  # [..., nb, B, H, D]
    return x.flatten(-4, -3)


def paged_decode(q: torch.Tensor, pages: torch.Tensor, local_layer: int, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    dtype = q.dtype
    k = read_context(pages, local_layer, 0, block_tables).to(dtype).transpose(1, 2)  # [B, H, S, D]
    v = read_context(pages, local_layer, 1, block_tables).to(dtype).transpose(1, 2)
    pos = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = pos < ctx_lens[:, None]  # [B, S]
    if window:
        mask &= pos >= ctx_lens[:, None] - window
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _prefill_mask(seg, q: torch.Tensor, window: int = 0) -> torch.Tensor:
    """Additive causal mask aligned to the end of the context (query i sits at ctx_len - q_len + i), and
    within `window` of the query when given; built once per segment, window and forward (kept in
    seg.cache when the segment has one)."""
    cache = getattr(seg, "cache", None)
    key = ("mask", window)
    mask = cache.get(key) if cache is not None else None
    if mask is None:
        qpos = torch.arange(seg.ctx_len - seg.q_len, seg.ctx_len, device=q.device)[:, None]
        kpos = torch.arange(seg.ctx_len, device=q.device)[None, :]
        visible = kpos <= qpos
        if window:
            visible &= kpos > qpos - window
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        if cache is not None:
            cache[key] = mask
    return mask


def paged_prefill(q: torch.Tensor, pages: torch.Tensor, local_layer: int, segments, scale: float,
                  window: int = 0) -> torch.Tensor:
    # 4-D [1, H, S, D] operands: with 3-D ones CPU SDPA takes its math path (materialised scores,
    # ~5x slower at 2K tokens); 4-D ones reach its flash kernel.
    dtype = q.dtype
    out = torch.empty_like(q)
    for seg in segments:
        qs = q[seg.q_start:seg.q_start + seg.q_len].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        k = read_context(pages, local_layer, 0, seg.block_table)[:seg.ctx_len].to(dtype).transpose(0, 1)[None]
        v = read_context(pages, local_layer, 1, seg.block_table)[:seg.ctx_len].to(dtype).transpose(0, 1)[None]
        if window and seg.ctx_len > window:  # only the last `window` positions can be seen: read just those
            start = max(0, seg.ctx_len - seg.q_len - window + 1)
            k, v = k[:, :, start:], v[:, :, start:]
            # contiguous: a mask sliced at an odd column is misaligned for CUDA's memory-efficient SDPA kernel
            # ("misaligned address" with bf16 on an H200)
            mask = _prefill_mask(seg, q, window)[:, start:].contiguous()
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        elif seg.q_len == seg.ctx_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=_prefill_mask(seg, q), scale=scale, enable_gqa=True)
        out[seg.q_start:seg.q_start + seg.q_len] = o[0].transpose(0, 1)
    return out
