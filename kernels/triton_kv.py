"""KV copies in Triton (CUDA and ROCm; on CPU tensors under TRITON_INTERPRET=1 for tests): the six functions of
kernels/reference.py, same signatures, same checks (ValueError before any byte moves), same bytes.

Every copy is one kernel, `_copy_rows`: row i of `row_elems` elements goes from src[src_off[i]:] to
dst[dst_off[i]:]. The offsets are computed by torch on the device from the block ids or the block table:
- pack / unpack: one row per block (a block of a stage is one contiguous span of its pages);
- gather / scatter: one row per (token, layer, K|V): H x D elements, block-major pages <-> token-major
  rank buffers [T_r, L, 2, H, D].

Buffers live on the pages' device, as the reference's do; KV to or from host buffers (a transfer's) goes
through shared/device_staging.py, which stages it through a scratch buffer on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kernels import reference as ref

if TYPE_CHECKING:
    from shared.kv_layout import KVLayout

COLS = 1024  # elements per program along a row


@triton.jit
def _copy_rows(src_ptr, src_off_ptr, dst_ptr, dst_off_ptr, row_elems, COLS: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    mask = cols < row_elems
    s = tl.load(src_off_ptr + r)
    d = tl.load(dst_off_ptr + r)
    tl.store(dst_ptr + d + cols, tl.load(src_ptr + s + cols, mask=mask), mask=mask)


def _copy(src: torch.Tensor, src_off: torch.Tensor, dst: torch.Tensor, dst_off: torch.Tensor, row_elems: int) -> None:
    n = src_off.numel()
    if n and row_elems:
        _copy_rows[(n, triton.cdiv(row_elems, COLS))](src.reshape(-1), src_off.contiguous(), dst.reshape(-1),
                                                       dst_off.contiguous(), row_elems, COLS=COLS)


def _block_rows(pages_s: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    block = pages_s[0].numel() if pages_s.shape[0] else 0
    return ids * pages_s.stride(0), torch.arange(ids.numel(), device=ids.device, dtype=torch.long) * block, block


def pack_chunk(pages_s: torch.Tensor, block_ids, out: torch.Tensor | None = None) -> torch.Tensor:
    ref._check_pages(pages_s, "pack_chunk")
    if not pages_s.is_contiguous():
        raise ValueError("pack_chunk: pages must be contiguous")
    ids = ref._as_ids(block_ids, pages_s.shape[0], pages_s.device, "pack_chunk", unique=False)
    shape = (ids.numel(), *pages_s.shape[1:])
    if out is None:
        out_view = result = torch.empty(shape, dtype=pages_s.dtype, device=pages_s.device)
    else:
        out_view, result = ref._as_view(out, shape, pages_s, "pack_chunk out"), out
    src_off, dst_off, block = _block_rows(pages_s, ids)
    _copy(pages_s, src_off, out_view, dst_off, block)
    return result


def unpack_chunk(buf: torch.Tensor, pages_s: torch.Tensor, block_ids) -> None:
    ref._check_pages(pages_s, "unpack_chunk")
    if not pages_s.is_contiguous():
        raise ValueError("unpack_chunk: pages must be contiguous")
    ids = ref._as_ids(block_ids, pages_s.shape[0], pages_s.device, "unpack_chunk", unique=True)
    src = ref._as_view(buf, (ids.numel(), *pages_s.shape[1:]), pages_s, "unpack_chunk buf")
    dst_off, src_off, block = _block_rows(pages_s, ids)
    _copy(src, src_off, pages_s, dst_off, block)


def pack_chunk_crc(pages_s: torch.Tensor, block_ids, out: torch.Tensor) -> int:
    """pack_chunk into `out`; the CRC-32C of the packed bytes."""
    return ref._crc(pack_chunk(pages_s, block_ids, out=out))


def unpack_chunk_crc(buf: torch.Tensor, pages_s: torch.Tensor, block_ids) -> int:
    """unpack_chunk; the CRC-32C of `buf`'s bytes (a caller that finds it wrong must not use the blocks)."""
    unpack_chunk(buf, pages_s, block_ids)
    return ref._crc(buf)


def _token_rows(table: torch.Tensor, tokens: torch.Tensor, pages: torch.Tensor, layers: range, planes_per_token: int,
                token_base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Page offsets and buffer offsets of every (token, layer of `layers`, K|V) row: [T * len(layers) * 2]."""
    B = pages.shape[3]
    row = pages.shape[4] * pages.shape[5]
    local = torch.arange(len(layers), device=pages.device)
    kv = torch.arange(2, device=pages.device)
    page_off = (table[tokens // B] * pages.stride(0) + (tokens % B) * pages.stride(3))[:, None, None] \
        + local[None, :, None] * pages.stride(1) + kv[None, None, :] * pages.stride(2)
    buf_off = token_base[:, None, None] * (planes_per_token * row) \
        + ((layers.start + local)[None, :, None] * 2 + kv[None, None, :]) * row
    return page_off.reshape(-1), buf_off.reshape(-1)


def gather_for_ranks(stage_pages: list[torch.Tensor], block_table, num_tokens: int, cp: int, layout: KVLayout,
                     outs: list[torch.Tensor] | None = None, first: int = 0) -> list[torch.Tensor]:
    table, views, results = ref.validate_gather(stage_pages, block_table, num_tokens, cp, layout, outs, first)
    if any(not p.is_contiguous() for p in stage_pages):
        raise ValueError("gather_for_ranks: pages must be contiguous")
    device = stage_pages[0].device
    for r, view in enumerate(views):
        n = view.shape[0]
        if n == 0:
            continue
        tokens = torch.arange(first + (r - first) % cp, num_tokens, cp, device=device)
        base = torch.arange(n, device=device)
        for s, pages_s in enumerate(stage_pages):
            src_off, dst_off = _token_rows(table, tokens, pages_s, layout.stage_layers(s), 2 * layout.num_layers, base)
            _copy(pages_s, src_off, view, dst_off, layout.num_kv_heads * layout.head_dim)
    return results


def scatter_from_rank(buf: torch.Tensor, pages: torch.Tensor, block_table, num_tokens_rank: int,
                      first: int = 0) -> None:
    ref._check_pages(pages, "scatter_from_rank")
    if not pages.is_contiguous():
        raise ValueError("scatter_from_rank: pages must be contiguous")
    _, L, _, _, H, D = pages.shape
    if first < 0:
        raise ValueError(f"scatter_from_rank: first token must be >= 0, got {first}")
    src = ref._as_view(buf, (num_tokens_rank, L, 2, H, D), pages, "scatter_from_rank buf")
    table = ref._table_prefix(block_table, first + num_tokens_rank, pages, "scatter_from_rank", unique=True)
    if num_tokens_rank == 0:
        return
    tokens = torch.arange(first, first + num_tokens_rank, device=pages.device)
    base = torch.arange(num_tokens_rank, device=pages.device)
    page_off, buf_off = _token_rows(table, tokens, pages, range(L), 2 * L, base)
    _copy(src, buf_off, pages, page_off, H * D)
