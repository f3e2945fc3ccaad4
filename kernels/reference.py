"""Reference KV copy kernels: pure torch indexing, correct on any device, the oracle for fast backends.

Shapes follow shared/kv_layout.py:
    stage pages   [num_blocks, Ls, 2, B, H, D]   (block-major; block ids shared by all stages)
    chunk payload [n_blocks, Ls, 2, B, H, D]     (pack_chunk / unpack_chunk)
    rank buffer   [T_r, L, 2, H, D]              (token-major; rank r of cp holds t = r, r+cp, ...)
Token t of a sequence lives in block block_table[t // B] at slot t % B; only ceil(n / B) table
entries are read, so a partial last block is fine and its unused slots are never touched.
Every function validates first and raises ValueError before writing anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import crc32c
import torch

# kernels/ imports nothing from shared/ at run time (tests/test_layering.py): a layout is only read, duck-typed
if TYPE_CHECKING:
    from shared.kv_layout import KVLayout

IndexLike = torch.Tensor | Sequence[int]


def rank_num_tokens(num_tokens: int, cp: int, rank: int, first: int = 0) -> int:
    """Tokens held by decode rank `rank` of `cp`: those first <= t < num_tokens with t % cp == rank."""
    return len(range(first + (rank - first) % cp, num_tokens, cp))


def _check_pages(pages: torch.Tensor, what: str) -> None:
    if pages.dim() != 6 or pages.shape[2] != 2:
        raise ValueError(f"{what}: expected pages [num_blocks, L, 2, B, H, D], got {tuple(pages.shape)}")


def _as_ids(ids: IndexLike, num_blocks: int, device: torch.device, what: str, unique: bool) -> torch.Tensor:
    """1-D int64 block ids on `device`, range-checked (and duplicate-free for writes: index_copy_ /
    index_put_ with repeated targets would be nondeterministic)."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"{what}: block ids must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
        t = ids.to(device=device, dtype=torch.long)
    else:
        t = torch.tensor(list(ids), dtype=torch.long, device=device)
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= num_blocks:
            raise ValueError(f"{what}: block id out of range [0, {num_blocks}): min {lo}, max {hi}")
        if unique and torch.unique(t).numel() != t.numel():
            raise ValueError(f"{what}: duplicate block ids in a write target")
    return t


def _as_view(t: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor, what: str,
             convert: bool = False) -> torch.Tensor:
    """`t` viewed as `shape`: same dtype/device as `like` (`convert`: any floating dtype), contiguous, exact
    numel (flat is fine)."""
    if convert and t.dtype.is_floating_point and like.dtype.is_floating_point:
        pass
    elif t.dtype != like.dtype:
        raise ValueError(f"{what}: dtype {t.dtype} != pages dtype {like.dtype}")
    if t.device != like.device:
        raise ValueError(f"{what}: device {t.device} != pages device {like.device}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: buffer must be contiguous")
    numel = 1
    for n in shape:
        numel *= n
    if t.numel() != numel:
        raise ValueError(f"{what}: numel {t.numel()} != expected {numel} for shape {shape}")
    return t.view(shape)


