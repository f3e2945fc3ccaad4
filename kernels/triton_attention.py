"""Paged attention in Triton (CUDA and ROCm; on CPU tensors under TRITON_INTERPRET=1 for tests).

paged_decode is flash-decoding over the paged KV, read in place through the block table (no gathered
copy): one program per (sequence, KV head, split of the context). A program holds the query heads of its
KV head's group ([G, D], padded to 16 rows for tl.dot) and walks its split CONFIG.tok tokens at a time: each token's
page comes from the block table, K and V rows are loaded once for the whole group, and an online
softmax keeps (max, sum, acc) in fp32. A second kernel merges the splits by log-sum-exp. Splits are
chosen so batch x KV heads x splits covers the device's multiprocessors about eight times over (with one
program per sequence and head, batch 32 x 3 KV heads would leave most of an H200's 132 SMs idle), and are
never shorter than MIN_SPLIT_TOKENS.

paged_prefill is kernels/triton_prefill.py's (flash attention over the same paged KV, also read in place).

fp32 pages use IEEE fp32 dot products (never TF32), so results match the torch reference to fp32 rounding.
Signatures and semantics: kernels/attention_reference.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton_prefill import paged_prefill  # noqa: F401 - this backend's prefill (the registry reads it here)

MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more in its merge than it gains in parallelism
GROUP_PAD = 16          # tl.dot's smallest M


@dataclass(frozen=True)
class DecodeConfig:
    tok: int = 64        # tokens per inner step (4 pages of 16)
    waves: int = 8       # programs per multiprocessor aimed at (through the number of splits)
    num_warps: int = 4
    num_stages: int = 2


CONFIG = DecodeConfig()  # bench/attention_device.py sweeps others (each checked against the reference there)
# Triton's interpreter (tests on CPU) computes bf16 dot products wrong (3.9: ~1e10 off); there every dot runs
# in fp32, so tests check the kernel's indexing, masking and merge, and the GPU check its bf16 dots.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _decode_split(q_ptr, pages_ptr, table_ptr, ctx_ptr, acc_ptr, ml_ptr,
                  s_blk, s_layer, s_kv, s_tok, s_head, table_stride, layer, scale, window, split_tokens,
                  num_splits, num_q_heads,
                  GROUP: tl.constexpr, GPAD: tl.constexpr, D: tl.constexpr, DPAD: tl.constexpr,
                  BS: tl.constexpr, TOKS: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    lo = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)
    start = tl.maximum(split * split_tokens, (lo // TOKS) * TOKS)
    end = tl.minimum((split + 1) * split_tokens, ctx)

    g = tl.arange(0, GPAD)
    d = tl.arange(0, DPAD)
    gmask = g < GROUP
    dmask = d < D
    qh = h * GROUP + g
    q = tl.load(q_ptr + (b * num_q_heads + qh)[:, None] * D + d[None, :], mask=gmask[:, None] & dmask[None, :],
                other=0.0)
    m_i = tl.full([GPAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GPAD], tl.float32)
    acc = tl.zeros([GPAD, DPAD], tl.float32)
    base = pages_ptr + layer * s_layer + h * s_head
    for t0 in range(start, end, TOKS):
        t = t0 + tl.arange(0, TOKS)
        tmask = (t < end) & (t >= lo)
        blk = tl.load(table_ptr + b * table_stride + t // BS, mask=tmask, other=0)
        row = blk.to(tl.int64) * s_blk + (t % BS) * s_tok
        kv_mask = tmask[:, None] & dmask[None, :]
        k = tl.load(base + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(base + s_kv + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q.to(k.dtype), tl.trans(k)).to(tl.float32)
        s = tl.where(tmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v).to(tl.float32)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = ((b * num_q_heads + qh) * num_splits + split)
    tl.store(acc_ptr + out[:, None] * D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
    tl.store(ml_ptr + out * 2, m_i, mask=gmask)
    tl.store(ml_ptr + out * 2 + 1, l_i, mask=gmask)


@triton.jit
def _merge_splits(acc_ptr, ml_ptr, out_ptr, num_splits,
                  D: tl.constexpr, DPAD: tl.constexpr, SPAD: tl.constexpr):
    row = tl.program_id(0)  # b * Hq + hq
    sp = tl.arange(0, SPAD)
    d = tl.arange(0, DPAD)
    smask = sp < num_splits
    m = tl.load(ml_ptr + (row * num_splits + sp) * 2, mask=smask, other=float("-inf"))
    l = tl.load(ml_ptr + (row * num_splits + sp) * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
    acc = tl.load(acc_ptr + (row * num_splits + sp)[:, None] * D + d[None, :],
                  mask=smask[:, None] & (d < D)[None, :], other=0.0)
    o = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l, 0)
    tl.store(out_ptr + row * D + d, o.to(out_ptr.dtype.element_ty), mask=d < D)


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few splits, so tests cover the merge


def num_splits(batch: int, kv_heads: int, max_ctx: int, device: torch.device,
               config: DecodeConfig | None = None) -> tuple[int, int]:
    """(splits, tokens per split): `waves` programs per multiprocessor, each split >= MIN_SPLIT_TOKENS (8 waves,
    64 tokens, 4 warps: the best overall of bench/attention_device.py --sweep on an H200)."""
    c = config or CONFIG
    want = max(1, -(-c.waves * _multiprocessors(device) // (batch * kv_heads)))
    most = max(1, -(-max_ctx // MIN_SPLIT_TOKENS))
    splits = min(want, most)
    per = -(-max_ctx // splits)
    per = -(-per // c.tok) * c.tok
    return -(-max_ctx // per), per


def paged_decode(q: torch.Tensor, pages: torch.Tensor, local_layer: int, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    B, Hq, D = q.shape
    _, _, _, BS, Hkv, Dp = pages.shape
    if Dp != D or Hq % Hkv:
        raise ValueError(f"paged_decode: q {tuple(q.shape)} does not fit pages {tuple(pages.shape)}")
    if pages.stride(-1) != 1:
        raise ValueError("paged_decode: pages must be contiguous in the head dimension")
    q = q.contiguous()
    tables = block_tables.contiguous()
    ctx = ctx_lens.to(device=q.device, dtype=torch.int64).contiguous()
    out = torch.empty_like(q)
    if B == 0:
        return out
    # the table's width bounds every context: no device sync (ctx.max() would cost one per layer and step);
    # splits past a shorter context end at once
    max_ctx = tables.shape[1] * BS
    c = CONFIG
    splits, per = num_splits(B, Hkv, max_ctx, q.device, c)
    acc = torch.empty((B, Hq, splits, D), dtype=torch.float32, device=q.device)
    ml = torch.empty((B, Hq, splits, 2), dtype=torch.float32, device=q.device)
    group = Hq // Hkv
    dpad = triton.next_power_of_2(D)
    _decode_split[(B, Hkv, splits)](
        q, pages, tables, ctx, acc, ml,
        pages.stride(0), pages.stride(1), pages.stride(2), pages.stride(3), pages.stride(4), tables.stride(0),
        local_layer, float(scale), int(window), per, splits, Hq,
        GROUP=group, GPAD=max(GROUP_PAD, triton.next_power_of_2(group)), D=D, DPAD=dpad, BS=BS, TOKS=c.tok,
        IEEE=pages.dtype == torch.float32 or _INTERPRETED, num_warps=c.num_warps, num_stages=c.num_stages)
    _merge_splits[(B * Hq,)](acc, ml, out, splits, D=D, DPAD=dpad, SPAD=max(2, triton.next_power_of_2(splits)))
    return out


__all__ = ["CONFIG", "DecodeConfig", "num_splits", "paged_decode", "paged_prefill"]
