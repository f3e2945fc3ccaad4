"""Turns a scheduled batch into model inputs (ids, positions, slot mapping, block tables) and runs it."""

from __future__ import annotations

import torch

from shared.engine.attention import AttentionBatch, PrefillSegment
from shared.engine.decode_graphs import DecodeGraphs
from shared.engine.model import LlamaModel
from shared.engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: LlamaModel, pages: list[torch.Tensor], block_size: int,
                 graphs: DecodeGraphs | None = None):
        self.model, self.pages, self.block_size, self.graphs = model, pages, block_size, graphs
        self.device = model.device

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def run(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor | None]:
        """Computes the batch's new tokens. Returns (indices into batch.seqs that now have every
        token computed and so sample next, their logits [n, V])."""
        B = self.block_size
        ids, positions, blocks, offsets, segments, sample_rows, samplers = [], [], [], [], [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.num_computed
            span = range(start, start + n)
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(span)
            blocks.extend(seq.block_table[p // B] for p in span)
            offsets.extend(p % B for p in span)
            if batch.is_prefill:
                nb = -(-(start + n) // B)
                segments.append(PrefillSegment(len(ids) - n, n, start + n, self._tensor(seq.block_table[:nb])))
            if start + n == len(seq.token_ids):
                sample_rows.append(len(ids) - 1)
                samplers.append(i)
        attn = AttentionBatch(self._tensor(blocks), self._tensor(offsets))
        if batch.is_prefill:
            attn.prefill = segments
        else:
            lens = [seq.num_computed + 1 for seq in batch.seqs]
            width = max(-(-n // B) for n in lens)
            tables = [seq.block_table[:width] for seq in batch.seqs]
            if self.graphs is not None and len(samplers) == len(batch.seqs):
                logits = self.graphs.run(ids, positions, blocks, offsets, tables, lens)
                if logits is not None:
                    return samplers, logits
            tables = [t + [0] * (width - len(t)) for t in tables]
            attn.decode_block_tables = torch.tensor(tables, dtype=torch.long, device=self.device)
            attn.decode_ctx_lens = self._tensor(lens)
        # a prefill's last layer runs only the rows that sample; every decode row samples
        hidden = self.model.forward(self._tensor(ids), self._tensor(positions), attn, self.pages,
                                    sample_rows if batch.is_prefill else None)
        if not batch.is_prefill:
            hidden = hidden[self._tensor(sample_rows)]
        if not samplers:
            return [], None
        return samplers, self.model.logits(hidden)