def _table_prefix(block_table: IndexLike, num_tokens: int, pages: torch.Tensor, what: str,
                  unique: bool) -> torch.Tensor:
    """The ceil(num_tokens / B) table entries actually used, validated."""
    if num_tokens < 0:
        raise ValueError(f"{what}: num_tokens must be >= 0, got {num_tokens}")
    B = pages.shape[3]
    need = -(-num_tokens // B)
    have = block_table.shape[0] if isinstance(block_table, torch.Tensor) else len(block_table)
    if have < need:
        raise ValueError(f"{what}: block table has {have} entries, {num_tokens} tokens need {need}")
    return _as_ids(block_table[:need], pages.shape[0], pages.device, what, unique)


def pack_chunk(pages_s: torch.Tensor, block_ids: IndexLike, out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather whole blocks of one stage into one contiguous [n, Ls, 2, B, H, D] buffer.

    With `out` (same device, contiguous, exact numel, any shape) it is filled and returned as is. An `out` of
    another floating dtype (a compact pool object: float32 pages into bfloat16) gets the values converted,
    rounded to nearest even.
    """
    _check_pages(pages_s, "pack_chunk")
    ids = _as_ids(block_ids, pages_s.shape[0], pages_s.device, "pack_chunk", unique=False)
    shape = (ids.numel(), *pages_s.shape[1:])
    if out is None:
        return torch.index_select(pages_s, 0, ids)
    view = _as_view(out, shape, pages_s, "pack_chunk out", convert=True)
    if view.dtype == pages_s.dtype:
        torch.index_select(pages_s, 0, ids, out=view)
    else:
        view.copy_(torch.index_select(pages_s, 0, ids))
    return out


def unpack_chunk(buf: torch.Tensor, pages_s: torch.Tensor, block_ids: IndexLike) -> None:
    """Write a packed chunk buffer (shaped or flat) into `block_ids` of one stage's pages (a buffer of another
    floating dtype, a compact pool object's, is converted to the pages')."""
    _check_pages(pages_s, "unpack_chunk")
    ids = _as_ids(block_ids, pages_s.shape[0], pages_s.device, "unpack_chunk", unique=True)
    src = _as_view(buf, (ids.numel(), *pages_s.shape[1:]), pages_s, "unpack_chunk buf", convert=True)
    pages_s.index_copy_(0, ids, src.to(pages_s.dtype))


def _crc(t: torch.Tensor) -> int:
    return crc32c.crc32c(t.detach().reshape(-1).view(torch.uint8).cpu().numpy())


def pack_chunk_crc(pages_s: torch.Tensor, block_ids: IndexLike, out: torch.Tensor) -> int:
    """pack_chunk into `out`; returns the CRC-32C of the packed bytes (a pool object's payload checksum)."""
    return _crc(pack_chunk(pages_s, block_ids, out=out))


def unpack_chunk_crc(buf: torch.Tensor, pages_s: torch.Tensor, block_ids: IndexLike) -> int:
    """unpack_chunk; returns the CRC-32C of `buf`'s bytes. A caller that finds it wrong must not use the
    blocks written (they hold the bad bytes): a restore releases them unregistered."""
    unpack_chunk(buf, pages_s, block_ids)
    return _crc(buf)


def validate_gather(stage_pages: list[torch.Tensor], block_table: IndexLike, num_tokens: int, cp: int,
                    layout: KVLayout, outs: list[torch.Tensor] | None, first: int = 0
                    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """gather_for_ranks' checks (every backend's): (used table entries, one [T_r, L, 2, H, D] view per
    rank to write, what to return: `outs` as given, else new buffers). Raises ValueError first."""
    if cp < 1:
        raise ValueError(f"gather_for_ranks: cp must be >= 1, got {cp}")
    if len(stage_pages) != layout.stages:
        raise ValueError(f"gather_for_ranks: {len(stage_pages)} stage pages for {layout.stages} stages")
    p0 = stage_pages[0]
    for s, p in enumerate(stage_pages):
        if tuple(p.shape) != layout.page_shape(s, p0.shape[0]):
            raise ValueError(f"gather_for_ranks: stage {s} pages {tuple(p.shape)} != "
                             f"{layout.page_shape(s, p0.shape[0])}")
        if p.dtype != layout.dtype or p.device != p0.device:
            raise ValueError(f"gather_for_ranks: stage {s} pages are {p.dtype} on {p.device}, "
                             f"expected {layout.dtype} on {p0.device}")
    if not 0 <= first <= max(num_tokens, 0):
        raise ValueError(f"gather_for_ranks: first token {first} outside [0, {num_tokens}]")
    if outs is not None and len(outs) != cp:
        raise ValueError(f"gather_for_ranks: {len(outs)} output buffers for cp={cp}")
    table = _table_prefix(block_table, num_tokens, p0, "gather_for_ranks", unique=False)
    row = (layout.num_layers, 2, layout.num_kv_heads, layout.head_dim)

    views, results = [], []
    for r in range(cp):
        shape = (rank_num_tokens(num_tokens, cp, r, first), *row)
        if outs is None:
            results.append(torch.empty(shape, dtype=layout.dtype, device=p0.device))
            views.append(results[-1])
        else:
            views.append(_as_view(outs[r], shape, p0, f"gather_for_ranks outs[{r}]"))
            results.append(outs[r])
    return table, views, results


def gather_for_ranks(
    stage_pages: list[torch.Tensor],
    block_table: IndexLike,
    num_tokens: int,
    cp: int,
    layout: KVLayout,
    outs: list[torch.Tensor] | None = None,
    first: int = 0,
) -> list[torch.Tensor]:
    """Prefill pages (every stage, tokens [first, num_tokens)) -> one [T_r, L, 2, H, D] buffer per decode
    rank r < cp.

    Rank r gets its tokens (t % cp == r) in order; the layer axis runs over stage 0's layers, then stage
    1's... Given `outs` (one per rank, exact numel, may be flat) are filled and returned as is. `first`
    > 0 gathers a slice of the sequence (a handoff window that starts mid-block): the table still
    starts at token 0.
    """
    table, views, results = validate_gather(stage_pages, block_table, num_tokens, cp, layout, outs, first)
    B, device = layout.block_size, stage_pages[0].device
    for r, view in enumerate(views):
        if view.shape[0] == 0:  # no token of this rank in range (arange would reject the empty range)
            continue
        t = torch.arange(first + (r - first) % cp, num_tokens, cp, device=device)
        blk, off = table[t // B], t % B
        for s, pages_s in enumerate(stage_pages):
            span = layout.stage_layers(s)
            # Advanced indices split by slices move to the front: -> [T_r, Ls, 2, H, D].
            view[:, span.start:span.stop] = pages_s[blk, :, :, off]
    return results


def scatter_from_rank(buf: torch.Tensor, pages: torch.Tensor, block_table: IndexLike,
                      num_tokens_rank: int, first: int = 0) -> None:
    """A landed rank buffer [T_r, L, 2, H, D] (or flat) -> the rank's single-stage pages holding all L layers.

    The buffer holds local tokens [first, first + T_r); local token i goes to block block_table[i // B]
    slot i % B (the table starts at local token 0); other slots are left untouched.
    """
    _check_pages(pages, "scatter_from_rank")
    _, L, _, B, H, D = pages.shape
    if first < 0:
        raise ValueError(f"scatter_from_rank: first token must be >= 0, got {first}")
    src = _as_view(buf, (num_tokens_rank, L, 2, H, D), pages, "scatter_from_rank buf")
    table = _table_prefix(block_table, first + num_tokens_rank, pages, "scatter_from_rank", unique=True)
    i = torch.arange(first, first + num_tokens_rank, device=pages.device)
    pages[table[i // B], :, :, i % B] = src
