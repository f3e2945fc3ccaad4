"""Turns a scheduled batch into model inputs (ids, positions, slot mapping, block tables) and runs it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.engine.attention import AttentionBatch, PrefillSegment
from shared.engine.decode_graphs import DecodeGraphs
from shared.engine.model import LlamaModel
from shared.engine.scheduler import ScheduledBatch


@dataclass
class StepInputs:
    """One batch's new tokens, flattened: what every pipeline rank needs to run its layers on them."""
    ids: list[int]
    positions: list[int]
    blocks: list[int]       # block id where each new token's K/V goes
    offsets: list[int]      # its offset within that block
    segments: list[tuple[int, int, int, list[int]]] | None  # prefill: (q_start, q_len, ctx_len, block table)
    tables: list[list[int]] | None = None  # decode: block tables (unpadded)
    lens: list[int] | None = None          # decode: context lengths
    sample_rows: list[int] | None = None   # rows whose hidden states sample (each the last of its segment)

    @property
    def is_prefill(self) -> bool:
        return self.segments is not None


class ModelRunner:
    def __init__(self, model: LlamaModel, pages: list[torch.Tensor], block_size: int,
                 graphs: DecodeGraphs | None = None):
        self.model, self.pages, self.block_size, self.graphs = model, pages, block_size, graphs
        self.device = model.device

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def inputs(self, batch: ScheduledBatch) -> tuple[StepInputs, list[int]]:
        """The batch's inputs, and the indices into batch.seqs that now have every token computed and so
        sample next (in the order of inputs.sample_rows)."""
        B = self.block_size
        inp = StepInputs([], [], [], [], [] if batch.is_prefill else None, sample_rows=[])
        samplers = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.num_computed
            span = range(start, start + n)
            inp.ids.extend(seq.token_ids[start:start + n])
            inp.positions.extend(span)
            inp.blocks.extend(seq.block_table[p // B] for p in span)
            inp.offsets.extend(p % B for p in span)
            if batch.is_prefill:
                inp.segments.append((len(inp.ids) - n, n, start + n, seq.block_table[:-(-(start + n) // B)]))
            if start + n == len(seq.token_ids):
                inp.sample_rows.append(len(inp.ids) - 1)
                samplers.append(i)
        if not batch.is_prefill:
            inp.lens = [seq.num_computed + 1 for seq in batch.seqs]
            width = max(-(-n // B) for n in inp.lens)
            inp.tables = [seq.block_table[:width] for seq in batch.seqs]
        return inp, samplers

    def attention(self, inp: StepInputs) -> AttentionBatch:
        attn = AttentionBatch(self._tensor(inp.blocks), self._tensor(inp.offsets))
        if inp.is_prefill:
            attn.prefill = [PrefillSegment(q0, n, ctx, self._tensor(t)) for q0, n, ctx, t in inp.segments]
        else:
            width = max(len(t) for t in inp.tables)
            attn.decode_block_tables = self._tensor([t + [0] * (width - len(t)) for t in inp.tables]).view(-1, width)
            attn.decode_ctx_lens = self._tensor(inp.lens)
        return attn

    def run(self, batch: ScheduledBatch) -> tuple[list[int], torch.Tensor | None]:
        """Computes the batch's new tokens. Returns (indices into batch.seqs that now have every
        token computed and so sample next, their logits [n, V])."""
        inp, samplers = self.inputs(batch)
        if not inp.is_prefill and self.graphs is not None and len(samplers) == len(batch.seqs):
            logits = self.graphs.run(inp.ids, inp.positions, inp.blocks, inp.offsets, inp.tables, inp.lens)
            if logits is not None:
                return samplers, logits
        hidden = self.hidden(inp)
        if not samplers:
            return [], None
        return samplers, self.model.logits(hidden)

    def hidden(self, inp: StepInputs) -> torch.Tensor:
        """The final hidden states of the rows that sample; writes every new token's KV."""
        # a prefill's last layer runs only the rows that sample; every decode row samples
        hidden = self.model.forward(self._tensor(inp.ids), self._tensor(inp.positions), self.attention(inp),
                                    self.pages, inp.sample_rows if inp.is_prefill else None)
        return hidden if inp.is_prefill else hidden[self._tensor(inp.sample_rows)]
