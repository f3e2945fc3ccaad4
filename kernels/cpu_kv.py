"""KV copy kernels for CPUs: one small C routine (strided row copies, OpenMP), called through ctypes.

The four functions of kernels.reference, byte for byte the same results, without index tensors or
temporaries: every kernel is a list of *units*, each copying `count` rows of `row_bytes` for each of
`X` planes (layer x K/V) from one strided place to another, with plain memcpy, threads over units.
- pack/unpack: one unit per block (X = 1, one row of a whole block's bytes: one memcpy per block).
- gather: one unit per (block, rank, stage): a block holds [Ls, 2, B, H, D]; its tokens of rank r
  (every cp-th) become rows of the rank's token-major [T_r, L, 2, H, D] buffer.
- scatter: the reverse of gather for one rank's own pages (cp = 1, all layers in one stage).
Validation is the reference's (same checks, same ValueErrors, before anything is written); shapes the
C routine does not cover (non-contiguous pages, non-CPU tensors) go to the reference.

Build and cache: as kernels/cpu_attention.py (same compiler search, flags, cache dir and CPU key), so
no compiler means `available()` is False and kernels.get_kv_kernels falls back to the reference.
The GIL is released during the copy (ctypes), so a gather in a worker thread leaves the event loop free.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from kernels import reference as _ref
from kernels.cbuild import CKernel
from kernels.cpu_attention import _BASE_FLAGS, _FLAG_SETS
from kernels.reference import IndexLike
from shared.kv_layout import KVLayout


_C_SOURCE = r"""/* units[k] = {src_off, dst_off, count}: for x < X, b < count:
 *   dst[dst_off + x*dst_sx + b*dst_sb : +row] = src[src_off + x*src_sx + b*src_sb : +row] */
#include <stdint.h>
#include <string.h>

