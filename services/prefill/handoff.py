"""Prefill's side of the KV handoff: gather -> Transfer Engine write -> tell decode, as a pipeline.

A request's KV is decode's rank buffer ([tokens, layers, 2, kv_heads, head_dim], token-major, see
shared/kv_layout.py) cut into windows of exactly one landing slot (`plan_writes`: the last one shorter),
so a handoff is ceil(bytes / slot_bytes) writes. A window may start or end inside a token (or a block):
it is gathered from the token that holds its first byte to the one that holds its last, into a staging
buffer one slot plus two tokens long, and the write starts at the window's first byte; decode joins the
tokens cut by a window edge (services/decode/landing.py).

Pipeline (one task gathers, the caller's task writes, decode scatters):
- the first SlotRequest goes out at once, or earlier (`pre_grant`, for one slot while the prompt's last step
  computes: the landing, and what decode holds of the prompt, are then known when the handoff starts), and the
  first windows are gathered while it is answered;
- the gatherer runs ahead into free staging buffers while a write is in progress;
- each write sends every gathered window it holds credits for (one batched call), then a SlotsFilled
  whose ack (decode's scatter) is awaited later, at most two rounds behind;
- credits are asked for again while a write runs whenever more windows remain than are granted;
- HandoffDone goes out together with the last SlotsFilled: decode adopts the request only once every
  piece has landed, been verified and scattered (LandingZone.take_when_landed).
The blocks stay owned by the handoff until it ends, however it ends.

Decode reuse (`transfer.decode_reuse`): the SlotRequests carry the prompt's full blocks' hashes until decode has
made the request's landing; its grants then say how many leading tokens it already holds (`reused_tokens`), and
the windows are cut again from there before the first is gathered (none is gathered ahead of its credit until
then): only the rest of the prompt is sent.

Checksums: the thread that gathers a window also computes the CRC-32C of exactly the bytes it will
write (shared/handoff_check.py); SlotsFilled carries one per piece and decode verifies each landed
slot before scattering it. A mismatch comes back as a refused SlotsFilled: HandoffFailed, so the
request fails with a 503 (retried once by the router while the client has received nothing).

A handoff that fails or is cancelled (after decode may have made its landing) sends PagesReleased, asked until
decode acknowledges it (services/prefill/release.py): decode frees the landing at once, even when the bus
restarted meanwhile; the request's Cancel alone was lost then, and the landing held until its expiry.

Tracing: the caller's `kv.handoff` span is current; each write adds a `kv.write` span and each window a
`kv.gather` span (never one per block or token), and decode's `decode.slot_grant` / `decode.scatter`
spans join it through the NATS headers. HandoffDone goes out under `done_context` (the request's own
span), so decode.generate is a sibling of kv.handoff.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import torch
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry import context as otel_context

from kernels.cpu_kv import threads as copy_threads
from services.prefill.release import GrantReleases
from services.prefill.staging import StagingPool
from shared.bus import Bus
from shared.device_staging import KVStaging
from shared.handoff_check import Piece, checksum, to_wire
from shared.kv_layout import KVLayout
from shared.messages import Ack, HandoffDone, SlotGrant, SlotRequest, SlotsFilled
from shared.tracing import get_tracer
from shared.transfer import KVTransport, TransferConfig, plan_writes

tracer = get_tracer("moorage.prefill.handoff")


class HandoffFailed(RuntimeError):
    pass


async def _finish_thread(fn, *args):
    """asyncio.to_thread, but a cancel waits for the thread to end before it propagates: the thread
    reads or writes a staging buffer, which must not go back to the pool (and to another handoff,
    whose checksum would then cover bytes this thread still changes) while it runs."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.gather(work, return_exceptions=True)
        raise


def ack_timeout(bus: Bus, deadline: float) -> float:
    """How long to wait for a reply that a busy decode gives late, not never: until the handoff's `deadline`
    (monotonic), never less than the bus's own timeout."""
    return max(deadline - time.monotonic(), bus.config.request_timeout_s)


