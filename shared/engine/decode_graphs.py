"""Decode steps replayed from CUDA graphs (`engine.cuda_graphs`).

A decode step computes one token per sequence through a few hundred small kernels; on a GPU at small batches
their launches, not the math, set the step's time. With the switch on, a decode step is padded to a bucket
(batch: 1, 2, 4, 8, then multiples of 8 up to `engine.max_num_seqs`; block-table width: a power of two up to
the model's context), its inputs are copied into that bucket's static tensors, and the graph recorded for the
bucket (the forward pass and the logits) is replayed as one launch.

- Padded rows compute a one-token context on a scratch block that no sequence owns (the engine allocates one
  page past the block manager's), so they write nothing any sequence reads; their rows are dropped. Table
  columns past a sequence's blocks are never read (each row attends to its own context length).
- Every bucket is recorded when the engine starts (`engine.cuda_graphs_ahead`, as vLLM captures its graphs):
  largest first, so the smaller ones reuse the memory pool's blocks, each after one eager step on all-padding
  rows (which also compiles any Triton kernel it launches), so no decode step in service pays a recording or
  a compile. The graphs do not depend on the rows' values: the kernels' launch grids follow the table's width,
  never its contents. With the switch off, a bucket is recorded the first time a step needs it, after that
  step ran eagerly on its static tensors. Recording runs nothing. All buckets share one memory pool, and the
  buckets of one batch size one logits buffer outside it, which each graph's last kernel copies into (not a
  buffer per width: at Gemma 3's 262K vocabulary those would hold ~1 GB across the buckets). The logits stay
  valid until the next replay of that batch size.
- A batch past the largest bucket, or a table wider than the model's context, runs eagerly as before. A
  failed recording turns graphs off for the engine, with the reason logged, and the step still completes.

On CPU nothing is recorded: the same padded static batches run eagerly, which `make test` checks against
the switch off (tests/test_decode_graphs.py); tests/gpu checks the replay on a device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shared.engine.attention import AttentionBatch
from shared.engine.model import LlamaModel
from shared.logging import get_logger

log = get_logger("engine")


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8, up to the first that holds max_batch."""
    sizes, b = [], 1
    while True:
        sizes.append(b)
        if b >= max_batch:
            return sizes
        b = b * 2 if b < 8 else b + 8


def width_bucket(width: int) -> int:
    return 1 << max(0, width - 1).bit_length()


@dataclass
class _Bucket:
    inputs: torch.Tensor   # [5, batch] int64: ids, positions, slot blocks, slot offsets, context lengths
    tables: torch.Tensor   # [batch, width] int64
    graph: object | None = None            # torch.cuda.CUDAGraph once recorded
    logits: torch.Tensor | None = None     # the graph's output: its batch size's logits buffer


@dataclass
class GraphStats:
    recorded: int = 0    # buckets recorded
    replays: int = 0     # steps served by a replay
    padded: int = 0      # steps run eagerly on a bucket's static tensors (CPU, or the step before recording)
    eager: int = 0       # steps no bucket fits


