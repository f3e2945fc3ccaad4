"""Decode's side of the direct handoff: grant blocks of its own pages, verify them, adopt the request.

Prefill writes a request's KV straight into decode's pages (services/prefill/direct.py), so there is
nothing to scatter: decode's pages are registered with its Transfer Engine once, at start.

- `grant` (PagesRequest): allocates the request's blocks into a landing of the zone (services/decode/
  landing.py: cancel, expiry and the KV accounting are the staged path's) and answers with their
  addresses as runs of consecutive blocks. Short of blocks it holds the request up to GRANT_HOLD_S.
  `unsupported` when the block layouts differ, the pages are not in host memory or span several
  stages, or transfer.direct is false: prefill then uses landing slots.
- `land` (HandoffDone with pages): the writes must tile the granted blocks exactly, each within
  consecutive blocks; each write's bytes are checked against its CRC-32C in place, before the engine
  adopts the blocks: in worker threads (shares of the writes in parallel), or on the loop when they are
  8 MiB or less in all (a thread hop costs as much as that CRC). A mismatch drops the
  landing and refuses: never wrong tokens.
- `landed` (PagesLanded): some writes are complete while the rest are on the wire; they are checked at
  once on a thread of their own, and `land` awaits those checks instead of checking them again (a head start:
  the verify overlaps the rest of the write). A write listed there that does not lie within the granted
  blocks is ignored; HandoffDone's tiling check refuses it.
- `released` (PagesReleased): prefill's handoff, direct or staged, ended without HandoffDone; the landing is
  dropped, and the release acknowledged (prefill asks until it is: a bus restart must not leave the blocks held
  to expiry).

A granted landing is `writes_over = False` until HandoffDone or PagesReleased: dropped before that
(cancel, expiry) its blocks wait in the zone's quarantine, so a late write never lands in blocks that
another request has been given since.
"""

from __future__ import annotations

import asyncio
import time

import torch
from opentelemetry.trace import Status, StatusCode

from services.decode.landing import GRANT_HOLD_S, Landing, LandingZone, Refused, hold_prefix_then_allocate
from shared.engine.block_manager import OutOfBlocks
from shared.handoff_check import MISMATCH, checksum
from shared.logging import get_logger
from shared.messages import Ack, HandoffDone, PagesGrant, PagesLanded, PagesReleased, PagesRequest
from shared.page_writes import tiling_error, to_runs
from shared.threads import started_executor
from shared.tracing import extract_context, get_tracer
from shared.transfer import KVTransport

tracer = get_tracer("moorage.decode.direct")
log = get_logger("decode.direct")
# Writes of at most this many bytes in all are verified on the event loop, not in worker threads: at that size
# the hop to the threads and back costs about as much as the CRC itself (the 8 MB handoff's verify_ms on 2
# busy cores, bench/handoff.py: 1.09-1.12 ms in threads, 0.56-0.70 ms inline), and the loop is held < 1 ms.
INLINE_VERIFY_BYTES = 8 << 20


