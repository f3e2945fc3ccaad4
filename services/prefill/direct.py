"""Prefill's direct handoff: the KV goes from prefill's pages straight into decode's, no copy on either side.

Both page sets are block-major and registered with their Transfer Engines (decode's: services/decode/
direct.py), so when both engines' blocks have the same layout (`KVLayout.block_layout`) a request's
blocks are moved as they are:

1. PagesRequest -> decode allocates the request's blocks and answers with their addresses (runs of
   consecutive blocks). Short of blocks it holds the request a while and answers when room comes back.
   It goes out early (`pre_grant`) once the engine starts the step that completes the prompt and the
   decode is known, so its round trip overlaps that forward pass; `send` then finds the grant in. A grant
   older than half of transfer.timeout_s is asked for again (decode answers with the same blocks and
   restarts its idle clock). A request that ends without `send` gives an early grant back (`release`).
2. One batched Transfer Engine write of every run (shared/page_writes.py: usually one or a few spans,
   cut every 4 MiB); meanwhile a second thread computes the CRC-32C of each write (read-only, in place).
   With transfer.early_verify (on by default except over tcp), writes the engine reports complete while
   others are still on the wire go to decode in PagesLanded (with their CRCs, once the CRC thread has
   them), so decode verifies them beside the rest of the write. Over tcp the CPUs copy the bytes: a verify
   beside them slowed the write by 24-45% at 94-377 MB (bench/handoff.py, mode direct-early; within the
   noise at 8-34 MB), more than the verify after it costs, so there decode checks every write at HandoffDone.
3. HandoffDone carries the writes and their checksums (encoded while the write runs, once the CRC
   thread has them: it goes out the moment the write ends); decode verifies the blocks it has not verified yet
   before it adopts the request (a mismatch refuses it: HandoffFailed, a 503 the router retries once),
   and the Ack ends it.

Replaces the staged path (services/prefill/handoff.py: gather into staging buffers, landing slots,
scatter), which stays for decodes that answer `unsupported` and for transfer.direct = false.

A handoff that fails or is cancelled after its grant sends PagesReleased (asked until acknowledged,
services/prefill/release.py) once its write thread has ended: decode keeps a dropped request's granted
blocks out of use until then (or transfer.timeout_s), so a late write can never land in blocks another
request has been given.

Tracing: the caller's `kv.handoff` span is current; the write is one `kv.write` span, decode's grant a
`decode.page_grant` span; HandoffDone goes out under `done_context` like the staged path's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Sequence

import torch
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry import context as otel_context

from services.prefill.handoff import HandoffFailed, HandoffStats, _finish_thread, send_done
from services.prefill.release import GrantReleases
from shared.bus import Bus
from shared.block_crcs import BlockCRCs
from shared.device_staging import registrable
from shared.kv_layout import KVLayout
from shared.messages import HandoffDone, PagesGrant, PagesLanded, PagesRequest
from shared.page_writes import CHECK_BYTES, PageWrite, expand_runs, plan
from shared.tracing import get_tracer
from shared.transfer import KVTransport, TransferConfig

tracer = get_tracer("moorage.prefill.direct")


async def _settled(*tasks: asyncio.Future) -> None:
    """Until every task has ended, whatever cancels the caller meanwhile (that cancel is raised after)."""
    rest = asyncio.gather(*tasks, return_exceptions=True)
    cancelled = False
    while not rest.done():
        try:
            await asyncio.shield(rest)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


class _Landed:
    """Indices of the writes the engine reports complete, from the writing thread to the event loop: the
    loop is woken once per batch that comes in, not once per write."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock, self.ready = loop, threading.Lock(), asyncio.Event()
        self.items: list[int] = []
        self.ended = False

    def add(self, i: int) -> None:
        """Writing thread: write i is complete at the peer."""
        with self.lock:
            self.items.append(i)
            wake = len(self.items) == 1
        if wake:
            self.loop.call_soon_threadsafe(self.ready.set)

    def end(self) -> None:
        """Event loop: the write has returned: `next` answers [] from now on."""
        self.ended = True
        self.ready.set()

    async def next(self) -> list[int]:
        """The writes completed since the last call (waiting for one), or [] once the write has ended (what
        came in last is left to HandoffDone, which goes out next)."""
        while not self.ended:
            await self.ready.wait()
            self.ready.clear()
            with self.lock:
                items, self.items = self.items, []
            if items and not self.ended:  # none: a wake-up for items an earlier call already took
                return items
        return []