class DecodeGraphs:
    def __init__(self, model: LlamaModel, pages: list[torch.Tensor], block_size: int, scratch_block: int,
                 max_batch: int, max_context: int):
        if any(p.shape[0] <= scratch_block for p in pages):
            raise ValueError(f"scratch block {scratch_block} is not in the pages ({pages[0].shape[0]} blocks)")
        self.model, self.pages, self.block_size, self.scratch = model, pages, block_size, scratch_block
        self.device = model.device
        self.sizes = batch_buckets(max_batch)
        self.max_width = width_bucket(-(-max_context // block_size))
        self.record = self.device.type == "cuda"
        if not self.record:
            log.warning("engine.cuda_graphs on a device without CUDA graphs: decode steps run padded batches "
                        "eagerly, for nothing but tests", device=str(self.device))
        self.pool = torch.cuda.graph_pool_handle() if self.record else None
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.logits: dict[int, torch.Tensor] = {}  # batch size -> the logits buffer its graphs write
        self.stats = GraphStats()

    def all_buckets(self) -> list[tuple[int, int]]:
        """Every (batch, width) bucket, largest first."""
        widths = [1 << i for i in range(self.max_width.bit_length())]
        return [(b, w) for b in reversed(self.sizes) for w in reversed(widths)]

    def record_all(self) -> None:
        """Record every bucket not yet recorded (engine.cuda_graphs_ahead): each runs one eager step on rows
        that are all padding (they write only the scratch block), then its graph is recorded. Nothing on a
        device without CUDA graphs; a failed recording stops here (graphs are then off, as in run())."""
        if not self.record:
            return
        t0 = time.perf_counter()
        for key in self.all_buckets():
            b = self.buckets.get(key) or self._new_bucket(*key)
            if b.graph is not None:
                continue
            self._fill(b, [], [], [], [], [], [])
            self._record(b, key, self._forward(b))
            if not self.record:
                return
        torch.cuda.synchronize(self.device)
        log.info("cuda graphs recorded ahead", buckets=self.stats.recorded, batches=self.sizes,
                 max_width=self.max_width, seconds=round(time.perf_counter() - t0, 2))

    def bucket_for(self, batch: int, width: int) -> tuple[int, int] | None:
        """(padded batch, padded width), or None when the step runs eagerly."""
        size = next((b for b in self.sizes if b >= batch), None)
        if size is None or batch == 0 or width > self.max_width:
            return None
        return size, min(width_bucket(width), self.max_width)

    def run(self, ids: list[int], positions: list[int], slot_blocks: list[int], slot_offsets: list[int],
            tables: list[list[int]], ctx_lens: list[int]) -> torch.Tensor | None:
        """The logits [len(ids), vocab] of one decode step (one token per sequence), or None when no bucket
        fits (the caller runs it eagerly)."""
        n = len(ids)
        key = self.bucket_for(n, max(len(t) for t in tables) if tables else 0)
        if key is None:
            self.stats.eager += 1
            return None
        b = self.buckets.get(key) or self._new_bucket(*key)
        self._fill(b, ids, positions, slot_blocks, slot_offsets, tables, ctx_lens)
        if b.graph is not None:
            b.graph.replay()
            self.stats.replays += 1
            return b.logits[:n]
        self.stats.padded += 1
        out = self._forward(b)
        if self.record:
            self._record(b, key, out)
        return out[:n]

    def _new_bucket(self, size: int, width: int) -> _Bucket:
        b = _Bucket(torch.zeros((5, size), dtype=torch.long, device=self.device),
                    torch.zeros((size, width), dtype=torch.long, device=self.device))
        self.buckets[(size, width)] = b
        return b

    def _fill(self, b: _Bucket, ids, positions, slot_blocks, slot_offsets, tables, ctx_lens) -> None:
        """Every row and column written each step: a padded row computes token 0 at position 0 on the
        scratch block, with a context of that one token."""
        size, width = b.tables.shape
        pad = size - len(ids)
        s = self.scratch
        inputs = torch.tensor([ids + [0] * pad, positions + [0] * pad, slot_blocks + [s] * pad,
                               slot_offsets + [0] * pad, ctx_lens + [1] * pad], dtype=torch.long)
        rows = [t + [0] * (width - len(t)) for t in tables] + [[s] * width] * pad
        b.inputs.copy_(inputs)
        b.tables.copy_(torch.tensor(rows, dtype=torch.long))

    def _forward(self, b: _Bucket) -> torch.Tensor:
        ids, positions, slot_blocks, slot_offsets, ctx_lens = b.inputs
        attn = AttentionBatch(slot_blocks, slot_offsets, decode_block_tables=b.tables, decode_ctx_lens=ctx_lens)
        return self.model.logits(self.model.forward(ids, positions, attn, self.pages))

    def _record(self, b: _Bucket, key: tuple[int, int], eager: torch.Tensor) -> None:
        """Record the bucket's step; `eager` is that step's output, run just before (its shape and dtype are
        the logits buffer's)."""
        logits = self.logits.get(key[0])
        if logits is None:
            logits = self.logits[key[0]] = torch.empty_like(eager)  # outside the graphs' pool
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the services' copy threads may use the device meanwhile, on streams of their own
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                logits.copy_(self._forward(b))
        except Exception as e:  # noqa: BLE001 - never fail a step for a graph: run eagerly from now on
            self.record = False
            log.error("cuda graph recording failed; decode runs eagerly", bucket=list(key), error=repr(e))
            return
        b.graph, b.logits = graph, logits
        self.stats.recorded += 1
        log.debug("cuda graph recorded", batch=key[0], width=key[1], buckets=self.stats.recorded)
