"""Prefill's side of the KV handoff: gather -> Transfer Engine write -> tell decode, in slot-sized windows.

A request's KV is sent as windows of whole blocks, each at most one landing slot (default 8 MiB) of the
decode rank's token-major buffer ([tokens, layers, 2, kv_heads, head_dim], see shared/kv_layout.py). Per
round: ask decode for credits (slots), gather one window per slot into our registered staging
buffers, write them all in one batched call, then tell decode which bytes landed where; decode
scatters and returns the credits. The blocks stay owned by the handoff until it ends, however it ends.

Checksums: the thread that gathers a window also computes the CRC-32C of exactly the bytes it will
write (shared/handoff_check.py); SlotsFilled carries one per piece and decode verifies each landed
slot before scattering it. A mismatch comes back as a refused SlotsFilled: HandoffFailed, so the
request fails with a 503 (retried once by the router while the client has received nothing).

Tracing: the caller's `kv.handoff` span is current; each round adds a `kv.gather` and a `kv.write` span
(two spans per round of up to max_slots_per_round x 8 MiB, never one per block or token), and decode's
`decode.slot_grant` / `decode.scatter` spans join it through the NATS headers. The final HandoffDone goes
out under `done_context` (the request's own span), so decode.generate is a sibling of kv.handoff.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch
from opentelemetry import context as otel_context

from kernels import get_kv_kernels
from shared.bus import Bus
from shared.handoff_check import Piece, checksum, to_wire
from shared.kv_layout import KVLayout
from shared.messages import Ack, HandoffDone, SlotGrant, SlotRequest, SlotsFilled
from shared.tracing import get_tracer
from shared.transfer import KVTransport, TransferConfig

tracer = get_tracer("moorage.prefill.handoff")


class HandoffFailed(RuntimeError):
    pass


@dataclass
class HandoffStats:
    bytes: int = 0
    writes: int = 0
    rounds: int = 0
    gather_ms: float = 0.0   # includes crc_ms: the checksum runs in the gathering thread
    crc_ms: float = 0.0
    write_ms: float = 0.0
    scatter_ms: float = 0.0  # decode's, from the SlotsFilled acks; includes verify_ms (its checksums)
    verify_ms: float = 0.0
    extra: dict = field(default_factory=dict)


class StagingPool:
    """Registered staging buffers of slot size, shared by all handoffs of this instance."""

    def __init__(self, transport: KVTransport, count: int, nbytes: int):
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(count)]
        for b in self.buffers:
            transport.register(b)
        self._free = list(range(count))
        self._cond = asyncio.Condition()

    async def take(self, n: int) -> list[int]:
        async with self._cond:
            await self._cond.wait_for(lambda: len(self._free) >= min(n, len(self.buffers)))
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    async def give_back(self, ids: list[int]) -> None:
        async with self._cond:
            self._free += ids
            self._cond.notify_all()


class HandoffSender:
    def __init__(self, bus: Bus, instance: str, layout: KVLayout, pages: list[torch.Tensor],
                 transport: KVTransport, config: TransferConfig):
        self.bus, self.instance, self.layout, self.pages = bus, instance, layout, pages
        self.transport, self.config = transport, config
        self.kernels = get_kv_kernels(pages[0].device)
        self.token_bytes = layout.bytes_per_token  # one token, every layer, K and V (one decode rank)
        self.window_tokens = (config.slot_bytes // self.token_bytes) // layout.block_size * layout.block_size
        if self.window_tokens == 0:
            raise ValueError(f"transfer.slot_bytes {config.slot_bytes} cannot hold one block of KV "
                             f"({layout.block_size * self.token_bytes} bytes)")
        self.staging = StagingPool(transport, max(1, config.slots), config.slot_bytes)

    def _gather(self, table: list[int], num_tokens: int, raw: torch.Tensor) -> tuple[int, float]:
        """Worker thread: KV of `num_tokens` tokens -> `raw` (a staging region of exactly their bytes);
        returns (CRC-32C of those bytes, ms the checksum took)."""
        self.kernels.gather_for_ranks(self.pages, table, num_tokens, 1, self.layout, [raw.view(self.layout.dtype)])
        t = time.perf_counter()
        crc = checksum(raw)
        return crc, (time.perf_counter() - t) * 1e3

    def _windows(self, num_tokens: int) -> list[tuple[int, int]]:
        w = self.window_tokens
        return [(t0, min(num_tokens, t0 + w)) for t0 in range(0, num_tokens, w)]

    async def send(self, decode: str, request_id: str, block_table: list[int], num_tokens: int,
                   done: HandoffDone, done_context: otel_context.Context | None = None) -> HandoffStats:
        """Moves KV of tokens [0, num_tokens) to `decode`, then hands the request over (the HandoffDone
        carries `done_context` as its trace parent when given, else the current span)."""
        subjects, stats = self.bus.subjects, HandoffStats()
        windows = self._windows(num_tokens)
        total = num_tokens * self.token_bytes
        deadline = time.monotonic() + self.config.timeout_s
        i = 0
        in_flight: list[asyncio.Task] = []  # SlotsFilled acks: decode scatters round k while we do k+1
        try:
            while i < len(windows):
                i = await self._round(decode, request_id, block_table, windows, i, total, num_tokens, deadline,
                                      stats, in_flight)
            for task in in_flight:
                self._check_filled(await task, stats)
        finally:
            for task in in_flight:
                task.cancel()
        done.handoff = {"bytes": stats.bytes, "writes": stats.writes, "rounds": stats.rounds}
        token = otel_context.attach(done_context) if done_context is not None else None
        try:
            ack = await self.bus.request(subjects.decode_landed(decode), done, Ack)
        finally:
            if token is not None:
                otel_context.detach(token)
        if not ack.ok:
            raise HandoffFailed(f"decode refused the request: {ack.error}")
        return stats

    def _check_filled(self, ack: Ack, stats: HandoffStats) -> None:
        if not ack.ok:
            raise HandoffFailed(f"decode could not land the KV: {ack.error}")
        stats.scatter_ms += float(ack.stats.get("scatter_ms", 0.0))
        stats.verify_ms += float(ack.stats.get("verify_ms", 0.0))

    async def _round(self, decode, request_id, block_table, windows, i, total, num_tokens, deadline, stats,
                     in_flight) -> int:
        """One round: credits -> gather -> one batched write -> SlotsFilled (its ack awaited later,
        at most one round behind). Returns the next window index."""
        subjects, B = self.bus.subjects, self.layout.block_size
        want = min(self.config.max_slots_per_round, len(windows) - i, len(self.staging.buffers))
        grant = await self.bus.request(subjects.decode_slots(decode), SlotRequest(
            request_id, self.instance, total, num_tokens, want), SlotGrant)
        if grant.error or not grant.slots:
            if grant.error.startswith("fatal:") or time.monotonic() > deadline:
                for task in list(in_flight):  # an earlier round's refusal (e.g. a checksum) says why first
                    in_flight.remove(task)
                    self._check_filled(await task, stats)
                raise HandoffFailed(grant.error or "decode granted no landing slots in time")
            if in_flight:  # our own earlier round holds the credits: wait for it
                self._check_filled(await in_flight.pop(0), stats)
            else:
                await asyncio.sleep(0.02)  # decode is short of slots or KV: credits come back soon
            return i
        slots = grant.slots[:want]
        bufs = await self.staging.take(len(slots))
        attrs = {"round": stats.rounds, "windows": len(slots)}
        try:
            src, dst, lens, pieces, crc_ms = [], [], [], [], 0.0
            t = time.perf_counter()
            with tracer.start_as_current_span("kv.gather", attributes=attrs) as span:
                for (slot_id, addr, cap), b in zip(slots, bufs):
                    t0, t1 = windows[i]
                    i += 1
                    nbytes = (t1 - t0) * self.token_bytes
                    if nbytes > cap:
                        raise HandoffFailed(f"decode slot of {cap} bytes is smaller than a window of {nbytes}")
                    raw = self.staging.buffers[b][:nbytes]
                    crc, ms = await asyncio.to_thread(self._gather, block_table[t0 // B:], t1 - t0, raw)
                    crc_ms += ms
                    src.append(raw.data_ptr()), dst.append(addr), lens.append(nbytes)
                    pieces.append(Piece(slot_id, t0 * self.token_bytes, nbytes, crc))
                span.set_attributes({"bytes": sum(lens), "crc_ms": crc_ms})
            stats.gather_ms += (time.perf_counter() - t) * 1e3
            stats.crc_ms += crc_ms
            t = time.perf_counter()
            with tracer.start_as_current_span("kv.write", attributes={**attrs, "bytes": sum(lens), "writes": len(src),
                                                                      "endpoint": grant.endpoint}):
                await asyncio.to_thread(self.transport.write, grant.endpoint, src, dst, lens)
            stats.write_ms += (time.perf_counter() - t) * 1e3
        finally:
            await self.staging.give_back(bufs)
        stats.writes, stats.bytes, stats.rounds = stats.writes + len(src), stats.bytes + sum(lens), stats.rounds + 1
        wire, crcs = to_wire(pieces)
        in_flight.append(asyncio.create_task(self.bus.request(
            subjects.decode_filled(decode), SlotsFilled(request_id, wire, crcs), Ack)))
        if len(in_flight) > 1:
            self._check_filled(await in_flight.pop(0), stats)
        return i
