"""The CRC-32C of a handoff's writes, from a cache of each full block's CRC register.

A direct handoff sends each run of blocks with its CRC-32C (services/prefill/direct.py). An agent's
next turn hands off the same history blocks again (prefix-cached on prefill), and a full block's
bytes cannot change until the block is allocated again (BlockManager.generation). So each stage's
block keeps its raw CRC register (kernels' block_crcs, read in place) with the generation it was
read at; a write's CRC is the registers of its blocks joined (GF(2) shifts: join_crcs), reading only
the blocks that have none: the partly filled last block, and blocks new since their last handoff.
Without the C kernel (no compiler or CRC instruction) every write is checksummed whole, as before.

Thread safety: `run_crc` runs in a worker thread while the engine thread allocates other blocks. The
blocks of a handoff are held by its request, so their generation cannot change meanwhile; two
handoffs sharing a block store the same register.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import cpu_crc, cpu_kv
from shared.kv_object import checksum
from shared.page_writes import to_runs


def blocks_crc(page: torch.Tensor, ids: list[int], threads: int = 0) -> int:
    """CRC-32C of blocks `ids` of `page` (uint8 [blocks, block bytes], CPU, contiguous) in this order, read in
    place: per-block registers joined (the C kernel: folded or three lanes, `threads` threads, 0 = torch's), or
    piece by piece (crc32c) without it."""
    with cpu_kv.threads(threads or torch.get_num_threads()):
        regs = cpu_crc.block_crcs(page, ids)
    if regs is not None:
        return cpu_crc.join_crcs(regs, page.shape[1])
    crc = 0
    for b, n in to_runs(ids):
        crc = checksum(page[b:b + n].view(-1), crc)
    return crc


class BlockCRCs:
    def __init__(self, pages: list[torch.Tensor], generation: Sequence[int]):
        self.pages, self.generation = pages, generation  # generation: the block manager's, read live
        n = pages[0].shape[0]
        self._bytes = [p.view(p.shape[0], -1).view(torch.uint8) for p in pages]
        self.block_bytes = [b.shape[1] for b in self._bytes]
        self._raw = [[0] * n for _ in pages]
        self._at = [[-1] * n for _ in pages]  # generation each register was read at (-1: none)
        self.enabled = all(p.is_cpu and p.is_contiguous() for p in pages) and \
            cpu_crc.block_crcs(self._bytes[0], []) is not None
        self.reads = self.reuses = 0  # blocks read / registers reused (counters, for tests and traces)

    def run_crc(self, stage: int, first: int, count: int, full: int) -> tuple[int, int]:
        """CRC-32C of blocks first..first+count-1 of `stage`'s page (consecutive: one span), and how many
        blocks' registers were reused. The first `full` of them are completely filled: their registers
        are reused or kept."""
        if not self.enabled:
            return checksum(self._bytes[stage][first:first + count].view(-1)), 0
        raw, at, gen = self._raw[stage], self._at[stage], self.generation
        ids = range(first, first + count)
        missing = [b for k, b in enumerate(ids) if k >= full or at[b] != gen[b]]
        if missing:
            with cpu_kv.threads(1):  # beside the Transfer Engine's write
                got = cpu_crc.block_crcs(self._bytes[stage], missing)
            fresh = dict(zip(missing, got))
        else:
            fresh = {}
        regs = []
        for k, b in enumerate(ids):
            if b in fresh:
                regs.append(fresh[b])
                if k < full:
                    raw[b], at[b] = fresh[b], gen[b]
            else:
                regs.append(raw[b])
        self.reads += len(missing)
        self.reuses += count - len(missing)
        return cpu_crc.join_crcs(regs, self.block_bytes[stage]), count - len(missing)
