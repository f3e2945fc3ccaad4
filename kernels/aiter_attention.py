"""Paged attention from AMD's AITER (ROCm): its Triton unified attention, for decode and prefill alike.

AITER's `unified_attention` (aiter.ops.triton.unified_attention, a port of vLLM's Triton unified attention
tuned for MI300/MI350) takes K and V as [num_blocks, block_size, num_kv_heads, head_dim] with all four strides
passed to the kernel. One layer of moorage's pages ([N, Ls, 2, block_size, Hkv, D]) is exactly that, as a
strided view: `pages[:, layer, 0]` and `pages[:, layer, 1]`. So the kernel reads K/V in place through the
block tables, with no gathered copy, and one call serves a batch of mixed sequences:
  - decode: one query per sequence, cu_seqlens_q = 0..B;
  - prefill: each segment's new tokens, causal and aligned to the end of its context (query i of a segment
    sits at ctx_len - q_len + i: the same rule as kernels/attention_reference.py).
A sliding window of `window` positions (the query's own included) is AITER's window_size (window - 1, 0).

AITER's HIP paged attention (`paged_attention_rocm`, `pa_fwd_asm`) is not used: it wants K as
[N, Hkv, D/x, block_size, x], which would cost a copy of the context at every step, and its signature has
changed from release to release, where unified_attention's (vLLM's) has not.

The kernel multiplies Q by K in the pages' dtype, so q and pages must share it. When they do not (an engine
with kv_dtype unlike dtype), this backend hands the call to kernels/triton_attention.py, which converts.

`import aiter` runs AITER's HIP JIT set-up, so this module imports only on ROCm, and the registry picks it
only where torch is a ROCm build (kernels/__init__.py). tests/test_aiter_kernels.py runs AITER's kernel
source under Triton's interpreter on CPU, against the torch reference, entering the package without its
HIP set-up. Signatures and semantics: kernels/attention_reference.py.
"""

from __future__ import annotations

import torch
from aiter.ops.triton.unified_attention import unified_attention

from kernels.attention_reference import padded_block_tables


def _window(window: int) -> tuple[int, int]:
    """moorage's window (positions a query sees, its own included; 0: all) as AITER's (left, right)."""
    return (window - 1, 0) if window > 0 else (-1, -1)


def _run(q: torch.Tensor, pages: torch.Tensor, local_layer: int, cu_q: torch.Tensor, max_q: int,
         ctx: torch.Tensor, max_ctx: int, tables: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    out = torch.empty_like(q)
    unified_attention(q=q, k=pages[:, local_layer, 0], v=pages[:, local_layer, 1], out=out, cu_seqlens_q=cu_q,
                      max_seqlen_q=max_q, seqused_k=ctx, max_seqlen_k=max_ctx, softmax_scale=float(scale),
                      causal=True, window_size=_window(window), block_table=tables, softcap=0.0,
                      q_descale=None, k_descale=None, v_descale=None)
    return out


def _check(q: torch.Tensor, pages: torch.Tensor, what: str) -> None:
    if q.dim() != 3 or pages.dim() != 6 or pages.shape[5] != q.shape[2] or q.shape[1] % pages.shape[4]:
        raise ValueError(f"{what}: q {tuple(q.shape)} does not fit pages {tuple(pages.shape)}")
    if pages.stride(-1) != 1:
        raise ValueError(f"{what}: pages must be contiguous in the head dimension")


def paged_decode(q: torch.Tensor, pages: torch.Tensor, local_layer: int, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    _check(q, pages, "paged_decode")
    if q.dtype != pages.dtype:
        from kernels import triton_attention

        return triton_attention.paged_decode(q, pages, local_layer, block_tables, ctx_lens, scale, window)
    B = q.shape[0]
    if B == 0:
        return torch.empty_like(q)
    q = q.contiguous()
    ctx = ctx_lens.to(device=q.device, dtype=torch.int64).contiguous()
    cu_q = torch.arange(B + 1, dtype=torch.int64, device=q.device)
    # the table's width bounds every context (AITER uses it only to choose a launch): no device sync
    max_ctx = block_tables.shape[1] * pages.shape[3]
    return _run(q, pages, local_layer, cu_q, 1, ctx, max_ctx, block_tables.contiguous(), scale, window)


def _segment_tensors(segments, device: torch.device, total: int):
    """(cu_seqlens_q, ctx lens, padded block tables, longest q, longest table in tokens) of a prefill batch,
    built once per forward (kept in the first segment's scratch cache, as the reference keeps its masks)."""
    cache = getattr(segments[0], "cache", None)
    got = cache.get("aiter") if cache is not None else None
    if got is not None:
        return got
    starts = [s.q_start for s in segments]
    ends = [s.q_start + s.q_len for s in segments]
    if starts[0] != 0 or ends[-1] != total or starts[1:] != ends[:-1]:
        raise ValueError(f"paged_prefill: segments must tile the {total} query rows in order "
                         f"(starts {starts}, lengths {[s.q_len for s in segments]})")
    cu_q = torch.tensor([0] + ends, dtype=torch.int64, device=device)
    ctx = torch.tensor([s.ctx_len for s in segments], dtype=torch.int64, device=device)
    got = (cu_q, ctx, padded_block_tables(segments, device), max(s.q_len for s in segments), max(s.ctx_len for s in segments))
    if cache is not None:
        cache["aiter"] = got
    return got


def paged_prefill(q: torch.Tensor, pages: torch.Tensor, local_layer: int, segments, scale: float,
                  window: int = 0) -> torch.Tensor:
    _check(q, pages, "paged_prefill")
    if q.dtype != pages.dtype or not segments:
        from kernels import triton_attention

        return triton_attention.paged_prefill(q, pages, local_layer, segments, scale, window)
    q = q.contiguous()
    cu_q, ctx, tables, max_q, max_ctx = _segment_tensors(segments, q.device, q.shape[0])
    return _run(q, pages, local_layer, cu_q, max_q, ctx, max_ctx, tables, scale, window)
