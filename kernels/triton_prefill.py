"""Paged prefill attention in Triton (CUDA and ROCm; on CPU tensors under TRITON_INTERPRET=1 for tests): the
`paged_prefill` of the triton attention backend (kernels/triton_attention.py re-exports it).

Flash attention over the paged KV, read in place through each segment's block table (the torch reference
gathers each segment's whole context into new tensors in every layer): one program per (tile of a segment's
query rows, KV head). A tile is PREFILL.rows // group tokens of one segment (PREFILL_WIDE's past head_dim 128)
times its KV head's group of query heads, flattened token-major into the rows of one tl.dot, so K and V are
loaded once for the group. Its keys run from the first one any of its rows may see (0, or the window's start)
to its last row's position, PREFILL.tok at a time, with an online softmax in fp32; the causal mask is aligned
to the end of the context (query i of a segment sits at ctx_len - q_len + i), and a window hides keys `window`
or more positions back.
The tile plan (which segment and rows each program takes) is built on the host once per forward and kept in
the first segment's scratch cache for every layer.

fp32 queries use IEEE fp32 dot products (never TF32); bf16 ones bf16 dots with fp32 accumulation. The config
is untuned: the device check (tests/gpu/test_triton_gpu.py) times it against the reference.
Signatures and semantics: kernels/attention_reference.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.attention_reference import padded_block_tables

# Triton's interpreter computes bf16 dot products wrong: there every dot runs in fp32 (kernels/triton_attention.py)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _prefill_tile(q_ptr, out_ptr, pages_ptr, table_ptr, tile_seg_ptr, tile_row_ptr, seg_ptr,
                  s_blk, s_layer, s_kv, s_tok, s_head, table_stride, layer, scale, window, num_q_heads,
                  GROUP: tl.constexpr, ROWS: tl.constexpr, MPAD: tl.constexpr, D: tl.constexpr, DPAD: tl.constexpr,
                  BS: tl.constexpr, TOKS: tl.constexpr, IEEE: tl.constexpr):
    """One tile of a segment's query rows (ROWS // GROUP tokens x the GROUP query heads of KV head h, flattened
    token-major) against its paged context: causal, aligned to the context's end, within `window` if > 0."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    seg = tl.load(tile_seg_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)      # the tile's first token, within its segment
    q_start = tl.load(seg_ptr + seg * 3)
    q_len = tl.load(seg_ptr + seg * 3 + 1)
    ctx = tl.load(seg_ptr + seg * 3 + 2)
    m = tl.arange(0, MPAD)
    t = row0 + m // GROUP                    # token within the segment
    g = m % GROUP
    rmask = (m < ROWS) & (t < q_len)
    d = tl.arange(0, DPAD)
    dmask = d < D
    qrow = (q_start + t).to(tl.int64) * num_q_heads + h * GROUP + g
    q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
    pos = ctx - q_len + t                    # each row's position in its context
    first = ctx - q_len + row0
    last = tl.minimum(first + ROWS // GROUP, ctx)  # one past the tile's last position
    lo = tl.where(window > 0, tl.maximum(first - window + 1, 0), 0)
    m_i = tl.full([MPAD], float("-inf"), tl.float32)
    l_i = tl.zeros([MPAD], tl.float32)
    acc = tl.zeros([MPAD, DPAD], tl.float32)
    base = pages_ptr + layer * s_layer + h * s_head
    for k0 in range((lo // TOKS) * TOKS, last, TOKS):
        key = k0 + tl.arange(0, TOKS)
        kmask = (key < last) & (key >= lo)
        blk = tl.load(table_ptr + seg * table_stride + key // BS, mask=kmask, other=0)
        kv_row = blk.to(tl.int64) * s_blk + (key % BS) * s_tok
        kv_mask = kmask[:, None] & dmask[None, :]
        k = tl.load(base + kv_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(base + s_kv + kv_row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype))).to(tl.float32)
        seen = kmask[None, :] & (key[None, :] <= pos[:, None])
        seen = seen & ((window <= 0) | (key[None, :] > pos[:, None] - window))
        s = tl.where(seen, s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet stays empty
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype)).to(tl.float32)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + qrow[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])


@dataclass(frozen=True)
class PrefillConfig:
    rows: int = 64       # query rows per program (tokens x the group's heads)
    tok: int = 64        # keys per inner step
    num_warps: int = 4
    num_stages: int = 2


PREFILL = PrefillConfig()
# head_dim 256 (Gemma 3): a 64 x 256 fp32 accumulator alone is 128 registers a thread at 4 warps; halve the tile
PREFILL_WIDE = PrefillConfig(rows=32, tok=32)


def _prefill_plan(segments, group: int, device: torch.device, c: PrefillConfig):
    """(tile -> segment, tile -> first token, segments' (q_start, q_len, ctx_len), padded block tables, tokens
    per tile) of a prefill batch: host work done once per forward, kept in the first segment's scratch cache."""
    cache = getattr(segments[0], "cache", None)
    key = ("triton_prefill", group, c)
    got = cache.get(key) if cache is not None else None
    if got is not None:
        return got
    per = max(1, c.rows // group)
    tile_seg, tile_row = [], []
    for i, s in enumerate(segments):
        for r in range(0, s.q_len, per):
            tile_seg.append(i)
            tile_row.append(r)
    tables = padded_block_tables(segments, device)
    meta = torch.tensor([[s.q_start, s.q_len, s.ctx_len] for s in segments], dtype=torch.int64, device=device)
    got = (torch.tensor(tile_seg, dtype=torch.int32, device=device),
           torch.tensor(tile_row, dtype=torch.int64, device=device), meta, tables, per)
    if cache is not None:
        cache[key] = got
    return got


def paged_prefill(q: torch.Tensor, pages: torch.Tensor, local_layer: int, segments, scale: float,
                  window: int = 0) -> torch.Tensor:
    """Flash attention over the paged context, read in place through each segment's block table: one program
    per (tile of a segment's query rows, KV head); see _prefill_tile."""
    T, Hq, D = q.shape
    _, _, _, BS, Hkv, Dp = pages.shape
    if Dp != D or Hq % Hkv:
        raise ValueError(f"paged_prefill: q {tuple(q.shape)} does not fit pages {tuple(pages.shape)}")
    if pages.stride(-1) != 1:
        raise ValueError("paged_prefill: pages must be contiguous in the head dimension")
    q = q.contiguous()
    out = torch.empty_like(q)
    if T == 0 or not segments:
        return out
    group = Hq // Hkv
    c = PREFILL if D <= 128 else PREFILL_WIDE
    tile_seg, tile_row, meta, tables, per = _prefill_plan(segments, group, q.device, c)
    _prefill_tile[(tile_seg.shape[0], Hkv)](
        q, out, pages, tables, tile_seg, tile_row, meta,
        pages.stride(0), pages.stride(1), pages.stride(2), pages.stride(3), pages.stride(4), tables.stride(0),
        local_layer, float(scale), int(window), Hq,
        GROUP=group, ROWS=per * group, MPAD=max(16, triton.next_power_of_2(per * group)), D=D,
        DPAD=triton.next_power_of_2(D), BS=BS, TOKS=c.tok, IEEE=q.dtype == torch.float32 or _INTERPRETED,
        num_warps=c.num_warps, num_stages=c.num_stages)
    return out