class DirectPages:
    def __init__(self, zone: LandingZone, transport: KVTransport, enabled: bool = True, register_pages: bool = True):
        self.zone, self.layout = zone, zone.layout
        pages = zone.engine.pages
        self.block_bytes = self.layout.block_bytes
        self.threads = max(1, min(4, torch.get_num_threads()))  # verifying a handoff's writes
        self.inline_bytes = INLINE_VERIFY_BYTES
        self._early = started_executor(1, "decode-verify-early")  # checks on PagesLanded
        self.reason = ("transfer.direct is false" if not enabled else
                       "transfer.register_pages is false" if not register_pages else
                       "decode's pages are split between context-parallel ranks" if zone.engine.context is not None else
                       "decode's pages span several stages" if len(pages) != 1 else
                       "decode's pages are not in host memory" if pages[0].device.type != "cpu" else None)
        if self.reason is None:
            transport.register(pages[0])
            self._base = pages[0].data_ptr()
            self._bytes = pages[0].view(-1).view(torch.uint8)

    async def grant(self, msg: PagesRequest, raw=None) -> PagesGrant:
        with tracer.start_as_current_span("decode.page_grant", context=extract_context(getattr(raw, "headers", None)),
                                          attributes={"request_id": msg.request_id, "tokens": msg.num_tokens}) as span:
            reply = await self._grant(msg)
            span.set_attributes({"runs": len(reply.runs), "error": reply.error})
            if reply.fatal:
                span.set_status(Status(StatusCode.ERROR, reply.error))
            return reply

    async def _grant(self, msg: PagesRequest) -> PagesGrant:
        rid, zone = msg.request_id, self.zone
        if self.reason is not None or msg.block_layout != self.layout.block_layout:
            return PagesGrant(rid, error=self.reason or f"block layout {msg.block_layout} differs from decode's "
                                                        f"{self.layout.block_layout}", unsupported=True)
        if msg.num_tokens <= 0:
            return PagesGrant(rid, error=f"bad token count {msg.num_tokens}", fatal=True)
        deadline = time.monotonic() + GRANT_HOLD_S
        n_blocks = -(-msg.num_tokens // self.layout.block_size)
        # leading full blocks we may already hold; the last token's block is always written (at least one write)
        hashes = zone.reusable(msg.block_hashes, msg.num_tokens)
        while rid not in zone.landings:
            if zone.is_cancelled(rid):
                return PagesGrant(rid, error="request cancelled", fatal=True)
            try:
                reused, blocks = await zone.loop.call(
                    lambda: hold_prefix_then_allocate(zone.engine.block_manager, hashes, n_blocks))
            except OutOfBlocks:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return PagesGrant(rid, error="no free KV blocks yet")
                await zone._wait_for_room(remaining, blocks=True)
                continue
            if zone.is_cancelled(rid) or rid in zone.landings:  # cancelled, or a duplicate request won, meanwhile
                await zone.loop.call(lambda: zone.engine.block_manager.release(reused + blocks))
                continue
            zone.landings[rid] = Landing(reused + blocks, msg.num_tokens, len(blocks) * self.block_bytes,
                                         writes_over=False, writer=msg.prefill_instance, reused=len(reused))
            zone.counted_reuse(len(reused))
            zone._spawn(zone._prefault(blocks))  # while prefill reads the grant and starts writing
        landing = zone.landings[rid]
        if landing.writes_over:  # a staged landing of the same id
            return PagesGrant(rid, error="request is already landing through slots", fatal=True)
        landing.last_activity = time.monotonic()
        written = landing.blocks[landing.reused:]
        return PagesGrant(rid, zone.endpoint, [[self._base + b * self.block_bytes, n] for b, n in to_runs(written)],
                          self.block_bytes, reused=landing.reused)

    async def released(self, msg: PagesReleased, raw=None) -> Ack:
        """Acknowledged (prefill asks again until it is): a lost release would hold the blocks until expiry."""
        await self.zone.drop(msg.request_id)
        await self.zone.writes_ended(msg.request_id)
        return Ack(msg.request_id, True)

    async def landed(self, msg: PagesLanded, raw=None) -> None:
        """A head start: check these complete writes now, beside the rest of the write, not at HandoffDone.
        One worker call per message, on one thread for every landing (`_early`): a 2-core host's other
        core is busy receiving the rest of the bytes."""
        landing = self.zone.landings.get(msg.request_id)
        if landing is None or landing.dropped or landing.writes_over:  # gone, taken, or a staged landing
            return
        keys = []
        for w in msg.pages:
            key = tuple(w) if isinstance(w, (list, tuple)) else None
            if key is None or key in landing.checks or key in keys:
                continue
            if self._write_error(landing, key) is None:
                keys.append(key)
        if not keys:
            return
        landing.scattering += 1  # a drop meanwhile frees the blocks only once this check let go of them
        task = asyncio.ensure_future(self._early_checks(landing, keys))
        for j, key in enumerate(keys):
            landing.checks[key] = (task, j)

    async def _early_checks(self, landing: Landing, writes: list[tuple]) -> list[int | str]:
        """Per write, the CRC-32C of its bytes in the pages (compared at HandoffDone), or why it has none."""
        def crcs() -> list[int | str]:
            out = []
            for w in writes:
                try:
                    out.append(self._crc(landing, w))
                except Exception as e:  # noqa: BLE001 - a check that cannot run is a refusal, never a pass
                    out.append(f"{type(e).__name__}: {e}")
            return out

        work = asyncio.get_running_loop().run_in_executor(self._early, crcs)
        try:
            return await asyncio.shield(work)
        finally:  # cancelled (shutdown): the thread still reads the blocks until it ends
            await asyncio.gather(work, return_exceptions=True)
            landing.scattering -= 1
            if landing.dropped:
                await self.zone._free_if_idle(landing)

    def _write_error(self, landing: Landing, w: tuple) -> str | None:
        """Why one write [first, count, offset, nbytes, crc] is not within consecutive granted blocks."""
        if len(w) != 5 or not all(isinstance(x, int) for x in w):
            return "malformed write"
        first, count, offset, nbytes, _ = w
        if first < 0 or count < 1 or first + count > len(landing.blocks) or offset < 0 or nbytes < 0 \
                or offset + nbytes > count * self.block_bytes:
            return "write outside the granted blocks"
        run = landing.blocks[first:first + count]
        return None if run == list(range(run[0], run[0] + count)) else "blocks not consecutive"

    async def land(self, msg: HandoffDone) -> tuple[Landing, dict]:
        """The verified landing, taken from the zone for the engine to adopt, and its timing (verify_ms: the
        wait for verification here; verified_early: writes checked on PagesLanded). Raises KeyError (unknown
        or cancelled) or Refused (the landing is dropped)."""
        rid, zone = msg.request_id, self.zone
        await zone.writes_ended(rid)
        landing = zone.landings.get(rid)
        if landing is None:
            raise KeyError(rid)
        reason = tiling_error(msg.pages, len(landing.blocks), self.block_bytes, landing.reused) \
            or self._consecutive_error(landing, msg)
        if reason is not None:
            await zone.drop(rid)
            raise Refused(reason)
        landing.scattering += 1  # a drop meanwhile frees the blocks only once this check let go of them
        try:
            t = time.perf_counter()
            reason, early = await self._verify(landing, msg.pages)
            timing = {"verify_ms": (time.perf_counter() - t) * 1e3, "verified_early": early}
        finally:
            landing.scattering -= 1
        if landing.dropped:
            await zone._free_if_idle(landing)
            raise KeyError(rid)
        if reason is not None:
            zone.checks.failures += 1
            log.warning("handoff checksum mismatch: request failed, its KV freed", request_id=rid, reason=reason)
            await zone.drop(rid)
            raise Refused(f"{MISMATCH} ({reason})")
        if landing.reused:
            await zone.check_reused(landing, msg)
        zone.checks.verified += len(msg.pages)
        landing.received_bytes = landing.total_bytes
        landing.settled.set()
        return zone.take(rid), timing

    def _consecutive_error(self, landing: Landing, msg: HandoffDone) -> str | None:
        for first, count, *_ in msg.pages:
            run = landing.blocks[first:first + count]
            if run != list(range(run[0], run[0] + count)):
                return f"write over blocks {first}..{first + count - 1} that are not consecutive in decode's pages"
        return None

    async def _verify(self, landing: Landing, writes: list) -> tuple[str | None, int]:
        """(None when every write's bytes in the pages match its checksum, else why not; how many writes a
        PagesLanded had already started checking). Those checks are awaited; the other writes are checked
        here when they are `inline_bytes` or less in all, else in `threads` worker threads at once, in
        shares of about equal bytes (the CRC releases the GIL; prefill cuts long runs into 4 MiB writes
        for this)."""
        early = [landing.checks.get(tuple(w)) for w in writes]
        rest = [i for i, e in enumerate(early) if e is None]
        told = [i for i, e in enumerate(early) if e is not None]
        tasks = list({early[i][0]: None for i in told})
        results = dict(zip(tasks, await asyncio.gather(*tasks)))
        found = [_mismatch(i, writes[i], results[early[i][0]][early[i][1]]) for i in told]
        if sum(writes[i][3] for i in rest) <= self.inline_bytes:
            found.append(self._check(landing, writes, rest))
        else:
            shares = [[rest[j] for j in s] for s in _shares([writes[i][3] for i in rest], self.threads)]
            found += await asyncio.gather(*(self.zone.loop.run_in_worker(lambda s=s: self._check(landing, writes, s))
                                            for s in shares))
        return _first(found), len(told)

    def _check(self, landing: Landing, writes: list, share) -> tuple[int, str] | None:
        """Worker thread: the first of writes[share] whose bytes do not match its checksum, or None."""
        for i in share:
            reason = _mismatch(i, writes[i], self._crc(landing, writes[i]))
            if reason is not None:
                return reason
        return None

    def _crc(self, landing: Landing, write) -> int:
        """Worker thread: the CRC-32C of one write's bytes in the pages (fault injection may flip a byte of
        the handoff's first write, the one at the start of its first block, before)."""
        first_block, _count, offset, nbytes, _crc = write
        lo = landing.blocks[first_block] * self.block_bytes + offset
        view = self._bytes[lo:lo + nbytes]
        if first_block == 0 and offset == 0:
            self.zone.faults.apply(view)
        return checksum(view)


def _mismatch(i: int, write, got: int | str) -> tuple[int, str] | None:
    """(i, why) when write i's bytes (their CRC `got`, or why there is none) do not match its checksum."""
    first, _count, _offset, nbytes, crc = write
    if isinstance(got, str):
        return i, f"write {i} (blocks {first}..) could not be checked: {got}"
    if got != crc:
        return i, f"write {i} (blocks {first}.., {nbytes} bytes): crc32c {got:08x}, prefill sent {crc:08x}"
    return None


def _first(found: list) -> str | None:
    """The reason of the mismatch first in write order, or None."""
    bad = [r for r in found if r is not None]
    return min(bad)[1] if bad else None


def _shares(sizes: list[int], n: int) -> list[range]:
    """Cut indices 0..len(sizes)-1 into at most n consecutive ranges of about equal total size (each item
    goes to the share its midpoint falls in)."""
    total, owner, acc = max(1, sum(sizes)), [], 0
    for size in sizes:
        owner.append(min(n - 1, n * (2 * acc + size) // (2 * total)))
        acc += size
    out, start = [], 0
    for i in range(1, len(owner) + 1):
        if i == len(owner) or owner[i] != owner[i - 1]:
            out.append(range(start, i))
            start = i
    return out