int moorage_kv_copy(const char *src, char *dst, const int64_t *units, int64_t n_units, int64_t X,
                    int64_t row, int64_t src_sx, int64_t src_sb, int64_t dst_sx, int64_t dst_sb,
                    int nthreads) {
    if (n_units < 0 || X < 0 || row < 0) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (n_units > 1 && nthreads > 1)
    for (int64_t k = 0; k < n_units; k++) {
        const char *s0 = src + units[3 * k];
        char *d0 = dst + units[3 * k + 1];
        int64_t count = units[3 * k + 2];
        if (dst_sx == row) { /* destination contiguous along x (a token's rows): write it in order */
            for (int64_t b = 0; b < count; b++) {
                const char *s = s0 + b * src_sb;
                char *d = d0 + b * dst_sb;
                for (int64_t x = 0; x < X; x++)
                    memcpy(d + x * row, s + x * src_sx, (size_t)row);
            }
        } else {
            for (int64_t x = 0; x < X; x++) {
                const char *s = s0 + x * src_sx;
                char *d = d0 + x * dst_sx;
                for (int64_t b = 0; b < count; b++)
                    memcpy(d + b * dst_sb, s + b * src_sb, (size_t)row);
            }
        }
    }
    return 0;
}
"""

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_ARGTYPES = [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _INT]
KERNEL = CKernel("kv_copy", _C_SOURCE, "moorage_kv_copy", _ARGTYPES, list(_FLAG_SETS), base_flags=_BASE_FLAGS,
                 what="CPU KV copy kernel")
_load, available = KERNEL.load, KERNEL.available


def _ok(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _copy(src: torch.Tensor, dst: torch.Tensor, units: np.ndarray, X: int, row: int,
          src_sx: int, src_sb: int, dst_sx: int, dst_sb: int) -> None:
    """Run the C routine; `units` is an int64 [n, 3] array of byte offsets and row counts."""
    if not len(units):
        return
    u = np.ascontiguousarray(units, dtype=np.int64)
    rc = _load()(src.data_ptr(), dst.data_ptr(), u.ctypes.data, len(u), X, row, src_sx, src_sb, dst_sx, dst_sb,
                 torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"kv_copy: bad arguments (rc={rc})")


def _block_units(src_ids: np.ndarray, dst_ids: np.ndarray, block_bytes: int) -> np.ndarray:
    """One unit per block: copy a whole block (one row of block_bytes)."""
    return np.stack([src_ids * block_bytes, dst_ids * block_bytes, np.ones_like(src_ids)], axis=1)


def pack_chunk(pages_s: torch.Tensor, block_ids: IndexLike, out: torch.Tensor | None = None) -> torch.Tensor:
    _ref._check_pages(pages_s, "pack_chunk")
    ids = _ref._as_ids(block_ids, pages_s.shape[0], pages_s.device, "pack_chunk", unique=False)
    shape = (ids.numel(), *pages_s.shape[1:])
    result = torch.empty(shape, dtype=pages_s.dtype, device=pages_s.device) if out is None else out
    view = _ref._as_view(result, shape, pages_s, "pack_chunk out")
    if not _ok(pages_s, view):
        return _ref.pack_chunk(pages_s, ids, out=result)
    block_bytes = pages_s[0].numel() * pages_s.element_size()
    src = ids.numpy()
    _copy(pages_s, view, _block_units(src, np.arange(len(src), dtype=np.int64), block_bytes), 1, block_bytes,
          0, 0, 0, 0)
    return result


def unpack_chunk(buf: torch.Tensor, pages_s: torch.Tensor, block_ids: IndexLike) -> None:
    _ref._check_pages(pages_s, "unpack_chunk")
    ids = _ref._as_ids(block_ids, pages_s.shape[0], pages_s.device, "unpack_chunk", unique=True)
    src = _ref._as_view(buf, (ids.numel(), *pages_s.shape[1:]), pages_s, "unpack_chunk buf")
    if not _ok(pages_s, src):
        return _ref.unpack_chunk(buf, pages_s, ids)
    block_bytes = pages_s[0].numel() * pages_s.element_size()
    dst = ids.numpy()
    _copy(src, pages_s, _block_units(np.arange(len(dst), dtype=np.int64), dst, block_bytes), 1, block_bytes,
          0, 0, 0, 0)


def _rank_units(table: np.ndarray, first: int, end: int, cp: int, r: int, B: int) -> tuple[np.ndarray, ...]:
    """Rank r's tokens t in [first, end) (t % cp == r), per block j that holds any: (block id, in-block
    offset of its first such token, that token's index in the rank's output, how many)."""
    j = np.arange(first // B, -(-end // B), dtype=np.int64)
    start, stop = np.maximum(j * B, first), np.minimum(j * B + B, end)
    t0 = start + (r - start) % cp
    keep = t0 < stop
    j, t0, stop = j[keep], t0[keep], stop[keep]
    base = first + (r - first) % cp  # rank r's first token in range
    return table[j], t0 - j * B, (t0 - base) // cp, (stop - t0 + cp - 1) // cp


def gather_for_ranks(stage_pages: list[torch.Tensor], block_table: IndexLike, num_tokens: int, cp: int,
                     layout: KVLayout, outs: list[torch.Tensor] | None = None, first: int = 0) -> list[torch.Tensor]:
    table, views, results = _ref.validate_gather(stage_pages, block_table, num_tokens, cp, layout, outs, first)
    if not _ok(*stage_pages, *views):
        return _ref.gather_for_ranks(stage_pages, table, num_tokens, cp, layout, outs=outs, first=first)
    B, es = layout.block_size, layout.elem_bytes
    row = layout.num_kv_heads * layout.head_dim * es  # one token of one layer's K (or V)
    token_bytes = layout.num_layers * 2 * row
    tab = table.numpy()
    for r, view in enumerate(views):
        blk, off, local, count = _rank_units(tab, first, num_tokens, cp, r, B)
        for s, pages_s in enumerate(stage_pages):
            span = layout.stage_layers(s)
            block_bytes = len(span) * 2 * B * row
            units = np.stack([blk * block_bytes + off * row, local * token_bytes + span.start * 2 * row, count], 1)
            _copy(pages_s, view, units, len(span) * 2, row, B * row, cp * row, row, token_bytes)
    return results


def scatter_from_rank(buf: torch.Tensor, pages: torch.Tensor, block_table: IndexLike, num_tokens_rank: int,
                      first: int = 0) -> None:
    _ref._check_pages(pages, "scatter_from_rank")
    _, L, _, B, H, D = pages.shape
    if first < 0:
        raise ValueError(f"scatter_from_rank: first token must be >= 0, got {first}")
    src = _ref._as_view(buf, (num_tokens_rank, L, 2, H, D), pages, "scatter_from_rank buf")
    table = _ref._table_prefix(block_table, first + num_tokens_rank, pages, "scatter_from_rank", unique=True)
    if not _ok(pages, src):
        return _ref.scatter_from_rank(buf, pages, table, num_tokens_rank, first)
    row = H * D * pages.element_size()
    token_bytes = L * 2 * row
    blk, off, local, count = _rank_units(table.numpy(), first, first + num_tokens_rank, 1, 0, B)
    units = np.stack([local * token_bytes, blk * (L * 2 * B * row) + off * row, count], 1)
    _copy(src, pages, units, L * 2, row, row, token_bytes, B * row, row)


# --- first touch -----------------------------------------------------------------------------------

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in, writable, without changing their bytes
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_libc: list = []


def prefault(pages: torch.Tensor, block_ids: list[int]) -> bool:
    """Fault in the memory of `block_ids` of a CPU page tensor now, without changing a byte.

    KV pages come from calloc (shared/kv_layout.py): a block nobody has written yet is not in memory,
    and the first write into it pays ~1 page fault per 4 KiB (measured: a scatter of 8 MB into fresh
    blocks 30-150 ms, into touched ones 3 ms). Decode calls this for a landing's blocks while the bytes
    are still on the wire. Cheap when already resident (~0.2 ms per 8 MB). False when it cannot (not
    Linux >= 5.14, not a contiguous CPU tensor): nothing happens then, the first write faults the pages
    in as before. (Transparent huge pages would make first touch ~30x cheaper, but with THP defrag in
    "madvise" mode a fault may compact memory synchronously: 0.6 s measured once here, so not used.)
    """
    if pages.device.type != "cpu" or not pages.is_contiguous() or not block_ids:
        return False
    if not _libc:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            _libc.append(libc)
        except (OSError, AttributeError):
            _libc.append(None)
    libc = _libc[0]
    if libc is None:
        return False
    base, block_bytes = pages.data_ptr(), pages[0].numel() * pages.element_size()
    ids = sorted(set(block_ids))
    runs, start, prev = [], ids[0], ids[0]
    for b in ids[1:]:
        if b != prev + 1:
            runs.append((start, prev + 1))
            start = b
        prev = b
    runs.append((start, prev + 1))
    for lo, hi in runs:
        a, z = base + lo * block_bytes, base + hi * block_bytes
        a -= a % _PAGE  # madvise wants a page-aligned start; the page before is part of the pool or its header
        if libc.madvise(a, z - a, _MADV_POPULATE_WRITE) != 0:
            return False
    return True
