"""KV copy kernels for CPUs: two small C routines (row copies, OpenMP), called through ctypes.

The six functions of kernels.reference, byte for byte the same results, without index tensors or
temporaries, one C call per Python call:
- pack/unpack (`moorage_kv_blocks`): whole blocks; runs of consecutive block ids are one memcpy, and the
  threads split the packed side's bytes evenly. The `_crc` pair also returns the CRC-32C of the packed
  bytes (a pool object's checksum), computed while they are copied: the packed side is read from
  memory once, not once to copy and once to checksum (three interleaved CRC-32C chains over L1-sized
  steps; threads' and lanes' CRCs combined by GF(2) multiplication). Builds without the instruction
  (no -march=native) leave those two to the reference.
- gather/scatter (`moorage_kv_tokens`): a transpose between block pages [Ls, 2, B, H, D] (every stage)
  and token-major rank buffers [T_r, L, 2, H, D] (every rank of cp at once: each block is read once);
  rows of H*D elements, threads over blocks.
The block ids are checked in C before a byte moves (range; duplicates for writes); every other check
is a few attribute tests here. Anything unusual (a check fails, non-contiguous or non-CPU tensors,
ids that are not integers) goes to the reference, which raises its ValueError or does the copy itself,
so errors are the reference's word for word and nothing is written first.
Copies under MIN_SPLIT_BYTES run on one thread; copies of at least STREAM_BYTES write with
non-temporal stores (past the cache, which they would not fit anyway). The OpenMP pool is
torch's own: the .so links libgomp.so.1, the soname of the libgomp torch bundles, so the process has
one pool, not two competing ones.

The C source is kernels/csrc/kv_copy.c. Its library also holds the CRC-32C routines that only read
(kernels/cpu_crc.py): the copy-with-CRC above shares their code, so both are one build, and `KERNEL`,
`available`, `threads` and the knobs here are theirs too. Build and cache: kernels/cbuild.py (as
kernels/cpu_attention.py: same compiler search, flags, cache dir and CPU key), so no compiler means
`available()` is False and kernels.get_kv_kernels falls back to the reference. The GIL is released
during the copy (ctypes), so a gather in a worker thread leaves the event loop free.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import threading
from array import array
from typing import TYPE_CHECKING

import torch

from kernels import reference as _ref
from kernels.cbuild import BASE_FLAGS, CSRC, FLAG_SETS, CKernel
from kernels.reference import IndexLike, rank_num_tokens

if TYPE_CHECKING:  # not at run time: kernels/ sits below shared/ (tests/test_layering.py)
    from shared.kv_layout import KVLayout

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_TOKENS_ARGS = [_INT, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _INT]
_BLOCKS_ARGS = [_PTR, _PTR, _PTR, _I64, _I64, _I64, _INT, _I64, _I64, _INT, _PTR]
_CRC_BLOCKS_ARGS = [_PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _INT]
_CRC_JOIN_ARGS = [_PTR, _I64, _I64, _PTR]
_CRC32C_ARGS = [_PTR, _I64, _PTR]
_BLOCKS_NARROW_ARGS = [_PTR, _PTR, _PTR, _I64, _I64, _I64, _INT, _INT, _I64, _INT, _PTR]
KERNEL = CKernel("kv_copy", CSRC / "kv_copy.c", "moorage_kv_tokens", _TOKENS_ARGS, list(FLAG_SETS),
                 base_flags=list(BASE_FLAGS), libs=["-lm"], what="CPU KV copy kernel",
                 more={"moorage_kv_blocks": _BLOCKS_ARGS, "moorage_crc_blocks": _CRC_BLOCKS_ARGS,
                       "moorage_crc_join": _CRC_JOIN_ARGS, "moorage_crc32c": _CRC32C_ARGS, "moorage_crc_folds": [],
                       "moorage_kv_blocks_narrow": _BLOCKS_NARROW_ARGS})
_load, available = KERNEL.load, KERNEL.available

# tuning (measured on a 2-core EPYC VM, see /work/notes/kernels2.md)
MIN_SPLIT_BYTES = 1 << 18   # copies smaller than this run on one thread (a parallel region costs more)
STREAM_BYTES = 1 << 24      # copies this big write with non-temporal stores
_local = threading.local()  # .threads: this thread's cap on the library's threads (see `threads`)


@contextlib.contextmanager
def threads(n: int):
    """Copies (and kernels.cpu_crc.block_crcs) made by this thread inside the block use at most n threads.
    For copies that overlap other busy threads (a handoff's gather and scatter run while the Transfer
    Engine sends): an OpenMP region whose second thread is descheduled waits for it, so on a full machine
    one thread can be faster."""
    before = getattr(_local, "threads", None)
    _local.threads = max(1, n)
    try:
        yield
    finally:
        _local.threads = before


def _nthreads() -> int:
    """Threads for this call into the library (also kernels/cpu_crc.py's)."""
    cap = getattr(_local, "threads", None)
    n = torch.get_num_threads()
    return n if cap is None else min(n, cap)


def _ids(ids: IndexLike, n: int | None = None) -> tuple[int, int, object] | None:
    """The first `n` (default: all) block ids as int64 in memory: (address, count, owner to keep alive),
    or None when the reference must handle them (odd dtype or device, too few, not integers). Also
    kernels/cpu_crc.py's."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype != torch.long and (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool):
            return None
        if ids.dim() != 1 or not ids.is_cpu:
            return None
        count = ids.shape[0] if n is None else n
        if count > ids.shape[0]:
            return None
        t = ids if ids.dtype == torch.long and ids.is_contiguous() else ids[:count].to(torch.long).contiguous()
        return t.data_ptr(), count, t
    try:
        a = array("q", ids if n is None else ids[:n])
    except (TypeError, ValueError, OverflowError):
        return None
    if n is not None and len(a) < n:
        return None
    return a.buffer_info()[0], len(a), a


def _pages_ok(p: torch.Tensor) -> bool:
    return p.dim() == 6 and p.shape[2] == 2 and p.is_cpu and p.is_contiguous()


def _buf_ok(b: torch.Tensor, like: torch.Tensor, numel: int) -> bool:
    return b.dtype == like.dtype and b.is_cpu and b.is_contiguous() and b.numel() == numel


def _blocks(src: torch.Tensor, dst: torch.Tensor, ids: tuple[int, int, object], pages: torch.Tensor,
            block_numel: int, unpack: int, crc: ctypes.c_uint32 | None = None) -> int:
    fn = KERNEL.symbol_fn("moorage_kv_blocks")
    return fn(src.data_ptr(), dst.data_ptr(), ids[0], ids[1], pages.shape[0], block_numel * pages.element_size(),
              unpack, MIN_SPLIT_BYTES, STREAM_BYTES, _nthreads(), None if crc is None else ctypes.byref(crc))


def _chunk_ok(pages_s: torch.Tensor, buf: torch.Tensor | None, ids: tuple[int, int, object] | None) -> int:
    """Elements per block when the C routine can take this pack/unpack (else 0: the reference's turn)."""
    if ids is None or not _pages_ok(pages_s) or not available():
        return 0
    block_numel = math.prod(pages_s.shape[1:])
    return block_numel if buf is None or _buf_ok(buf, pages_s, ids[1] * block_numel) else 0


def pack_chunk(pages_s: torch.Tensor, block_ids: IndexLike, out: torch.Tensor | None = None) -> torch.Tensor:
    ids = _ids(block_ids)
    block_numel = _chunk_ok(pages_s, out, ids)
    if not block_numel:
        return _ref.pack_chunk(pages_s, block_ids, out=out)
    result = torch.empty((ids[1], *pages_s.shape[1:]), dtype=pages_s.dtype) if out is None else out
    if _blocks(pages_s, result, ids, pages_s, block_numel, 0) != 0:  # an id out of range (or no memory)
        return _ref.pack_chunk(pages_s, block_ids, out=out)  # raises the reference's ValueError
    return result


def unpack_chunk(buf: torch.Tensor, pages_s: torch.Tensor, block_ids: IndexLike) -> None:
    ids = _ids(block_ids)
    block_numel = _chunk_ok(pages_s, buf, ids)
    if not block_numel:
        return _ref.unpack_chunk(buf, pages_s, block_ids)
    if _blocks(buf, pages_s, ids, pages_s, block_numel, 1) != 0:  # an id out of range or repeated (or no memory)
        return _ref.unpack_chunk(buf, pages_s, block_ids)  # raises the reference's ValueError


def _copy_crc(pages_s: torch.Tensor, packed: torch.Tensor, block_ids: IndexLike, unpack: int) -> int | None:
    """The CRC-32C of `packed`, computed as it is copied from (pack) or into (unpack) the blocks; None when
    the reference must do it (no CRC instruction in this build, odd arguments, or its error to raise)."""
    ids = _ids(block_ids)
    block_numel = _chunk_ok(pages_s, packed, ids)
    crc = ctypes.c_uint32()
    src, dst = (packed, pages_s) if unpack else (pages_s, packed)
    if not block_numel or _blocks(src, dst, ids, pages_s, block_numel, unpack, crc) != 0:
        return None
    return crc.value


_NARROW_KINDS = {torch.bfloat16: 1, torch.float8_e4m3fn: 2}  # compact pool objects' element types


def _convert_crc(pages_s: torch.Tensor, packed: torch.Tensor, block_ids: IndexLike, unpack: int) -> int | None:
    """float32 pages <-> a bfloat16 or float8 e4m3fn packed buffer (compact pool objects), converted in the
    copy, with the CRC-32C of the packed bytes; None when the reference must do it (other dtypes, odd
    arguments, no CRC instruction, or its error to raise)."""
    kind = _NARROW_KINDS.get(packed.dtype)
    if pages_s.dtype != torch.float32 or kind is None:
        return None
    ids = _ids(block_ids)
    if ids is None or not _pages_ok(pages_s) or not available():
        return None
    block_numel = math.prod(pages_s.shape[1:])
    if not (packed.is_cpu and packed.is_contiguous() and packed.numel() == ids[1] * block_numel):
        return None
    crc = ctypes.c_uint32()
    src, dst = (packed, pages_s) if unpack else (pages_s, packed)
    fn = KERNEL.symbol_fn("moorage_kv_blocks_narrow")
    if fn(src.data_ptr(), dst.data_ptr(), ids[0], ids[1], pages_s.shape[0], block_numel, unpack, kind,
          MIN_SPLIT_BYTES, _nthreads(), ctypes.byref(crc)) != 0:
        return None
    return crc.value


def pack_chunk_crc(pages_s: torch.Tensor, block_ids: IndexLike, out: torch.Tensor) -> int:
    """pack_chunk into `out`, returning the CRC-32C of the packed bytes, computed as they are copied (a
    bfloat16 or float8 e4m3fn `out` for float32 pages: converted in the same pass)."""
    convert = out.dtype != pages_s.dtype
    crc = (_convert_crc if convert else _copy_crc)(pages_s, out, block_ids, 0)
    return _ref.pack_chunk_crc(pages_s, block_ids, out) if crc is None else crc


def unpack_chunk_crc(buf: torch.Tensor, pages_s: torch.Tensor, block_ids: IndexLike) -> int:
    """unpack_chunk, returning the CRC-32C of `buf`'s bytes, computed as they are copied (read once; a
    bfloat16 or float8 e4m3fn `buf` into float32 pages: widened in the same pass)."""
    convert = buf.dtype != pages_s.dtype
    crc = (_convert_crc if convert else _copy_crc)(pages_s, buf, block_ids, 1)
    return _ref.unpack_chunk_crc(buf, pages_s, block_ids) if crc is None else crc


@functools.lru_cache(maxsize=64)
def _geometry(layout: KVLayout) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...], int]:
    """Per stage: page shape past the block axis, and planes (layers x 2); elements per token."""
    shapes = tuple(layout.page_shape(s, 0)[1:] for s in range(layout.stages))
    return shapes, tuple(sh[0] * 2 for sh in shapes), layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim


