"""Decode's side of the KV handoff: landing slots in, scatter into pages, adopt the request.

A request's landing owns the KV blocks allocated for its prompt (reserved by the gate's admission)
until `HandoffDone` passes them to the engine, or until it is cancelled or idles past the timeout;
then they are released. Slots are credits: each is returned as soon as its bytes are scattered.

Pieces are byte ranges of the rank buffer, one landing slot each (prefill cuts it in slot-sized
windows, so a piece may begin or end inside a token). Whole tokens go straight from the slot into the
pages; the bytes of a token cut by a piece edge wait in a small per-token buffer (`Landing.seams`)
until the neighbouring piece brings the rest, and that token is scattered then. HandoffDone may
arrive while the last pieces are still being scattered (prefill sends both at once):
`take_when_landed` waits until every byte has landed, or the landing was dropped.

Scattering goes through shared/device_staging.py: straight from the slot into pages in host memory, or through
a scratch buffer on the pages' device when they are foreign (a GPU's, or `transfer.register_pages` false).

Cancel races every other message of the request (NATS runs each subscription's handler as its own
task), so two invariants hold across the awaits below:
- a cancelled id is remembered (`cancelled`), and a grant or adoption that was already under way when
  the cancel came lets go of what it took instead of keeping it for ever;
- blocks of a dropped landing go back to the engine only once no scatter is writing into them, so a
  late write can never land in blocks that another request has been given since.

Checksums: every landed slot is verified against the CRC-32C prefill sent in SlotsFilled.crcs, in the
worker thread that then scatters it, before a byte reaches the pages (shared/handoff_check.py). A
mismatch, or pieces without checksums, drops the landing (slots and blocks back, the id remembered as
cancelled), is counted in `checks`, and refuses the SlotsFilled: prefill then fails the request with a
503 and the router retries it once if the client has received nothing. `MOORAGE_FAULT_CORRUPT_LANDING=N`
(tests only; 0 and unset = off) flips one byte of each of the first N landed pieces before that check.

Short of room (no free slot, or no KV blocks yet) decode holds a SlotRequest up to GRANT_HOLD_S and
answers as soon as slots or blocks come back (`_room`, pulsed whenever this zone frees any, and the
engine loop's `changed`, pulsed when a step may have freed blocks): prefill then asks again at once
instead of sleeping and polling. Grants are served concurrently (the subscription is `concurrent`), so a
held one delays no other.

Decode reuse (`transfer.decode_reuse`, the zone's `reuse`): a SlotRequest may carry the prompt's full blocks'
chained hashes. The landing then takes the leading blocks decode still holds of them (acquired before the rest is
allocated, which could otherwise evict them), and every SlotGrant says how many tokens that covers (`reused_tokens`):
prefill sends only the bytes from there on. At HandoffDone those blocks must hold exactly the prompt's leading
tokens (`check_reused`), else the request is refused and they leave the index, so the retry moves the whole
prompt. The direct handoff (services/decode/direct.py) shares all of this.

Tracing: each grant and each scatter is one span (`decode.slot_grant`, `decode.scatter`: one per round
of the handoff), a child of prefill's `kv.handoff` through the message headers; the first grant, asked for
while the prompt's last step computes (before kv.handoff begins), is a child of the request's span.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from opentelemetry.trace import Status, StatusCode

from kernels.cpu_prefault import prefault
from kernels.cpu_kv import threads as copy_threads
from shared.device_staging import KVStaging
from shared.engine.block_manager import BlockManager, OutOfBlocks
from shared.engine.engine import Engine
from shared.engine.loop import EngineLoop
from shared.handoff_check import MISMATCH, HandoffChecks, LandingFaults, Piece, Unverified, parse, verify
from shared.logging import get_logger
from shared.messages import Ack, HandoffDone, SlotGrant, SlotRequest, SlotsFilled
from shared.tracing import extract_context, get_tracer
from shared.transfer import LandingSlots

tracer = get_tracer("moorage.decode.landing")
log = get_logger("decode.landing")


def _parent(raw):
    return extract_context(getattr(raw, "headers", None))


@dataclass
class Landing:
    blocks: list[int]
    num_tokens: int
    total_bytes: int       # the bytes to land: staged, those of the tokens after the reused blocks; direct, of
                           # the blocks written
    received: dict[int, int] = field(default_factory=dict)  # offset -> nbytes of pieces accepted (landing or landed)
    received_bytes: int = 0  # bytes verified and in the pages (or in `seams`)
    seams: dict[int, list] = field(default_factory=dict)  # token cut by a piece edge -> [bytes so far, uint8 buffer]
    last_activity: float = field(default_factory=time.monotonic)
    scattering: int = 0    # scatters writing into `blocks` right now
    dropped: bool = False  # cancelled or expired: the last scatter to finish frees the blocks
    writes_over: bool = True  # False while a direct handoff may still write into `blocks` (services/decode/direct.py)
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # every byte landed, or dropped
    checks: dict = field(default_factory=dict)  # direct, from PagesLanded: write (tuple) -> (its check task, index)
    writer: str = ""       # direct: the prefill instance writing into `blocks`
    reused: int = 0        # leading blocks of `blocks` we already held (decode reuse): nothing is written there
    asks: dict[int, list] = field(default_factory=dict)  # staged: SlotRequest.ask -> the slots that ask was granted

    def overlaps(self, offset: int, nbytes: int) -> bool:
        return any(offset < o + n and o < offset + nbytes for o, n in self.received.items())


class Refused(ValueError):
    """HandoffDone's KV cannot be adopted (malformed, failed its checksum, or the blocks held for it hold another
    prefix): nothing of the request is adopted."""


def hold_prefix_then_allocate(bm: BlockManager, hashes: list, n_blocks: int) -> tuple[list[int], list[int]]:
    """Engine thread: (the blocks `bm` holds of the prompt's leading `hashes`, one more owner each; new blocks for
    the rest). The held ones are acquired before the allocation, which could otherwise evict them. Raises
    OutOfBlocks with nothing taken."""
    reused = bm.match_hashes(hashes)
    bm.acquire(reused)
    try:
        return reused, bm.allocate(n_blocks - len(reused))
    except OutOfBlocks:
        bm.release(reversed(reused))
        raise


_CANCELLED_MEMORY = 4096  # cancelled ids remembered, to refuse their late grants and adoptions
GRANT_HOLD_S = 1.0  # a grant short of room waits this long for some (well below the bus's request timeout)


class LandingZone:
    def __init__(self, engine: Engine, loop: EngineLoop, slots: LandingSlots, endpoint: str,
                 faults: LandingFaults | None = None, copy_threads: int = 0, register_pages: bool = True,
                 reuse: bool = True):
        self.engine, self.loop, self.slots, self.endpoint = engine, loop, slots, endpoint
        self.reuse = reuse  # grant the prompt's leading blocks we hold (transfer.decode_reuse), staged or direct
        self.reuse_counters = {"reuse_grants": 0, "reused_blocks": 0, "reuse_mismatches": 0}
        self.copy_threads = copy_threads  # a scatter's threads (transfer.copy_threads; 0 = torch's)
        self.faults = faults or LandingFaults()
        self.checks = HandoffChecks()
        self.layout = engine.layout
        self.token_bytes = self.layout.bytes_per_token
        self.copies = KVStaging(engine.pages, register_pages)  # slots -> pages, onto a device too
        self.landings: dict[str, Landing] = {}
        self.cancelled: OrderedDict[str, None] = OrderedDict()
        self._background: set[asyncio.Task] = set()  # prefaults in flight (kept referenced until done)
        self._room = asyncio.Event()  # set (and replaced) whenever this zone frees slots or blocks
        self.quarantine: dict[str, Landing] = {}  # dropped, but a direct write may still land in their blocks

    def is_cancelled(self, rid: str) -> bool:
        return rid in self.cancelled

    async def grant(self, msg: SlotRequest, raw=None) -> SlotGrant:
        with tracer.start_as_current_span("decode.slot_grant", context=_parent(raw), attributes={
                "request_id": msg.request_id, "wanted": msg.max_slots}) as span:
            reply = await self._grant(msg)
            span.set_attributes({"granted": len(reply.slots), "error": reply.error})
            if reply.fatal:
                span.set_status(Status(StatusCode.ERROR, reply.error))
            return reply

    async def _grant(self, msg: SlotRequest) -> SlotGrant:
        """Grants what it can; when that is nothing, waits for room (up to GRANT_HOLD_S) and tries again."""
        deadline = time.monotonic() + GRANT_HOLD_S
        while True:
            reply = await self._try_grant(msg)
            remaining = deadline - time.monotonic()
            if reply.slots or reply.fatal or msg.max_slots <= 0 or remaining <= 0:
                return reply
            await self._wait_for_room(remaining, blocks=msg.request_id not in self.landings)

    def _freed(self) -> None:
        """Slots or blocks came back: wake the grants waiting for room."""
        self._room.set()
        self._room = asyncio.Event()

    async def _wait_for_room(self, timeout: float, blocks: bool) -> None:
        """Until this zone frees slots or blocks, or (`blocks`: short of KV blocks) the engine may have
        freed some, or timeout."""
        waits = [asyncio.ensure_future(self._room.wait())]
        if blocks:
            waits.append(asyncio.ensure_future(self.loop.changed(timeout)))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _try_grant(self, msg: SlotRequest) -> SlotGrant:
        rid = msg.request_id
        if rid in self.cancelled:
            return SlotGrant(rid, error="request cancelled", fatal=True)
        landing = self.landings.get(rid)
        if landing is None:
            if msg.total_bytes != msg.num_tokens * self.token_bytes:
                return SlotGrant(rid, error=f"KV layout mismatch: {msg.total_bytes} bytes for {msg.num_tokens} "
                                            f"tokens, expected {self.token_bytes} per token", fatal=True)
            bs = self.layout.block_size
            n_blocks = -(-msg.num_tokens // bs)
            hashes = self.reusable(msg.block_hashes, msg.num_tokens) if msg.block_size == bs else []
            try:
                reused, blocks = await self.loop.call(
                    lambda: hold_prefix_then_allocate(self.engine.block_manager, hashes, n_blocks))
            except OutOfBlocks:
                return SlotGrant(rid, error="no free KV blocks yet")
            if rid in self.cancelled or rid in self.landings:  # cancelled, or a duplicate grant won, meanwhile
                await self.loop.call(lambda: self.engine.block_manager.release(reused + blocks))
                if rid in self.cancelled:
                    return SlotGrant(rid, error="request cancelled", fatal=True)
            else:
                self.landings[rid] = Landing(reused + blocks, msg.num_tokens,
                                             msg.total_bytes - len(reused) * bs * self.token_bytes, reused=len(reused))
                self.counted_reuse(len(reused))
                self._spawn(self._prefault(blocks))  # while its bytes are on the wire (a no-op once warm)
            landing = self.landings[rid]
        reused_tokens = landing.reused * self.layout.block_size
        landing.last_activity = time.monotonic()
        if msg.ask in landing.asks:  # our answer to this ask came too late for prefill (a busy host): the same
            held = self.slots.held_by(rid)  # slots again, none more (they stay lent until filled or dropped)
            again = [s for s in landing.asks[msg.ask] if s[0] in held]
            if again:
                return SlotGrant(rid, self.endpoint, again, reused_tokens=reused_tokens)
        granted = [[s.slot_id, s.addr, s.nbytes] for s in self.slots.acquire(max(0, msg.max_slots), owner=rid)]
        if msg.ask and granted:
            landing.asks[msg.ask] = granted
        return SlotGrant(rid, self.endpoint, granted, reused_tokens=reused_tokens)

    def reusable(self, block_hashes: list, num_tokens: int) -> list:
        """The hashes a grant may match: the prompt's leading full blocks, never the last token's block (at least
        one write: the request's last token); none when reuse is off."""
        return block_hashes[:(num_tokens - 1) // self.layout.block_size] if self.reuse else []

    def counted_reuse(self, reused: int) -> None:
        if reused:
            self.reuse_counters["reuse_grants"] += 1
            self.reuse_counters["reused_blocks"] += reused

    async def check_reused(self, landing: Landing, msg: HandoffDone) -> None:
        """The blocks we granted as already held must hold exactly this prompt's leading tokens (under its
        tenant's namespace): else the request is refused (prefill fails it with a 503 that the router retries)
        and those blocks leave our prefix index, so the retry moves the whole prompt."""
        engine, held = self.engine, landing.blocks[:landing.reused]
        seed = engine.kv_namespace(msg.tenant).seed if msg.tenant else None
        reason = await self.loop.call(lambda: engine.block_manager.prefix_error(held, msg.prompt_ids, seed))
        if reason is None:
            return
        self.reuse_counters["reuse_mismatches"] += 1
        await self.loop.call(lambda: engine.block_manager.unindex(held))
        log.warning("retained prefix does not match the prompt: request failed, those blocks forgotten",
                    request_id=msg.request_id, reason=reason)
        await self.drop(msg.request_id)
        raise Refused(f"retained prefix mismatch ({reason})")

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _prefault(self, blocks: list[int]) -> None:
        """Fault a landing's blocks in while its bytes are on the wire (kernels.cpu_prefault.prefault: changes no
        byte, so it may race anything; ~free once they are resident). KV pages come from calloc, so a block
        never written since start-up costs ~1 page fault per 4 KiB on first write: a scatter of 8 MB into
        fresh blocks took 30-150 ms, into resident ones 3 ms (2-core box). Only the landing's blocks: the
        pool is never committed up front (shared/kv_layout.py)."""
        pages = self.engine.pages  # one per context-parallel rank (decode.dcp), else one
        if pages[0].device.type == "cpu":
            await self.loop.run_in_worker(lambda: [prefault(p, blocks) for p in pages])

    async def filled(self, msg: SlotsFilled, raw=None) -> Ack:
        with tracer.start_as_current_span("decode.scatter", context=_parent(raw), attributes={
                "request_id": msg.request_id, "pieces": len(msg.pieces)}) as span:
            ack = await self._filled(msg)
            span.set_attribute("bytes", sum(p[2] for p in msg.pieces) if ack.ok else 0)
            span.set_attributes({k: v for k, v in ack.stats.items() if k == "verify_ms"})
            if not ack.ok:
                span.set_status(Status(StatusCode.ERROR, ack.error))
            return ack

    async def _filled(self, msg: SlotsFilled) -> Ack:
        rid = msg.request_id
        landing = self.landings.get(rid)
        if landing is None:
            if self.slots.release_owner(rid):
                self._freed()
            return Ack(rid, False, "unknown or cancelled request")
        t, timing = time.perf_counter(), {"verify_ms": 0.0}
        try:
            for piece in parse(msg.pieces, msg.crcs):
                self._check_piece(rid, landing, piece)
                landing.received[piece.offset] = piece.nbytes
                landing.scattering += 1
                try:
                    reason = await self.loop.run_in_worker(lambda: self._verify_and_scatter(piece, landing, timing))
                finally:
                    landing.scattering -= 1
                if landing.dropped:
                    await self._free_if_idle(landing)
                    return Ack(rid, False, "request cancelled")
                if reason is not None:
                    return await self._refuse(rid, reason)
                self.checks.verified += 1
                self._seam(landing, piece)
                landing.received_bytes += piece.nbytes
                if landing.received_bytes == landing.total_bytes:
                    landing.settled.set()
        except Unverified as e:
            self.checks.unverified += 1
            log.warning("handoff refused: no checksums", request_id=rid)
            await self.drop(rid)
            return Ack(rid, False, str(e))
        except ValueError as e:
            return Ack(rid, False, str(e))
        finally:
            if self.slots.release([p[0] for p in msg.pieces if isinstance(p, (list, tuple)) and p and type(p[0]) is int],
                                  owner=rid):
                self._freed()
        landing.last_activity = time.monotonic()
        return Ack(rid, True, stats={"scatter_ms": (time.perf_counter() - t) * 1e3, **timing})

    def _check_piece(self, rid: str, landing: Landing, piece: Piece) -> None:
        """A piece must be one of rid's slots, within the request's bytes, and overlap no other piece."""
        first = landing.reused * self.layout.block_size * self.token_bytes  # the reused blocks' bytes are not sent
        if piece.slot_id not in self.slots.held_by(rid) or not 0 < piece.nbytes <= self.slots.slot_bytes \
                or piece.offset < first or piece.offset + piece.nbytes > first + landing.total_bytes \
                or landing.overlaps(piece.offset, piece.nbytes):
            raise ValueError(f"bad piece {piece.slot_id, piece.offset, piece.nbytes}")

    def _whole_tokens(self, piece: Piece) -> tuple[int, int]:
        """[first, end) of the tokens whose bytes lie entirely inside the piece."""
        tb = self.token_bytes
        return -(-piece.offset // tb), (piece.offset + piece.nbytes) // tb

    def _verify_and_scatter(self, piece: Piece, landing: Landing, timing: dict) -> str | None:
        """Worker thread: check the landed slot against its checksum, and only then scatter its whole tokens."""
        landed = self.slots.view(piece.slot_id, piece.nbytes)
        self.faults.apply(landed)
        t = time.perf_counter()
        reason = verify(landed, piece)
        timing["verify_ms"] += (time.perf_counter() - t) * 1e3
        first, end = self._whole_tokens(piece)
        if reason is None and end > first:
            lo = first * self.token_bytes - piece.offset
            rows = landed[lo:lo + (end - first) * self.token_bytes]
            if rows.data_ptr() % self.layout.elem_bytes:  # a slot size that is no multiple of the element size
                rows = rows.clone()
            with copy_threads(self.copy_threads or torch.get_num_threads()):
                self._scatter(rows.view(self.layout.dtype), landing.blocks, end - first, first)
        return reason

    def _scatter(self, rows: torch.Tensor, blocks: list[int], count: int, first: int) -> None:
        """Tokens [first, first + count) (rows, token-major) into the pages. With context-parallel ranks
        (decode.dcp = C) token t goes to rank t % C's page at local position t // C: each rank's tokens are every
        C-th row, consecutive local positions there (shared/engine/context_parallel.py)."""
        pages = self.engine.pages
        if len(pages) == 1:
            self.copies.scatter(rows, pages[0], blocks, count, first)
            return
        C = len(pages)
        flat = rows.view(count, -1)
        for r in range(C):
            skip = (r - first) % C
            if skip < count:
                mine = flat[skip::C].contiguous()
                self.copies.scatter(mine.view(-1), pages[r], blocks, mine.shape[0], (first + skip) // C)

    def _seam(self, landing: Landing, piece: Piece) -> None:
        """Event loop, after the piece verified: its bytes of tokens cut by its edges go to the seam
        buffers; a token whose bytes are then all there is scattered (one token, microseconds)."""
        tb = self.token_bytes
        landed = self.slots.view(piece.slot_id, piece.nbytes)
        cut = {piece.offset // tb} if piece.offset % tb else set()
        if (piece.offset + piece.nbytes) % tb:
            cut.add((piece.offset + piece.nbytes) // tb)
        for tok in sorted(cut):  # never one of the piece's whole tokens (_whole_tokens)
            lo, hi = max(piece.offset, tok * tb), min(piece.offset + piece.nbytes, (tok + 1) * tb)
            seam = landing.seams.setdefault(tok, [0, torch.empty(tb, dtype=torch.uint8)])
            seam[1][lo - tok * tb:hi - tok * tb] = landed[lo - piece.offset:hi - piece.offset]
            seam[0] += hi - lo
            if seam[0] == tb:
                self._scatter(seam[1].view(self.layout.dtype), landing.blocks, 1, tok)
                del landing.seams[tok]

    async def _refuse(self, rid: str, reason: str) -> Ack:
        """A landed piece failed its checksum: nothing of this request is adopted, its KV and slots go back."""
        self.checks.failures += 1
        log.warning("handoff checksum mismatch: request failed, its KV freed", request_id=rid, reason=reason)
        await self.drop(rid)
        return Ack(rid, False, MISMATCH)

    async def take_when_landed(self, msg: HandoffDone, timeout_s: float = 30.0) -> Landing:
        """`take`, once every byte of the request has landed (HandoffDone races the last SlotsFilled) and the
        blocks it reused hold its prompt's prefix; raises like `take` when the landing is unknown, was dropped
        meanwhile, or is still incomplete after timeout_s, and Refused when the prefix differs."""
        rid = msg.request_id
        landing = self.landings.get(rid)
        if landing is None:
            raise KeyError(rid)
        if not landing.settled.is_set():  # (no await at all when it has: nothing can come in between)
            try:
                await asyncio.wait_for(landing.settled.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass  # take() says what is missing
        if landing.reused and not landing.dropped and landing.received_bytes == landing.total_bytes:
            await self.check_reused(landing, msg)
        return self.take(rid)

    def take(self, rid: str) -> Landing:
        """Hand a complete landing's blocks to the caller (the engine adopts them)."""
        landing = self.landings.get(rid)
        if landing is None:
            raise KeyError(rid)
        if landing.received_bytes != landing.total_bytes:
            raise ValueError(f"incomplete KV: {landing.received_bytes} of {landing.total_bytes} bytes landed")
        if self.slots.release_owner(rid):
            self._freed()
        return self.landings.pop(rid)

    async def drop(self, rid: str) -> bool:
        """Cancel: remember the id, free the slots and (once no scatter uses them) the blocks of a
        landing in progress. True if there was one."""
        self.cancelled[rid] = None
        while len(self.cancelled) > _CANCELLED_MEMORY:
            self.cancelled.popitem(last=False)
        if self.slots.release_owner(rid):
            self._freed()
        landing = self.landings.pop(rid, None)
        if landing is not None:
            landing.dropped = True
            landing.settled.set()
            if not landing.writes_over:
                landing.last_activity = time.monotonic()
                self.quarantine[rid] = landing  # until writes_ended(rid), or expire()
            await self._free_if_idle(landing)
        return landing is not None

    async def writes_ended(self, rid: str) -> None:
        """The sender of a direct handoff will write nothing more into rid's blocks (HandoffDone, or
        PagesReleased after a failure): a dropped landing's blocks can go back now."""
        landing = self.quarantine.pop(rid, None) or self.landings.get(rid)
        if landing is not None:
            landing.writes_over = True
            if landing.dropped:
                await self._free_if_idle(landing)

    async def writer_exited(self, prefill: str) -> list[str]:
        """A prefill's process ended (InstanceExited): it writes nothing more into the blocks it was granted,
        so a dropped landing of its can go back now rather than after transfer.timeout_s (a kill -9 of
        prefill left 624 tokens quarantined past the fault suite's quiet window). Its landings not yet
        dropped stay until their router's Cancel drops them; their writes are over either way. A restarted
        prefill of that name cannot hold a grant yet: its exit is announced within milliseconds, its
        successor starts after a backoff and a model load."""
        ended = [rid for rid, l in (*self.landings.items(), *self.quarantine.items()) if l.writer == prefill]
        for rid in ended:
            await self.writes_ended(rid)
        return ended

    async def _free_if_idle(self, landing: Landing) -> None:
        if landing.scattering == 0 and landing.writes_over and landing.blocks:
            blocks, landing.blocks = landing.blocks, []
            await self.loop.call(lambda: self.engine.block_manager.release(blocks))
            self._freed()

    async def expire(self, timeout_s: float) -> list[str]:
        """Drops landings idle for timeout_s (returns their ids), and frees the blocks of dropped direct
        landings whose sender said nothing for as long (it died mid-handoff: no write of it is still coming)."""
        now = time.monotonic()
        stale = [rid for rid, l in self.landings.items() if now - l.last_activity > timeout_s]
        for rid in stale:
            await self.drop(rid)
        for rid in [rid for rid, l in self.quarantine.items() if now - l.last_activity > timeout_s]:
            await self.writes_ended(rid)
        return stale

    def next_expiry(self, timeout_s: float) -> float:
        """When (monotonic) `expire(timeout_s)` may next drop something: the idlest landing's deadline, else
        `timeout_s` from now (a landing made later expires later than that)."""
        idle = [l.last_activity for l in (*self.landings.values(), *self.quarantine.values())]
        return min(idle, default=time.monotonic()) + timeout_s

    @property
    def reserved_tokens(self) -> int:
        return sum(len(l.blocks) for l in (*self.landings.values(), *self.quarantine.values())) * self.layout.block_size

