"""The direct handoff's plan: which byte ranges of prefill's pages go where in decode's pages.

Pages are block-major (shared/kv_layout.py), so one block of one stage is one contiguous span, and a
run of consecutive blocks of a single-stage page is one span too. Decode grants the request's blocks
as runs of consecutive addresses; prefill writes

- single stage: one write per run of blocks consecutive on both sides (often the whole request), cut
  every `max_bytes` (whole blocks): each write has its own checksum, so decode verifies the pieces of a
  long run in parallel threads (services/decode/direct.py). All writes still go in one batched call;
- stages > 1: one write per block and stage (a stage's bytes of a block sit at the stage's offset of
  decode's block, `KVLayout.stage_offset_in_block`; the other stages' bytes lie between two blocks).

Every write is [first, count, offset, nbytes]: bytes [offset, offset + nbytes) counted from the start
of granted block `first`, inside blocks first..first+count-1. `tiling_error` is decode's check that the
writes of a HandoffDone cover its blocks exactly once before it verifies their checksums.
Whole blocks travel, the unused tail of the last one included: its bytes are never read as KV.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.kv_layout import KVLayout


@dataclass(frozen=True)
class PageWrite:
    stage: int
    src_block: int  # prefill's first block (the run's blocks are consecutive in its stage page)
    first: int      # index of decode's first block in the request's granted blocks
    count: int      # blocks spanned
    offset: int     # bytes from the start of decode's block `first`
    nbytes: int

    def wire(self, crc: int) -> list[int]:
        return [self.first, self.count, self.offset, self.nbytes, crc]


def expand_runs(runs: list, n_blocks: int, block_bytes: int) -> list[int]:
    """PagesGrant.runs ([[addr, count], ...]) -> one address per block; ValueError unless they are n_blocks."""
    addrs = []
    for run in runs:
        if not isinstance(run, (list, tuple)) or len(run) != 2 or not all(type(v) is int and v >= 0 for v in run) \
                or run[1] == 0:
            raise ValueError(f"bad run {run!r}: expected [addr, count] of non-negative ints, count > 0")
        addrs += [run[0] + i * block_bytes for i in range(run[1])]
    if len(addrs) != n_blocks:
        raise ValueError(f"granted {len(addrs)} blocks for {n_blocks}")
    return addrs


def to_runs(ids: list[int]) -> list[tuple[int, int]]:
    """Block ids -> [(first id, count)] of consecutive ids, in order."""
    runs: list[list[int]] = []
    for b in ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return [(b, n) for b, n in runs]


CHECK_BYTES = 4 << 20  # prefill cuts a run of blocks into writes of at most this (at least one block)


def plan(src_blocks: list[int], dst_addrs: list[int], layout: KVLayout, max_bytes: int = 0) -> list[PageWrite]:
    """The writes moving prefill's blocks `src_blocks` into decode's blocks at `dst_addrs` (same order);
    `max_bytes` > 0: no write spans more blocks than fit in it (one at least)."""
    if len(src_blocks) != len(dst_addrs):
        raise ValueError(f"{len(src_blocks)} blocks for {len(dst_addrs)} addresses")
    bb = layout.block_bytes
    if layout.stages > 1:
        return [PageWrite(s, b, i, 1, layout.stage_offset_in_block(s), layout.stage_block_bytes(s))
                for i, b in enumerate(src_blocks) for s in range(layout.stages)]
    most = max(1, max_bytes // bb) if max_bytes > 0 else len(src_blocks)
    out: list[PageWrite] = []
    start = 0
    for i in range(1, len(src_blocks) + 1):
        if i == len(src_blocks) or src_blocks[i] != src_blocks[i - 1] + 1 or dst_addrs[i] != dst_addrs[i - 1] + bb \
                or i - start == most:
            n = i - start
            out.append(PageWrite(0, src_blocks[start], start, n, 0, n * bb))
            start = i
    return out


def tiling_error(writes: list, n_blocks: int, block_bytes: int, first_block: int = 0) -> str | None:
    """None when HandoffDone.pages ([[first, count, offset, nbytes, crc], ...]) cover bytes
    [first_block * block_bytes, n_blocks * block_bytes) of the granted blocks exactly once, each inside its
    own blocks; else why not. Blocks before `first_block` are decode's already (decode reuse): none is written."""
    spans = []
    for w in writes:
        if not isinstance(w, (list, tuple)) or len(w) != 5 or not all(type(v) is int and v >= 0 for v in w):
            return f"bad write {w!r}: expected [first, count, offset, nbytes, crc] of non-negative ints"
        first, count, offset, nbytes, crc = w
        if count == 0 or nbytes == 0 or first + count > n_blocks or offset + nbytes > count * block_bytes \
                or crc >= 1 << 32:
            return f"bad write {w!r} for {n_blocks} blocks of {block_bytes} bytes"
        spans.append((first * block_bytes + offset, nbytes))
    spans.sort()
    end = first_block * block_bytes
    for lo, n in spans:
        if lo != end:
            return f"writes {'overlap' if lo < end else 'leave a gap'} at byte {min(lo, end)} of the blocks"
        end = lo + n
    if end != n_blocks * block_bytes:
        return f"writes cover {end} of {n_blocks * block_bytes} bytes"
    return None
