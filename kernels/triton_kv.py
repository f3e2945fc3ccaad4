"""KV copies in Triton (CUDA and ROCm; on CPU tensors under TRITON_INTERPRET=1 for tests): the six functions of
kernels/reference.py, same signatures, same checks (ValueError before any byte moves), same bytes.

Every copy is one kernel, `_copy_rows`: row i of `row_elems` elements goes from src[src_off[i]:] to
dst[dst_off[i]:]. The offsets are computed by torch on the device from the block ids or the block table:
- pack / unpack: one row per block (a block of a stage is one contiguous span of its pages);
- gather / scatter: one row per (token, layer, K|V): H x D elements, block-major pages <-> token-major
  rank buffers [T_r, L, 2, H, D].

Buffers on the host with pages on a device (KV leaving or entering a GPU whose memory the transfer engine
cannot reach): the copy runs on the device into or out of a scratch buffer there, and one bulk copy
moves it to or from the host buffer (asynchronous and overlapped when the host buffer is pinned; waited
for before return, so the host bytes are final when the call returns). The CRC variants checksum the
host bytes: what was written to, or what came from, the transfer.
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


def _buffer(t: torch.Tensor, shape: tuple[int, ...], pages: torch.Tensor, what: str) -> torch.Tensor:
    """`t` viewed as `shape`: the pages' dtype, contiguous, exact numel; on the pages' device or on the host."""
    if t.device != pages.device and t.device.type != "cpu":
        raise ValueError(f"{what}: device {t.device} is neither the pages' ({pages.device}) nor the host")
    return ref._as_view(t, shape, pages if t.device == pages.device else pages.new_empty(0, device="cpu"), what)


class _Staged:
    """A buffer as the kernel sees it: itself when on the pages' device, else a device scratch copy."""

    def __init__(self, buf: torch.Tensor, pages: torch.Tensor, incoming: bool):
        self.buf, self.device_side = buf, buf
        if buf.device != pages.device:
            self.device_side = torch.empty(buf.shape, dtype=buf.dtype, device=pages.device)
            if incoming:  # host -> device before the kernel reads it
                self.device_side.copy_(buf, non_blocking=buf.is_pinned())

    def finish(self) -> None:
        """device -> host after the kernel wrote it; the host bytes are final on return."""
        if self.device_side is not self.buf:
            self.buf.copy_(self.device_side, non_blocking=self.buf.is_pinned())
            if self.buf.is_pinned():
                torch.cuda.current_stream(self.device_side.device).synchronize()


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
        out_view, result = _buffer(out, shape, pages_s, "pack_chunk out"), out
    staged = _Staged(out_view, pages_s, incoming=False)
    src_off, dst_off, block = _block_rows(pages_s, ids)
    _copy(pages_s, src_off, staged.device_side, dst_off, block)
    staged.finish()
    return result


def unpack_chunk(buf: torch.Tensor, pages_s: torch.Tensor, block_ids) -> None:
    ref._check_pages(pages_s, "unpack_chunk")
    if not pages_s.is_contiguous():
        raise ValueError("unpack_chunk: pages must be contiguous")
    ids = ref._as_ids(block_ids, pages_s.shape[0], pages_s.device, "unpack_chunk", unique=True)
    src = _Staged(_buffer(buf, (ids.numel(), *pages_s.shape[1:]), pages_s, "unpack_chunk buf"), pages_s, incoming=True)
    dst_off, src_off, block = _block_rows(pages_s, ids)
    _copy(src.device_side, src_off, pages_s, dst_off, block)


def pack_chunk_crc(pages_s: torch.Tensor, block_ids, out: torch.Tensor) -> int:
    """pack_chunk into `out`; the CRC-32C of the packed bytes as they are in `out` (on the host: after the copy)."""
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
    if outs is not None and len(outs) == cp and stage_pages and all(o.device.type == "cpu" for o in outs) \
            and stage_pages[0].device.type != "cpu":  # host buffers: checked as host tensors, filled via scratch
        for r, o in enumerate(outs):
            if not o.is_contiguous():
                raise ValueError(f"gather_for_ranks outs[{r}]: buffer must be contiguous")
        staged = [torch.empty(o.shape, dtype=o.dtype, device=stage_pages[0].device) for o in outs]
        gather_for_ranks(stage_pages, block_table, num_tokens, cp, layout, staged, first)
        for o, s in zip(outs, staged):
            o.copy_(s, non_blocking=o.is_pinned())
        if any(o.is_pinned() for o in outs):
            torch.cuda.current_stream(stage_pages[0].device).synchronize()
        return outs
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
    src = _Staged(_buffer(buf, (num_tokens_rank, L, 2, H, D), pages, "scatter_from_rank buf"), pages, incoming=True)
    table = ref._table_prefix(block_table, first + num_tokens_rank, pages, "scatter_from_rank", unique=True)
    if num_tokens_rank == 0:
        return
    tokens = torch.arange(first, first + num_tokens_rank, device=pages.device)
    base = torch.arange(num_tokens_rank, device=pages.device)
    page_off, buf_off = _token_rows(table, tokens, pages, range(L), 2 * L, base)
    _copy(src.device_side, buf_off, pages, page_off, H * D)
