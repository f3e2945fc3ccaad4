"""Pipeline-parallel prefill as ranks (`prefill.pp = P`): one process per stage, activations passed on.

Rank s runs the contiguous layer span `KVLayout.stage_layers(s)` and writes that stage's KV into its own
page tensor. Rank 0 is the engine's own process (scheduler, block manager, sampling, the service around it)
and runs stage 0; ranks 1..P-1 are worker processes it starts (`StageGroup`), joined by a torch.distributed
gloo group. A step goes down the pipe as micro-batches: rank 0 embeds and computes micro-batch k, sends it
to rank 1 and goes on with k + 1 while rank 1 computes k, and so on; the last rank sends each micro-batch's
sampling rows (before the final norm) back to rank 0, which normalises them and takes the logits as the
one-process engine does. A prompt's rows may be split between micro-batches: a stage computes them in order,
so a later micro-batch's attention finds the earlier one's KV already written at that stage (what chunked
prefill relies on too). Each micro-batch carries every rank's compute time back: `PipelineStats` tells the
bubble (the share of the step's wall time a rank sat idle).

Pages: every stage's page tensor lives in shared memory (lazily zeroed), written by its rank alone. On a
CPU host rank 0 maps them all, so the service's KV paths (handoff, pool save and restore, which read and
write stage pages by block) run in rank 0 as with one process. A rank's own transfer-engine and pool
endpoints (a GPU's pages, which another process cannot map) are the next step; until then a device other
than the CPU is refused with pp > 1.

A rank that dies ends the group (shared/engine/ranks.py): the step in flight fails with `RanksLost` (its
requests end with that error), and `lost` says why; the prefill service then exits non-zero so its
supervisor restarts the instance, ranks included, as a unit.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import msgspec
import torch

from shared.engine.model import LlamaModel
from shared.engine.model_config import ModelConfig
from shared.engine.ranks import STEP, STOP, RankGroup, header, shared_storage, wait_all
from shared.engine.runner import ModelRunner, StepInputs
from shared.kv_layout import KVLayout
from shared.logging import get_logger

log = get_logger("engine.pipeline")

MIN_MICROBATCH_ROWS = 32   # a prefill step is cut into P micro-batches only when each gets this many rows
_TAG_DOWN, _TAG_BACK = 1, 2


class Plan(msgspec.Struct, array_like=True):
    """One micro-batch's attention inputs, as every rank needs them (the hidden states travel beside)."""
    positions: list[int]
    blocks: list[int]
    offsets: list[int]
    segments: list[tuple[int, int, int, list[int]]] | None
    tables: list[list[int]] | None
    lens: list[int] | None
    out_rows: list[int] | None  # prefill: the rows that sample (the last rank returns only those)
    busy_ms: list[float] = []   # each rank's compute time for this micro-batch, ranks 1.. (appended on the way)

    @property
    def returned_rows(self) -> int:
        return len(self.positions) if self.out_rows is None else len(self.out_rows)