def _tokens(to_pages: int, pages: list[torch.Tensor], planes: tuple[int, ...], ranks: list[torch.Tensor],
            ids: tuple[int, int, object], first: int, end: int, row: int) -> int:
    S, cp = len(pages), len(ranks)
    return KERNEL.load()(to_pages, (_PTR * S)(*[p.data_ptr() for p in pages]), (_I64 * S)(*planes), S,
                         (_PTR * cp)(*[r.data_ptr() for r in ranks]), cp, ids[0], pages[0].shape[0], first, end,
                         pages[0].shape[3], row, MIN_SPLIT_BYTES, STREAM_BYTES, _nthreads())


def gather_for_ranks(stage_pages: list[torch.Tensor], block_table: IndexLike, num_tokens: int, cp: int,
                     layout: KVLayout, outs: list[torch.Tensor] | None = None, first: int = 0) -> list[torch.Tensor]:
    shapes, planes, per_token = _geometry(layout)
    ok = cp >= 1 and len(stage_pages) == layout.stages and 0 <= first <= num_tokens and available() and \
        (outs is None or len(outs) == cp)
    ok = ok and all(tuple(p.shape[1:]) == sh and p.shape[0] == stage_pages[0].shape[0] and p.dtype == layout.dtype
                    and p.is_cpu and p.is_contiguous() for p, sh in zip(stage_pages, shapes))
    counts = [rank_num_tokens(num_tokens, cp, r, first) for r in range(cp)] if ok else []
    ok = ok and (outs is None or all(_buf_ok(o, stage_pages[0], c * per_token) for o, c in zip(outs, counts)))
    ids = _ids(block_table, -(-num_tokens // layout.block_size)) if ok else None
    if ids is None:
        return _ref.gather_for_ranks(stage_pages, block_table, num_tokens, cp, layout, outs=outs, first=first)
    results = outs if outs is not None else \
        [torch.empty((c, layout.num_layers, 2, layout.num_kv_heads, layout.head_dim), dtype=layout.dtype)
         for c in counts]
    row = layout.num_kv_heads * layout.head_dim * layout.elem_bytes
    if _tokens(0, stage_pages, planes, results, ids, first, num_tokens, row) != 0:
        return _ref.gather_for_ranks(stage_pages, block_table, num_tokens, cp, layout, outs=outs, first=first)
    return list(results)


def scatter_from_rank(buf: torch.Tensor, pages: torch.Tensor, block_table: IndexLike, num_tokens_rank: int,
                      first: int = 0) -> None:
    ok = _pages_ok(pages) and first >= 0 and num_tokens_rank >= 0 and available()
    per_token = pages.shape[1] * 2 * pages.shape[4] * pages.shape[5] if ok else 0
    ok = ok and _buf_ok(buf, pages, num_tokens_rank * per_token)
    ids = _ids(block_table, -(-(first + num_tokens_rank) // pages.shape[3])) if ok else None
    if ids is None:
        return _ref.scatter_from_rank(buf, pages, block_table, num_tokens_rank, first)
    row = pages.shape[4] * pages.shape[5] * pages.element_size()
    if _tokens(1, [pages], (pages.shape[1] * 2,), [buf], ids, first, first + num_tokens_rank, row) != 0:
        return _ref.scatter_from_rank(buf, pages, block_table, num_tokens_rank, first)  # raises its ValueError