def send_done(bus: Bus, decode: str, done: HandoffDone | bytes,
              done_context: otel_context.Context | None, deadline: float) -> asyncio.Task:
    """HandoffDone (or its `Bus.pack`ed bytes) to `decode`, as a task awaiting its Ack, with `done_context` (when
    given) as its trace parent. Decode verifies the KV first, and a staged handoff's last bytes may still be
    landing: the Ack is awaited for `ack_timeout`; a decode that is gone has no responder, and that fails at once."""
    token = otel_context.attach(done_context) if done_context is not None else None
    wait = ack_timeout(bus, deadline)
    try:  # the task copies the current context
        return asyncio.create_task(bus.request(bus.subjects.decode_landed(decode), done, Ack, timeout=wait))
    finally:
        if token is not None:
            otel_context.detach(token)


@dataclass
class HandoffStats:
    bytes: int = 0
    writes: int = 0
    rounds: int = 0
    gather_ms: float = 0.0   # time in the gathering thread (includes crc_ms); overlaps write_ms
    crc_ms: float = 0.0
    crc_reused: int = 0      # direct: blocks whose CRC was kept from an earlier handoff (shared/block_crcs.py)
    write_ms: float = 0.0
    scatter_ms: float = 0.0  # decode's, from the SlotsFilled acks; includes verify_ms (its checksums)
    verify_ms: float = 0.0
    verified_early: int = 0  # direct: writes decode checked on PagesLanded, beside the rest of the write
    grant_ms: float = 0.0    # direct: asking decode for its blocks (the PagesRequest round trip)
    done_ms: float = 0.0     # direct: HandoffDone until decode's Ack (its verify included; adoption follows it)
    early_grant: bool = False  # the grant (direct), first slots (staged), asked while the prompt's last step computed
    reused_blocks: int = 0   # leading blocks decode held already (decode reuse): not sent
    mode: str = "slots"      # "slots": staged through landing slots; "direct": into decode's pages (direct.py)
    entry_bytes: list = field(default_factory=list)  # direct: the bytes of each span written
    extra: dict = field(default_factory=dict)


@dataclass
class _Gathered:
    """One window in a staging buffer: `raw` is exactly the bytes to write."""
    window: int
    buffer: int
    raw: torch.Tensor
    offset: int
    crc: int


@dataclass
class _Run:
    """The state of one send(): windows, credits held, acks in flight, stats."""
    decode: str
    request_id: str
    block_table: list[int]
    num_tokens: int
    windows: list[tuple[int, int]]  # (offset, nbytes) in the rank buffer; cut again once decode says what it holds
    deadline: float
    stats: HandoffStats
    total_bytes: int                                 # the whole prompt's KV (what decode checks the layout by)
    block_hashes: list = field(default_factory=list)  # the prompt's full blocks' (decode reuse); [] once granted
    reused_tokens: int = 0                           # leading tokens decode holds: their bytes are not sent
    slots: list[list] = field(default_factory=list)  # granted, unused: [slot_id, addr, cap]
    endpoint: str = ""
    asking: asyncio.Task | None = None               # the SlotRequest in flight
    asks: int = 0                                    # SlotRequests sent (each one's `ask`)
    acks: list[asyncio.Task] = field(default_factory=list)
    written: int = 0                                 # windows written so far
    credited: int = 0                                # slots granted so far: windows [0, credited) have one