class DirectSender:
    def __init__(self, bus: Bus, instance: str, layout: KVLayout, pages: list[torch.Tensor],
                 transport: KVTransport, config: TransferConfig, generation: Sequence[int]):
        """generation: the block manager's (each block's allocation count): full blocks' CRCs are kept
        while it stays the same."""
        self.bus, self.instance, self.layout, self.pages = bus, instance, layout, pages
        self.transport, self.config = transport, config
        self.enabled = config.direct and registrable(pages, config.register_pages)
        if self.enabled:
            for p in pages:
                transport.register(p)
        self.crcs = BlockCRCs(pages, generation) if self.enabled else None
        self.reuse = self.enabled and config.decode_reuse  # send the prompt's block hashes: decode may hold some
        self.releases = GrantReleases(bus, config.timeout_s)

    def pre_grant(self, decode: str, request_id: str, num_tokens: int,
                  context: otel_context.Context | None = None, block_hashes: list = ()) -> asyncio.Task | None:
        """Ask `decode` for the request's blocks now, as a task (`context`: the grant's trace parent); give
        the task to `send(early=...)`, or to `release` if the request ends without a handoff."""
        if not self.enabled:
            return None
        token = otel_context.attach(context) if context is not None else None
        try:  # the task copies the current context
            return asyncio.create_task(self._timed_grant(decode, request_id, num_tokens, block_hashes))
        finally:
            if token is not None:
                otel_context.detach(token)

    async def release(self, decode: str, request_id: str, early: asyncio.Task | None = None) -> None:
        """Prefill writes nothing into the request's granted blocks (the request ended without `send`, or
        send failed): decode may give them to others. A release that overtakes the grant (`early`, still
        being asked for) is safe: decode then refuses or undoes it. Returns at once; the release is asked
        until decode acknowledges it (services/prefill/release.py)."""
        if early is not None:
            early.cancel()
        self.releases.release(decode, request_id)

    async def close(self) -> None:
        await self.releases.close()

    async def send(self, decode: str, request_id: str, block_table: list[int], num_tokens: int,
                   done: HandoffDone, done_context: otel_context.Context | None = None,
                   early: asyncio.Task | None = None, block_hashes: list = ()) -> HandoffStats | None:
        """Moves the KV of tokens [0, num_tokens) into `decode`'s pages and hands the request over; None
        (nothing done) when that decode takes no direct writes: use the staged sender. `early`: this
        request's `pre_grant` task (send owns it from here). `block_hashes`: the prompt's full blocks'
        (transfer.decode_reuse): decode may answer that it holds the leading ones, which are then not sent."""
        if not self.enabled:
            return None
        n_blocks = -(-num_tokens // self.layout.block_size)
        t, completed = time.perf_counter(), False
        try:
            grant, at = await (early if early is not None
                               else self._timed_grant(decode, request_id, num_tokens, block_hashes))
            if grant is not None and time.monotonic() - at > self.config.timeout_s / 2:
                grant = await self._grant(decode, request_id, num_tokens, block_hashes)  # it restarts its idle clock
            if grant is None:
                completed = True  # decode allocated nothing
                return None
            stats = HandoffStats(mode="direct", grant_ms=(time.perf_counter() - t) * 1e3,
                                 early_grant=early is not None, reused_blocks=grant.reused)
            k = grant.reused  # decode holds blocks [0, k) of this prompt already: only the rest is written
            if not 0 <= k < n_blocks or k * self.layout.block_size > num_tokens:
                raise HandoffFailed(f"decode claims {k} held blocks of a {n_blocks}-block prompt")
            addrs = expand_runs(grant.runs, n_blocks - k, grant.block_bytes)
            writes = [dataclasses.replace(w, first=w.first + k)
                      for w in plan(block_table[k:n_blocks], addrs, self.layout, CHECK_BYTES)]
            srcs = [self.pages[w.stage].data_ptr() + w.src_block * self.layout.stage_block_bytes(w.stage)
                    for w in writes]
            dsts = [addrs[w.first - k] + w.offset for w in writes]
            lengths = [w.nbytes for w in writes]
            stats.bytes, stats.writes, stats.rounds = sum(lengths), self._batches(len(writes)), 1
            done.handoff = {"bytes": stats.bytes, "writes": stats.writes, "rounds": 1, "mode": "direct",
                            "entries": len(writes), "reused_blocks": k}
            t = time.perf_counter()
            with tracer.start_as_current_span("kv.write", attributes={
                    "round": 0, "writes": len(writes), "bytes": sum(lengths), "endpoint": grant.endpoint}):
                crcs = asyncio.ensure_future(_finish_thread(self._checksums, writes,
                                                            num_tokens // self.layout.block_size))
                landed = _Landed(asyncio.get_running_loop()) if len(writes) > 1 and self.config.verify_while_writing \
                    else None
                wrote = asyncio.ensure_future(_finish_thread(self.transport.write, grant.endpoint, srcs, dsts,
                                                             lengths, landed and landed.add))
                telling = asyncio.ensure_future(self._tell_landed(decode, request_id, writes, crcs, landed)) \
                    if landed is not None else None
                packing = asyncio.ensure_future(self._pack_done(done, writes, crcs))
                packing.add_done_callback(lambda f: f.cancelled() or f.exception())  # a failed write leaves it
                try:
                    await asyncio.gather(crcs, wrote)
                finally:  # both threads have ended before anything else happens. Never cancel the two again:
                    # a gather cancelled ends as soon as one child has (the checksum), and a second cancel would
                    # cut the other's wait for its thread short (found under load by the mid-write cancel test)
                    await _settled(crcs, wrote)
                    if telling is not None:  # its last PagesLanded goes out before HandoffDone (or PagesReleased)
                        landed.end()
                        await _settled(telling)
            _, stats.crc_ms, stats.crc_reused = crcs.result()
            stats.write_ms = (time.perf_counter() - t) * 1e3
            stats.entry_bytes = lengths
            t = time.perf_counter()
            ack = await send_done(self.bus, decode, await packing, done_context,
                                  time.monotonic() + self.config.timeout_s)
            stats.done_ms = (time.perf_counter() - t) * 1e3
            if not ack.ok:
                raise HandoffFailed(f"decode refused the request: {ack.error}")
            stats.verify_ms = float(ack.stats.get("verify_ms", 0.0))
            stats.verified_early = int(ack.stats.get("verified_early", 0))
            completed = True
            return stats
        finally:
            if not completed:  # failed or cancelled, and no write thread runs any more: decode may reuse the
                # blocks it granted (or drops the grant it is about to make; the request fails anyway)
                await self.release(decode, request_id, early)

    async def _tell_landed(self, decode: str, request_id: str, writes: list[PageWrite], crcs: asyncio.Future,
                           landed: "_Landed") -> None:
        """While the write runs: the writes the engine reports complete go to decode in PagesLanded, as many
        at a time as have come in, once their CRCs are known. Only a head start for decode's verify: a
        failure here changes nothing (HandoffDone lists every write)."""
        subject, sums = self.bus.subjects.decode_pages_landed(decode), None
        while done := await landed.next():
            if sums is None:
                with contextlib.suppress(Exception):
                    sums = (await asyncio.shield(crcs))[0]
                if sums is None:
                    return
            with contextlib.suppress(Exception):
                await self.bus.publish(subject, PagesLanded(request_id, [writes[k].wire(sums[k]) for k in done]))

    async def _pack_done(self, done: HandoffDone, writes: list[PageWrite], crcs: asyncio.Future) -> bytes:
        """HandoffDone with the writes and their CRCs, encoded while the write is on the wire (the CRCs are
        known long before it ends; encoding an 8K prompt's message took ~0.4 ms in situ that the handoff
        then waited for)."""
        sums = (await asyncio.shield(crcs))[0]  # a cancel here never reaches the CRC's thread
        done.pages = [w.wire(c) for w, c in zip(writes, sums)]
        return self.bus.pack(done)

    def _batches(self, n: int) -> int:
        """Transfer Engine calls a write of n spans takes (KVTransport.write batches them)."""
        return -(-n // self.transport.max_batch)

    def _checksums(self, writes: list[PageWrite], full: int) -> tuple[list[int], float, int]:
        """Worker thread: the CRC-32C of each write's source bytes, the ms they took, and how many blocks'
        CRCs came from an earlier handoff (the request's first `full` blocks are completely filled: theirs
        may)."""
        t = time.perf_counter()
        got = [self.crcs.run_crc(w.stage, w.src_block, w.count, max(0, min(w.count, full - w.first)))
               for w in writes]
        return [c for c, _ in got], (time.perf_counter() - t) * 1e3, sum(r for _, r in got)

    async def _timed_grant(self, decode: str, request_id: str, num_tokens: int,
                           block_hashes: list = ()) -> tuple[PagesGrant | None, float]:
        """`_grant`, and the monotonic time it came in."""
        grant = await self._grant(decode, request_id, num_tokens, block_hashes)
        return grant, time.monotonic()

    async def _grant(self, decode: str, request_id: str, num_tokens: int,
                     block_hashes: list = ()) -> PagesGrant | None:
        """Decode's blocks for the request, asking again while it is short of room; None: unsupported."""
        deadline = time.monotonic() + self.config.timeout_s
        hashes = list(block_hashes) if self.reuse else []
        while True:
            try:
                grant = await self.bus.request(self.bus.subjects.decode_pages(decode), PagesRequest(
                    request_id, self.instance, num_tokens, self.layout.block_layout, hashes), PagesGrant)
            except NatsTimeoutError:  # a busy decode answers late, not never: ask again (it grants a request
                if time.monotonic() > deadline:  # id the same blocks each time) until the handoff's deadline
                    raise HandoffFailed("decode did not answer its page request in time") from None
                continue
            if grant.unsupported:
                return None
            if grant.runs:
                return grant
            if grant.fatal or time.monotonic() > deadline:
                raise HandoffFailed(grant.error or "decode granted no KV blocks in time")
            # else decode held the request until its hold time passed: asking again at once is no busy loop