def cut_microbatches(inp: StepInputs, parts: int) -> list[tuple[range, Plan]]:
    """The step's rows in `parts` consecutive spans (prefill; a decode step stays whole), each with its own
    plan: a segment cut by a span edge keeps the rows inside it, and its context ends at its last row there.
    Sampling rows are each the last of their segment, so they stay the last of theirs."""
    T = len(inp.positions)
    if not inp.is_prefill:
        return [(range(T), Plan(inp.positions, inp.blocks, inp.offsets, None, inp.tables, inp.lens, None))]
    parts = max(1, min(parts, T // MIN_MICROBATCH_ROWS))
    size = math.ceil(T / parts)
    out = []
    for a in range(0, T, size):
        b = min(T, a + size)
        segments = []
        for q0, n, ctx, table in inp.segments:
            lo, hi = max(q0, a), min(q0 + n, b)
            if lo < hi:
                segments.append((lo - a, hi - lo, ctx - (q0 + n - hi), table))
        rows = [r - a for r in inp.sample_rows if a <= r < b]
        out.append((range(a, b), Plan(inp.positions[a:b], inp.blocks[a:b], inp.offsets[a:b], segments, None, None,
                                      rows)))
    return out


def shared_pages(layout: KVLayout, num_blocks: int) -> list[torch.Tensor]:
    """allocate_pages in shared memory: one tensor per stage, which its rank maps."""
    return [shared_storage(layout.page_shape(s, num_blocks), layout.dtype) for s in range(layout.stages)]


@dataclass
class PipelineStats:
    steps: int = 0
    microbatches: int = 0
    wall_ms: float = 0.0                                 # the forward passes' wall time, all steps
    busy_ms: list[float] = field(default_factory=list)   # each rank's compute time, all steps

    @property
    def bubble(self) -> float:
        """The share of the wall time the average rank sat idle (0: every rank busy the whole step)."""
        if not self.wall_ms or not self.busy_ms:
            return 0.0
        return max(0.0, 1.0 - sum(self.busy_ms) / (len(self.busy_ms) * self.wall_ms))

    def as_dict(self) -> dict:
        return {"steps": self.steps, "microbatches": self.microbatches, "wall_ms": round(self.wall_ms, 1),
                "busy_ms": [round(b, 1) for b in self.busy_ms], "bubble": round(self.bubble, 3)}


def _send_plan(pg, dst: int, plan_raw: bytes, x: torch.Tensor) -> list:
    """Header, plan and hidden states to `dst`: three sends, waited for by the caller before `x` is reused."""
    head = header(STEP, len(plan_raw), x.shape[0])
    raw = torch.frombuffer(bytearray(plan_raw), dtype=torch.uint8)
    return [pg.send([head], dst, _TAG_DOWN), pg.send([raw], dst, _TAG_DOWN), pg.send([x.contiguous()], dst, _TAG_DOWN),
            (head, raw, x)]


class StageGroup(RankGroup):
    """Rank 0's handle on ranks 1..P-1: starts them, passes micro-batches, watches them, stops them."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], layout: KVLayout,
                 pages: list[torch.Tensor], device: str, dtype: torch.dtype, threads: int = 0):
        self.layout = layout
        self.hidden_size, self.dtype = config.hidden_size, dtype
        self.stats = PipelineStats(busy_ms=[0.0] * layout.stages)

        def args_of(r: int) -> tuple:
            span = layout.stage_layers(r)
            mine = {k: v for k, v in weights.items() if _layer_of(k) in span}
            return config, mine, layout, pages[r], device, dtype

        super().__init__("pipeline", layout.stages, _rank_main, args_of, threads)
        log.info("pipeline ranks up", ranks=self.world, pids=self.pids, threads=self.threads,
                 layers=[[s.start, s.stop] for s in map(layout.stage_layers, range(self.world))])

    def ranks(self) -> list[dict]:
        """Each rank: its process, layer span and whether it runs (`moorage status`)."""
        spans = map(self.layout.stage_layers, range(self.world))
        return [{"rank": r, "pid": pid, "layers": [span.start, span.stop - 1], "alive": alive}
                for r, (pid, alive, span) in enumerate(zip(self.pids, self.alive(), spans))]

    def forward(self, model: LlamaModel, runner: ModelRunner, inp: StepInputs) -> torch.Tensor:
        """The step's final hidden states of its sampling rows (every row for a decode step)."""
        self.check()
        t0 = time.perf_counter()
        parts = cut_microbatches(inp, self.world)
        backs, sent = [], []
        try:
            for rows, plan in parts:  # results are received into buffers posted before the work is sent
                out = torch.empty(plan.returned_rows, self.hidden_size, dtype=self.dtype)
                busy = torch.empty(self.world - 1, dtype=torch.float64)
                backs.append((out, busy, self.pg.recv([busy], self.world - 1, _TAG_BACK),
                              self.pg.recv([out], self.world - 1, _TAG_BACK) if plan.returned_rows else None))
            own = 0.0
            for rows, plan in parts:
                c0 = time.perf_counter()
                sub = StepInputs(inp.ids[rows.start:rows.stop], plan.positions, plan.blocks, plan.offsets,
                                 plan.segments, plan.tables, plan.lens)
                x = model.run_layers(model.embed_tokens(runner._tensor(sub.ids)), runner._tensor(sub.positions),
                                     runner.attention(sub), runner.pages)
                own += (time.perf_counter() - c0) * 1e3
                wait_all(sent)  # the previous micro-batch is on its way before this one's buffers go out
                sent = _send_plan(self.pg, 1, msgspec.msgpack.encode(plan), x)
            results = []
            for out, busy, w_busy, w_out in backs:
                w_busy.wait()
                if w_out is not None:
                    w_out.wait()
                for r in range(1, self.world):
                    self.stats.busy_ms[r] += float(busy[r - 1])
                results.append(out)
            wait_all(sent)
        except Exception as e:  # a peer gone: the watcher names which
            raise self.failed(e) from e
        self.stats.busy_ms[0] += own
        self.stats.steps += 1
        self.stats.microbatches += len(parts)
        self.stats.wall_ms += (time.perf_counter() - t0) * 1e3
        return torch.cat(results) if len(results) > 1 else results[0]

    def close(self) -> None:
        """Stops every rank (a STOP passed down the pipe, then a kill for any that lingers)."""
        super().close(lambda: self.pg.send([header(STOP, 0, 0)], 1, _TAG_DOWN).wait())


def _layer_of(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("layers.") else -1


class PipelineRunner(ModelRunner):
    """ModelRunner whose forward pass runs stage 0 here and the other stages on their ranks."""

    def __init__(self, model: LlamaModel, pages: list[torch.Tensor], block_size: int, group: StageGroup):
        super().__init__(model, pages, block_size)
        self.group = group

    def hidden(self, inp: StepInputs) -> torch.Tensor:
        return self.model.final_norm(self.group.forward(self.model, self, inp))


# ---- ranks 1..P-1 ---------------------------------------------------------------------------------------

def _rank_main(pg, rank: int, world: int, config: ModelConfig, weights: dict[str, torch.Tensor], layout: KVLayout,
               page: torch.Tensor, device: str, dtype: torch.dtype) -> None:
    model = LlamaModel(config, _full_names(config, weights), layout, device, dtype, layers=layout.stage_layers(rank))
    pages: list = [None] * world
    pages[rank] = page
    runner = ModelRunner(model, pages, layout.block_size)
    last = rank == world - 1
    sent: list = []
    while True:
        head = torch.empty(3, dtype=torch.int64)
        pg.recv([head], rank - 1, _TAG_DOWN).wait()
        op, nbytes, rows = (int(v) for v in head)
        if op == STOP:
            wait_all(sent)
            if not last:
                pg.send([head], rank + 1, _TAG_DOWN).wait()
            return
        raw = torch.empty(nbytes, dtype=torch.uint8)
        pg.recv([raw], rank - 1, _TAG_DOWN).wait()
        x = torch.empty(rows, config.hidden_size, dtype=model.dtype)
        pg.recv([x], rank - 1, _TAG_DOWN).wait()
        plan = msgspec.msgpack.decode(raw.numpy().tobytes(), type=Plan)
        c0 = time.perf_counter()
        sub = StepInputs([], plan.positions, plan.blocks, plan.offsets, plan.segments, plan.tables, plan.lens)
        x = model.run_layers(x, runner._tensor(plan.positions), runner.attention(sub), pages,
                             plan.out_rows if last else None)
        plan.busy_ms.append((time.perf_counter() - c0) * 1e3)
        wait_all(sent)
        if last:
            busy = torch.tensor(plan.busy_ms, dtype=torch.float64)
            sent = [pg.send([busy], 0, _TAG_BACK)] + ([pg.send([x.contiguous()], 0, _TAG_BACK)] if len(x) else []) \
                + [(busy, x)]
        else:
            sent = _send_plan(pg, rank + 1, msgspec.msgpack.encode(plan), x)


def _full_names(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A rank's weights as LlamaModel reads them: its layers, plus the embedding table (unused but expected:
    the embedding of a rank past stage 0 is a 1-row stand-in, never read) and the final norm."""
    out = dict(weights)
    out.setdefault("embed_tokens", torch.zeros(1, config.hidden_size))
    out.setdefault("norm", torch.ones(config.hidden_size))
    if not config.tie_embeddings:
        out.setdefault("lm_head", torch.zeros(1, config.hidden_size))
    return out
