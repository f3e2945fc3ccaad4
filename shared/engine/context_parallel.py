"""Context-parallel decode as ranks (`decode.dcp = C`): each rank holds a 1/C share of every sequence's KV.

Rank r holds the tokens t with t % C == r, for all layers, at local position t // C (shared/kv_layout.py).
Block ids are the engine's as with one process: logical block b (tokens 16b..16b+15) is block b of every rank's
page, which holds that block's 16/C tokens of its own (page block size 16 / C), so the block manager, the prefix
cache and the hashes are unchanged, and a rank's tokens of a sequence lie in its block table's order.

Rank 0 is the engine's process and runs the whole model but attention's reads; at each layer it sends the new
rows' q, k and v to the other ranks (`DcpGroup.attend`). Every rank writes the K/V of the rows it owns into its
page, computes the attention of every query row over the keys it holds (`partial`: the output and its
log-sum-exp; a key is visible when its global position is at or before the query's, and within a sliding
window's reach), and sends both back; rank 0 merges them exactly (`merge`: each share weighted by
exp(lse_r - max lse)), as one softmax over all the keys would. The dense layers run once, on rank 0, so every
rank's K/V is rank 0's numbers: no rank drifts from another.

Tensor parallelism over heads (`decode.tp`) is not built: every query head's attention runs on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
import torch

from kernels.attention_reference import read_context
from shared.engine.ranks import STEP, STOP, RankGroup, header, shared_storage, wait_all
from shared.engine.runner import ModelRunner, StepInputs
from shared.kv_layout import KVLayout
from shared.logging import get_logger

log = get_logger("engine.dcp")

SCORE_BUDGET = 1 << 24   # floats of attention scores held at once (query rows are taken in chunks below it)


class DcpPlan(msgspec.Struct, array_like=True):
    """A step's rows as every rank needs them: global positions, logical blocks and offsets, and each query
    group (a prefill segment, or one decode row) with its context length and block table."""
    positions: list[int]
    blocks: list[int]
    offsets: list[int]
    groups: list[tuple[int, int, int, list[int]]]  # (first row, rows, context length, block table)

    @classmethod
    def of(cls, inp: StepInputs) -> "DcpPlan":
        if inp.is_prefill:
            groups = [(q0, n, ctx, table) for q0, n, ctx, table in inp.segments]
        else:
            groups = [(i, 1, n, table) for i, (n, table) in enumerate(zip(inp.lens, inp.tables))]
        return cls(inp.positions, inp.blocks, inp.offsets, groups)


def local_count(ctx_len: int, rank: int, world: int) -> int:
    """How many of a context's first ctx_len tokens rank `rank` of `world` holds."""
    return max(0, -(-(ctx_len - rank) // world))


def partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor,
            scale: float, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [T, Hq, D] over some keys k, v [S, Hkv, D] only: (out [T, Hq, D], lse [T, Hq]). Key j is
    visible to query i when kpos[j] <= qpos[i] (and kpos[j] > qpos[i] - window with a window). A row that sees
    no key gets out 0 and lse -inf (it weighs nothing in `merge`)."""
    T, hq, d = q.shape
    out = torch.zeros(T, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((T, hq), float("-inf"), dtype=torch.float32, device=q.device)
    if k.shape[0] == 0:
        return out, lse
    group = hq // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)   # [Hq, S, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    step = max(1, SCORE_BUDGET // max(1, hq * k.shape[0]))
    for a in range(0, T, step):
        b = min(T, a + step)
        s = torch.matmul(q[a:b].float().transpose(0, 1), kf.transpose(1, 2)) * scale   # [Hq, rows, S]
        visible = kpos[None, :] <= qpos[a:b, None]
        if window:
            visible &= kpos[None, :] > qpos[a:b, None] - window
        s.masked_fill_(~visible[None], float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)
        z = p.sum(-1, keepdim=True)
        o = torch.matmul(p, vf) / z.clamp_min(1e-30)
        out[a:b] = o.transpose(0, 1)
        lse[a:b] = (m + torch.log(z)).squeeze(-1).transpose(0, 1)
    return out, lse


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """The exact attention output from every rank's (out, lse): softmax over all keys = the shares weighted by
    exp(lse_r - max_r lse)."""
    outs = torch.stack([o for o, _ in parts])        # [C, T, Hq, D]
    lses = torch.stack([s for _, s in parts])        # [C, T, Hq]
    m = lses.amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m)                          # exp(-inf) = 0: a share with no visible key
    return ((w[..., None] * outs).sum(0) / w.sum(0).clamp_min(1e-30)[..., None]).to(dtype)


@dataclass
class RankShare:
    """One rank's part of one step: the rows it writes and the keys it holds for each query group."""
    rank: int
    world: int
    page: torch.Tensor   # [N, L, 2, 16 / world, Hkv, D]
    plan: DcpPlan

    def __post_init__(self) -> None:
        C, dev = self.world, self.page.device
        own = [i for i, p in enumerate(self.plan.positions) if p % C == self.rank]
        self.rows = torch.tensor(own, dtype=torch.long, device=dev)
        self.slot_blocks = torch.tensor([self.plan.blocks[i] for i in own], dtype=torch.long, device=dev)
        self.slot_offsets = torch.tensor([self.plan.offsets[i] // C for i in own], dtype=torch.long, device=dev)
        self.qpos = torch.tensor(self.plan.positions, dtype=torch.long, device=dev)
        self.keys = []  # per group: (first row, rows, local key count, table, key positions)
        for q0, n, ctx, table in self.plan.groups:
            count = local_count(ctx, self.rank, C)
            kpos = torch.arange(count, dtype=torch.long, device=dev) * C + self.rank
            self.keys.append((q0, n, count, torch.tensor(table, dtype=torch.long, device=dev), kpos))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int) -> torch.Tensor:
        """Writes this rank's rows' K/V into its page at `layer`, then returns [T, Hq, D + 1]: each query row's
        output over this rank's keys and (last column, per head) its log-sum-exp."""
        if len(self.rows):
            self.page[self.slot_blocks, layer, 0, self.slot_offsets] = k[self.rows].to(self.page.dtype)
            self.page[self.slot_blocks, layer, 1, self.slot_offsets] = v[self.rows].to(self.page.dtype)
        T, hq, d = q.shape
        packed = torch.empty(T, hq, d + 1, dtype=torch.float32, device=q.device)
        for q0, n, count, table, kpos in self.keys:
            ks = read_context(self.page, layer, 0, table)[:count]
            vs = read_context(self.page, layer, 1, table)[:count]
            out, lse = partial(q[q0:q0 + n], ks, vs, self.qpos[q0:q0 + n], kpos, scale, window)
            packed[q0:q0 + n, :, :d] = out
            packed[q0:q0 + n, :, d] = lse
        return packed


def rank_pages(layout: KVLayout, world: int, num_blocks: int) -> list[torch.Tensor]:
    """Each rank's page in shared memory: [N, L, 2, block_size / world, Hkv, D], zero until written."""
    if layout.stages != 1:
        raise ValueError("context parallelism holds every layer on every rank (stages = 1)")
    shape = (num_blocks, layout.num_layers, 2, layout.block_size // world, layout.num_kv_heads, layout.head_dim)
    return [shared_storage(shape, layout.dtype) for _ in range(world)]


class DcpGroup(RankGroup):
    """Rank 0's side: starts ranks 1..C-1 and, each layer, hands them the new rows and merges their shares."""

    def __init__(self, layout: KVLayout, world: int, pages: list[torch.Tensor], num_heads: int, scale: float,
                 windows: list[int], threads: int = 0):
        self.layout, self.pages, self.num_heads = layout, pages, num_heads
        self.share: RankShare | None = None
        self.sent: list = []
        self.exchange_ms = 0.0  # time rank 0 waited for the other ranks' shares, all steps
        self.steps = 0
        super().__init__("dcp", world, _rank_main,
                         lambda r: (num_heads, layout.num_kv_heads, layout.head_dim, scale, windows, pages[r]),
                         threads)
        log.info("context-parallel ranks up", ranks=world, pids=self.pids, threads=self.threads)

    def ranks(self) -> list[dict]:
        """Each rank: its process, the tokens it holds and whether it runs (`moorage status`)."""
        return [{"rank": r, "pid": pid, "tokens": f"t % {self.world} == {r}", "alive": alive}
                for r, (pid, alive) in enumerate(zip(self.pids, self.alive()))]

    def begin(self, inp: StepInputs) -> None:
        self.check()
        plan = DcpPlan.of(inp)
        raw = msgspec.msgpack.encode(plan)
        try:
            wait_all(self.sent)
            head = header(STEP, len(raw), len(plan.positions))
            buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            self.sent = [w for r in range(1, self.world)
                         for w in (self.pg.send([head], r, 1), self.pg.send([buf], r, 1))] + [(head, buf)]
        except Exception as e:
            raise self.failed(e) from e
        self.share = RankShare(0, self.world, self.pages[0], plan)
        self.steps += 1

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int) -> torch.Tensor:
        T, hq, d = q.shape
        qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=1).float().contiguous()
        try:
            wait_all(self.sent)
            self.sent = [self.pg.send([qkv], r, 1) for r in range(1, self.world)] + [qkv]
            backs = [torch.empty(T, hq, d + 1, dtype=torch.float32) for _ in range(1, self.world)]
            works = [self.pg.recv([b], r, 2) for r, b in enumerate(backs, 1)]
            own = self.share.attend(layer, q, k, v, scale, window)
            t0 = time.perf_counter()
            wait_all(works)
            self.exchange_ms += (time.perf_counter() - t0) * 1e3
        except Exception as e:
            raise self.failed(e) from e
        return merge([(p[..., :d], p[..., d]) for p in [own] + backs], q.dtype)

    def close(self) -> None:
        def say_stop():
            for r in range(1, self.world):
                self.pg.send([header(STOP, 0, 0)], r, 1).wait()
        super().close(say_stop)


class DcpRunner(ModelRunner):
    """ModelRunner for a context-parallel engine: every row runs every layer (no last-layer row cut) and
    attention goes through the group."""

    def __init__(self, model, pages: list[torch.Tensor], block_size: int, group: DcpGroup):
        super().__init__(model, pages, block_size)
        self.group = group
        model.context = group

    def hidden(self, inp: StepInputs) -> torch.Tensor:
        self.group.begin(inp)
        hidden = self.model.forward(self._tensor(inp.ids), self._tensor(inp.positions), self.attention(inp), [])
        return hidden[self._tensor(inp.sample_rows)]


def _rank_main(pg, rank: int, world: int, hq: int, hkv: int, d: int, scale: float, windows: list[int],
               page: torch.Tensor) -> None:
    sent: list = []
    while True:
        head = torch.empty(3, dtype=torch.int64)
        pg.recv([head], 0, 1).wait()
        op, nbytes, T = (int(x) for x in head)
        if op == STOP:
            wait_all(sent)
            return
        raw = torch.empty(nbytes, dtype=torch.uint8)
        pg.recv([raw], 0, 1).wait()
        meta = msgspec.msgpack.decode(raw.numpy().tobytes(), type=DcpPlan)
        share = RankShare(rank, world, page, meta)
        for layer, window in enumerate(windows):
            qkv = torch.empty(T, (hq + 2 * hkv) * d, dtype=torch.float32)
            pg.recv([qkv], 0, 1).wait()
            q = qkv[:, :hq * d].view(T, hq, d)
            k = qkv[:, hq * d:(hq + hkv) * d].view(T, hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(T, hkv, d)
            packed = share.attend(layer, q, k, v, scale, window)
            wait_all(sent)
            sent = [pg.send([packed], 0, 2), packed]