class HandoffSender:
    def __init__(self, bus: Bus, instance: str, layout: KVLayout, pages: list[torch.Tensor],
                 transport: KVTransport, config: TransferConfig):
        self.bus, self.instance, self.layout, self.pages = bus, instance, layout, pages
        self.transport, self.config = transport, config
        self.copies = KVStaging(pages, config.register_pages)  # pages -> staging buffers, from a device too
        self.token_bytes = layout.bytes_per_token  # one token, every layer, K and V (one decode rank)
        self.staging = StagingPool(transport, max(1, config.slots), config.slot_bytes + 2 * self.token_bytes,
                                   pages[0].device)
        self.reuse = config.decode_reuse  # send the prompt's block hashes: decode may hold some
        self.releases = GrantReleases(bus, config.timeout_s)  # a failed handoff's landing, freed at once

    def _gather(self, table: list[int], num_tokens: int, offset: int, nbytes: int, buf: torch.Tensor
                ) -> tuple[torch.Tensor, int, float]:
        """Worker thread: the bytes [offset, offset + nbytes) of the rank buffer -> a view of `buf`;
        returns (that view, its CRC-32C, ms the checksum took)."""
        tb = self.token_bytes
        t0, t1 = offset // tb, -(-(offset + nbytes) // tb)
        region = buf[:(t1 - t0) * tb]
        with copy_threads(self.config.copy_threads or torch.get_num_threads()):
            self.copies.gather(self.pages, table, t1, self.layout, region.view(self.layout.dtype), first=t0)
        raw = region[offset - t0 * tb:offset - t0 * tb + nbytes]
        t = time.perf_counter()
        crc = checksum(raw)
        return raw, crc, (time.perf_counter() - t) * 1e3

    async def _gatherer(self, run: _Run, out: asyncio.Queue) -> None:
        """Gathers every window in order into free staging buffers (bounded by the pool), ahead of its credit
        only once decode has said what it holds (decode reuse: the first grant may cut the windows again)."""
        i = 0
        while i < len(run.windows):
            b = await self.staging.take(lambda: i < run.credited, lambda: not run.block_hashes)
            offset, nbytes = run.windows[i]
            try:
                t = time.perf_counter()
                with tracer.start_as_current_span("kv.gather", attributes={"window": i, "bytes": nbytes}) as span:
                    raw, crc, crc_ms = await _finish_thread(self._gather, run.block_table, run.num_tokens, offset,
                                                            nbytes, self.staging.buffers[b])
                    span.set_attribute("crc_ms", crc_ms)
                run.stats.gather_ms += (time.perf_counter() - t) * 1e3
                run.stats.crc_ms += crc_ms
            except BaseException:
                await self.staging.give_back([b])
                raise
            await out.put(_Gathered(i, b, raw, offset, crc))
            i += 1

    def _new_run(self, decode: str, request_id: str, num_tokens: int, block_hashes: list) -> _Run:
        total = num_tokens * self.token_bytes
        return _Run(decode, request_id, [], num_tokens, plan_writes(total, self.config.slot_bytes),
                    time.monotonic() + self.config.timeout_s, HandoffStats(), total,
                    list(block_hashes) if self.reuse else [])

    def pre_grant(self, decode: str, request_id: str, num_tokens: int,
                  context: otel_context.Context | None = None, block_hashes: list = ()) -> _Run | None:
        """Ask `decode` for the request's first landing slot now (`context`: the ask's trace parent): the landing
        is made, and what decode holds of the prompt known, before the handoff starts; one slot only, as other
        handoffs to that decode may need the rest meanwhile. Give the run to `send(early=...)`, or to `release` if
        the request ends without a handoff. The handoff's deadline counts from now."""
        run = self._new_run(decode, request_id, num_tokens, block_hashes)
        if not run.windows:
            return None
        token = otel_context.attach(context) if context is not None else None
        try:  # the task copies the current context; one slot: held while the step computes, not more
            self._ask(run, most=1)
        finally:
            if token is not None:
                otel_context.detach(token)
        run.asking.add_done_callback(lambda t: t.cancelled() or t.exception())  # send() asks again if it failed
        run.stats.early_grant = True
        return run

    async def release(self, decode: str, request_id: str, early: _Run | None = None) -> None:
        """Prefill sends nothing for this request (it ended without `send`): decode drops its landing. A
        release that overtakes the slot request itself is safe: decode then refuses or undoes the landing.
        Returns at once; the release is asked until decode acknowledges it (services/prefill/release.py)."""
        if early is not None and early.asking is not None:
            early.asking.cancel()
        self.releases.release(decode, request_id)

    async def send(self, decode: str, request_id: str, block_table: list[int], num_tokens: int,
                   done: HandoffDone, done_context: otel_context.Context | None = None,
                   block_hashes: list = (), early: _Run | None = None) -> HandoffStats:
        """Moves KV of tokens [0, num_tokens) to `decode`, then hands the request over (the HandoffDone
        carries `done_context` as its trace parent when given, else the current span). `block_hashes`: the
        prompt's full blocks' (transfer.decode_reuse): decode may answer that it holds the leading ones, whose
        tokens are then not sent. `early`: this request's `pre_grant` run (send owns it from here)."""
        if early is None:
            run = self._new_run(decode, request_id, num_tokens, block_hashes)
        elif (early.decode, early.request_id, early.num_tokens) != (decode, request_id, num_tokens):
            await self.release(early.decode, early.request_id, early)
            raise HandoffFailed(f"early slots were asked for {early.request_id} at {early.decode} "
                                f"({early.num_tokens} tokens)")
        else:
            run = early
        run.block_table = block_table
        gathered: asyncio.Queue[_Gathered] = asyncio.Queue()
        gatherer = asyncio.create_task(self._gatherer(run, gathered)) if run.windows else None
        held: list[_Gathered] = []  # gathered, not yet written: their staging buffers go back on failure
        completed = False
        try:
            if run.windows:
                self._ask(run)
            while run.written < len(run.windows):
                await self._credits(run)  # first: the gatherer then never waits on credits we wait for
                if not held:
                    held.append(await self._next(gathered, gatherer))
                while not gathered.empty():
                    held.append(gathered.get_nowait())
                batch, held = held[:len(run.slots)], held[len(run.slots):]
                await self._write(run, batch, last=run.written + len(batch) == len(run.windows))
                if run.written < len(run.windows) and len(run.slots) < len(run.windows) - run.written:
                    self._ask(run)  # overlaps the next gathers and the write after them
            done.handoff = {"bytes": run.stats.bytes, "writes": run.stats.writes, "rounds": run.stats.rounds,
                            "reused_blocks": run.stats.reused_blocks}
            adopted = send_done(self.bus, decode, done, done_context, run.deadline)
            try:
                for task in run.acks:
                    self._check_filled(await task, run.stats)
            except BaseException:
                adopted.cancel()
                raise
            ack = await adopted
            if not ack.ok:
                raise HandoffFailed(f"decode refused the request: {ack.error}")
            completed = True
            return run.stats
        finally:
            if not completed:  # decode drops the landing (its blocks, slots) now, not at its expiry; the scatters
                self.releases.release(decode, request_id)  # of pieces already sent finish first
            for task in (gatherer, run.asking, *run.acks):
                if task is not None:
                    task.cancel()
            if gatherer is not None:
                await asyncio.gather(gatherer, return_exceptions=True)
            while not gathered.empty():
                held.append(gathered.get_nowait())
            if held:
                await self.staging.give_back([g.buffer for g in held])

    async def close(self) -> None:
        await self.releases.close()

    @staticmethod
    async def _next(gathered: asyncio.Queue, gatherer: asyncio.Task) -> _Gathered:
        """The next gathered window, or the gatherer's error."""
        get = asyncio.ensure_future(gathered.get())
        await asyncio.wait([get, gatherer], return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            return get.result()
        get.cancel()
        gatherer.result()  # raises its error
        raise HandoffFailed("gatherer ended early")

    def _ask(self, run: _Run, most: int = 0) -> None:
        """Ask decode for credits (at most `most`, when given), unless a request is already in flight; its slots
        are recorded as soon as the grant arrives, so the gatherer can use them while we write."""
        if run.asking is not None:
            return
        want = min(most or self.config.max_slots_per_round, len(run.windows) - run.written - len(run.slots),
                   len(self.staging.buffers))
        if want > 0:
            run.asking = asyncio.create_task(self._request_slots(run, want))

    async def _request_slots(self, run: _Run, want: int) -> SlotGrant:
        """The SlotRequest task: records the granted slots itself, as it completes. A busy decode answers late,
        not never: after a bus timeout the same ask goes again (decode answers it with the same slots) until
        the handoff's deadline."""
        run.asks += 1
        ask = SlotRequest(run.request_id, self.instance, run.total_bytes, run.num_tokens, want, ask=run.asks,
                          block_hashes=run.block_hashes, block_size=self.layout.block_size)
        try:
            while True:
                try:
                    grant = await self.bus.request(self.bus.subjects.decode_slots(run.decode), ask, SlotGrant)
                    break
                except NatsTimeoutError:
                    if time.monotonic() > run.deadline:
                        raise HandoffFailed("decode did not answer its slot request in time") from None
        finally:
            if run.asking is asyncio.current_task():
                run.asking = None
        if not grant.error:  # the landing is made, and what it reuses known: later asks need no hashes, and
            if grant.reused_tokens != run.reused_tokens:  # windows may be gathered ahead of their credits
                self._skip_reused(run, grant.reused_tokens)
            run.block_hashes = []
            self.staging.poke()
        if grant.slots:
            run.slots += grant.slots
            run.credited += len(grant.slots)
            run.endpoint = grant.endpoint
            self.staging.poke()
        return grant

    def _skip_reused(self, run: _Run, tokens: int) -> None:
        """Decode holds the prompt's first `tokens` already: cut the windows again from there. Only before any
        window has a credit (the landing, and what it reuses, is made once, by the first grant that has one)."""
        bs = self.layout.block_size
        if run.credited or run.reused_tokens or not 0 < tokens < run.num_tokens or tokens % bs:
            raise HandoffFailed(f"decode granted {tokens} reused tokens (of {run.num_tokens}) after "
                                f"{run.reused_tokens}, with {run.credited} windows credited")
        skip = tokens * self.token_bytes
        run.windows[:] = [(skip + o, n) for o, n in plan_writes(run.total_bytes - skip, self.config.slot_bytes)]
        run.reused_tokens, run.stats.reused_blocks = tokens, tokens // bs

    async def _credits(self, run: _Run) -> None:
        """Until at least one credit is held: await the grant in flight, asking again while decode is short."""
        while not run.slots:
            self._ask(run)
            grant = await run.asking  # its slots are recorded by the time this returns
            if grant.slots:
                continue
            if grant.fatal or time.monotonic() > run.deadline:
                for ack in list(run.acks):  # an earlier round's refusal (e.g. a checksum) says why first
                    run.acks.remove(ack)
                    self._check_filled(await ack, run.stats)
                raise HandoffFailed(grant.error or "decode granted no landing slots in time")
            if run.acks:  # our own earlier round holds the credits: wait for it
                self._check_filled(await run.acks.pop(0), run.stats)
            # else decode is short of slots or KV: it held the request until room came back or its hold
            # time passed (services/decode/landing.py), so asking again at once is not a busy loop

    async def _write(self, run: _Run, batch: list[_Gathered], last: bool) -> None:
        """One batched Transfer Engine write of `batch` into as many credits, then its SlotsFilled."""
        slots, run.slots = run.slots[:len(batch)], run.slots[len(batch):]
        pieces = []
        try:
            for (slot_id, _, cap), g in zip(slots, batch):
                if g.raw.numel() > cap:
                    raise HandoffFailed(f"decode slot of {cap} bytes is smaller than a window of {g.raw.numel()}")
                pieces.append(Piece(slot_id, g.offset, g.raw.numel(), g.crc))
            nbytes = sum(p.nbytes for p in pieces)
            t = time.perf_counter()
            with tracer.start_as_current_span("kv.write", attributes={
                    "round": run.stats.rounds, "windows": len(batch), "bytes": nbytes, "writes": len(batch),
                    "endpoint": run.endpoint}):
                await _finish_thread(self.transport.write, run.endpoint, [g.raw.data_ptr() for g in batch],
                                     [s[1] for s in slots], [p.nbytes for p in pieces])
            run.stats.write_ms += (time.perf_counter() - t) * 1e3
        finally:
            await self.staging.give_back([g.buffer for g in batch])
        run.written += len(batch)
        run.stats.writes, run.stats.bytes, run.stats.rounds = (run.stats.writes + len(batch), run.stats.bytes + nbytes,
                                                               run.stats.rounds + 1)
        wire, crcs = to_wire(pieces)
        run.acks.append(asyncio.create_task(self.bus.request(  # a busy decode scatters late, not never
            self.bus.subjects.decode_filled(run.decode), SlotsFilled(run.request_id, wire, crcs), Ack,
            timeout=ack_timeout(self.bus, run.deadline))))
        if len(run.acks) > 2 and not last:
            self._check_filled(await run.acks.pop(0), run.stats)

    def _check_filled(self, ack: Ack, stats: HandoffStats) -> None:
        if not ack.ok:
            raise HandoffFailed(f"decode could not land the KV: {ack.error}")
        stats.scatter_ms += float(ack.stats.get("scatter_ms", 0.0))
        stats.verify_ms += float(ack.stats.get("verify_ms", 0.0))
