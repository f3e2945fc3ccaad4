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


def padded_block_tables(segments, device: torch.device) -> torch.Tensor:
    """The prefill segments' block tables as one [S, widest] int64 tensor, rows padded with block 0 (for a kernel
    that takes a whole batch's tables at once: triton_prefill, aiter_attention)."""
    width = max(max(s.block_table.shape[0] for s in segments), 1)
    tables = torch.zeros((len(segments), width), dtype=torch.int64, device=device)
    for i, s in enumerate(segments):
        tables[i, :s.block_table.shape[0]] = s.block_table
    return tables


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


def _prefill_mask(seg, q: torch.Tensor, window: int = 0, rows: tuple[int, int] | None = None,
                  key_start: int = 0) -> torch.Tensor:
    """Additive causal mask aligned to the end of the context (query i sits at ctx_len - q_len + i), and
    within `window` of the query when given: for query `rows` [a, b) (all when None) against keys
    key_start..the last row's position. Built once per segment, window and rows in a forward (kept in
    seg.cache when the segment has one)."""
    a, b = rows or (0, seg.q_len)
    cache = getattr(seg, "cache", None)
    key = ("mask", window, a, b, key_start)
    mask = cache.get(key) if cache is not None else None
    if mask is None:
        first = seg.ctx_len - seg.q_len
        qpos = torch.arange(first + a, first + b, device=q.device)[:, None]
        kpos = torch.arange(key_start, first + b, device=q.device)[None, :]  # to the last row's position
        visible = kpos <= qpos
        if window:
            visible &= kpos > qpos - window
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        if cache is not None:
            cache[key] = mask
    return mask


def _windowed(qs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg, window: int, scale: float) -> torch.Tensor:
    """A sliding-window layer's prefill in query chunks of window/4 rows (64 at least): each chunk reads
    only the keys its rows can see. SDPA with a mask computes every key it is given, so one call over the
    whole context would compute all of it; at 1K tokens and a 512 window this computes ~half of that."""
    chunk = max(window // 4, 64)
    first = seg.ctx_len - seg.q_len
    outs = []
    for a in range(0, seg.q_len, chunk):
        b = min(a + chunk, seg.q_len)
        start = max(0, first + a - window + 1)
        end = first + b
        if first == 0 and a == 0 and b <= window:  # a prompt's opening rows: plain causal, nothing out of reach
            outs.append(F.scaled_dot_product_attention(qs[:, :, :b], k[:, :, :end], v[:, :, :end], is_causal=True,
                                                       scale=scale, enable_gqa=True))
            continue
        mask = _prefill_mask(seg, qs, window, (a, b), start)
        outs.append(F.scaled_dot_product_attention(qs[:, :, a:b], k[:, :, start:end], v[:, :, start:end],
                                                   attn_mask=mask, scale=scale, enable_gqa=True))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


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
        if window and seg.ctx_len > window:  # some rows cannot see every earlier position
            o = _windowed(qs, k, v, seg, window, scale)
        elif seg.q_len == seg.ctx_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=_prefill_mask(seg, q), scale=scale, enable_gqa=True)
        out[seg.q_start:seg.q_start + seg.q_len] = o[0].transpose(0, 1)
    return out
