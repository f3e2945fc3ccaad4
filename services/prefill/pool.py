"""Prefill's pool connector: restore a request's history from the shared pool before computing it,
and save new full chunks after, without ever serving bytes it did not verify.

Restore (before the request enters the engine): match the device prefix; look up the next chunks in
the pool (a chunk counts only if every stage holds its object, errors count as "not now"); read them
zero-copy into fresh blocks; verify header and checksum; register them in the device prefix index. A
chunk that fails ends the restore there: later tokens are computed.
- In place (CPU pages, `restore_in_place`, the default): the pages are registered with the pool client,
  and each object is read in pieces (`get_into_pieces`): its header into a small registered buffer, its
  payload (the chunk's blocks, block-major, as pack_chunk wrote them) straight into the chunk's fresh
  blocks. Verifying is then the CRC-32C of those blocks' bytes, in place: no unpack, no copy.
- Else (pages elsewhere, or `transfer.register_pages` false): the objects are read whole into a registered
  buffer, then unpacked into the blocks (shared/device_staging.py): for host pages by kernels' unpack_chunk_crc,
  which computes the checksum as it copies (one pass); for foreign pages through a scratch buffer on their
  device, the checksum computed over the read buffer while the bytes go to the device.
Who reads: prefill's own Transfer Engine (`restore_direct_reads`, shared/pool_reads.py: the store client's
reads busy-poll a core), or the store client.
Reads are pipelined: one worker thread reads the batches back to back, each into the second of two
registered buffers (headers, or whole objects) while the batch before is verified in one worker call.
Either way a chunk's blocks are written before its verdict is known: a chunk that fails leaves them
unregistered, and they go back to the free list with the rest of the restore's unused blocks. Only
verified chunks' blocks ever enter the prefix index.
Save (after the first token, deferred to idle time, batched: services/prefill/pool_save.py): every full
prompt chunk the pool lacks is packed per stage and put with the chunk's digest as its group id (a
chunk's stages are evicted together). The blocks being saved hold a reference of their own until the
save ends.
Disk tier (`disk`, services/prefill/disk_loads.py): chunks the pool lacks but a store's disk holds are put
back into the pool by that store during the lookup, then restored as any hit.
Each request's chunks are named in its tenant's KV namespace (shared/kv_tenant.py): hashes, keys and
headers, so one tenant never restores another's KV.
Compact objects (`pool.dtype = "bfloat16"` or `"float8_e4m3fn"` on float32 KV): the save's pack rounds to
that type and the restore's unpack widens back, both in the copy kernels' one pass, with the CRC over the
bytes stored; such objects are never read in place, and their namespace carries the dtype (`-bf16`, `-fp8`),
so a lossless prefill (or one of the other compact type) never takes them for its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass, field

import torch

from kernels.cpu_kv import threads as copy_threads
from shared.engine.block_manager import OutOfBlocks
from shared.engine.engine import Engine
from shared.engine.loop import EngineLoop
from shared.hashing import chunk_hashes
from services.prefill.config import POOL_DTYPES
from services.prefill.pool_save import PoolSaver, finish_in_thread
from shared.block_crcs import blocks_crc
from shared.device_staging import KVStaging, host_buffer, registrable
from shared.kv_object import HEADER_BYTES, ObjectSpec, object_key, verify, verify_header
from shared.kv_tenant import KVNamespace
from shared.page_writes import to_runs
from shared.pool_reads import DirectReads
from shared.logging import get_logger
from shared.tracing import get_tracer
from shared.transfer import KVTransport

tracer = get_tracer("moorage.prefill.pool")
log = get_logger("prefill.pool")


def batch_plan(chunks: int, size: int) -> list[tuple[int, int]]:
    """(first chunk, count) of each batched read: batches of `size`, but the last chunk is a batch of its
    own. Nothing overlaps the last batch's verify + unpack, so it should be short: one chunk (~2-4 ms)
    rather than `size` (measured 13 ms of a 2K restore's ~100 ms), for one more read call."""
    plan = [(b0, min(size, chunks - b0)) for b0 in range(0, chunks, size)]
    if plan and plan[-1][1] > 1:
        b0, n = plan.pop()
        plan += [(b0, n - 1), (b0 + n - 1, 1)]
    return plan


@dataclass
class Restored:
    pinned: list[int]             # block references handed to the engine with the request
    token_range: tuple[int, int]  # prompt tokens restored from the pool
    stats: dict = field(default_factory=dict)


@dataclass
class BatchDone:
    good: int                     # leading chunks of the batch verified and unpacked
    stage_ms: list[float]         # verify + unpack time per stage
    failed: tuple | None = None   # (key, reason or read code, True if verification refused it)


class PoolConnector:
    def __init__(self, client, engine: Engine, loop: EngineLoop, settings, on_store_event=None, copy_threads: int = 0,
                 transport: KVTransport | None = None, register_pages: bool = True):
        """transport: prefill's Transfer Engine; with settings.restore_direct_reads restores read through it
        (shared/pool_reads.py), else through the store client. register_pages false (transfer.register_pages):
        the engine's pages are never registered, so restores land in the read buffers and are unpacked, and
        saves and restores copy KV through a scratch buffer as from a device's pages."""
        self.client, self.engine, self.loop, self.settings = client, engine, loop, settings
        self.copy_threads = copy_threads or torch.get_num_threads()  # an unpack's (it overlaps the next read)
        self.bm, self.layout = engine.block_manager, engine.layout
        self.stages = self.layout.stages
        # compact objects (pool.dtype): the KV converted to a narrower type in the pack/unpack kernels, under a
        # namespace of their own (their bytes mean something else); else the pages' bytes as they are
        self.pool_dtype = getattr(torch, settings.dtype) if settings.dtype else self.layout.dtype
        self.converts = self.pool_dtype != self.layout.dtype
        self.ns_suffix = f"-{POOL_DTYPES[settings.dtype]}" if self.converts else ""
        pool_elem = torch.empty((), dtype=self.pool_dtype).element_size()
        self.payload = [self.layout.chunk_payload_bytes(s) // self.layout.elem_bytes * pool_elem
                        for s in range(self.stages)]
        self.obj_bytes = [HEADER_BYTES + p for p in self.payload]
        self.chunk_bytes = sum(self.obj_bytes)
        self.chunk = self.layout.chunk_tokens
        self.blocks_per_chunk = self.chunk // self.layout.block_size
        self.min_restore = max(self.chunk, settings.min_restore_tokens)  # at least one chunk
        self.register_pages = register_pages
        self.copies = KVStaging(engine.pages, register_pages)  # restore buffers -> pages (the saver has its own)
        # two read buffers: batch i+1 is read into one while batch i is verified (and unpacked) from the other
        self.in_place = (settings.restore_in_place and registrable(engine.pages, register_pages)
                         and not self.converts)  # compact objects are widened as they are unpacked
        per_batch = settings.restore_batch_chunks * (self.stages * HEADER_BYTES if self.in_place else self.chunk_bytes)
        self.restore_bufs = [host_buffer(per_batch, engine.pages[0].device) for _ in range(2)]
        for buf in self.restore_bufs:
            client.register(buf)
        if self.in_place:  # reads land in the blocks themselves
            self.block_bytes = [self.layout.stage_block_bytes(s) for s in range(self.stages)]
            self.page_bytes = [p.view(p.shape[0], -1).view(torch.uint8) for p in engine.pages]
            for p in engine.pages:
                client.register(p)
        # who reads: the store client, or prefill's own engine (every buffer a read lands in registered with it)
        self.reads = client
        if transport is not None and settings.restore_direct_reads:
            for t in self.restore_bufs + (list(engine.pages) if self.in_place else []):
                if not transport.covers(t):
                    transport.register(t)
            self.reads = DirectReads(client, transport)
        self.restore_lock = asyncio.Lock()
        self.counters = {"restored_chunks": 0, "restored_bytes": 0, "verify_failures": 0, "saved_chunks": 0,
                         "saved_pinned_chunks": 0, "save_turn_unknown": 0, "save_skipped": 0, "save_failures": 0,
                         "lookup_errors": 0}
        self.saver = PoolSaver(self, on_store_event)
        self.disk = None  # services/prefill/disk_loads.py DiskLoader, when the stores' disk tier is used

    def keys(self, digest: bytes, ns: KVNamespace) -> list[str]:
        return [object_key(ns.name + self.ns_suffix, s, self.stages, digest) for s in range(self.stages)]

    def spec(self, digest: bytes, stage: int, ns: KVNamespace) -> ObjectSpec:
        return ObjectSpec(ns.name + self.ns_suffix, digest, stage, self.stages, self.chunk, self.payload[stage])

    async def present(self, digests: list[bytes], ns: KVNamespace) -> list[bool]:
        """Per chunk: every stage's object exists. An error is "not now" (False), never data."""
        keys = [k for d in digests for k in self.keys(d, ns)]
        found = await asyncio.to_thread(self.client.exists, keys) if keys else []
        if any(f is None for f in found):
            self.counters["lookup_errors"] += 1
        S = self.stages
        return [all(f is True for f in found[i * S:(i + 1) * S]) for i in range(len(digests))]

    # ---- restore ---------------------------------------------------------------------------------
    async def restore(self, request_id: str, prompt: list[int], trace_ctx, tenant: str = "",
                      keep: set[bytes] | None = None) -> Restored:
        """The blocks this request starts from, each with a reference it hands to the engine: the
        chunks restored from the pool on top of the device prefix when that is worth it, else the
        device prefix alone. Either way they are pinned until the engine admits the request, so that
        other requests cannot evict them meanwhile. (Nothing is pinned while waiting for the restore
        lock: a pin held there could starve the restore that holds the lock of blocks.)
        keep (a prefetch): restore without waiting, only into blocks that hold nothing cached or hold a
        block whose hash is not kept (the KV of sessions expected back sooner)."""
        usable = (len(prompt) - 1) // self.chunk  # leave a token to compute: its logits pick the next
        outcome = {"request_id": request_id, "prompt_tokens": len(prompt)}
        ns = self.engine.kv_namespace(tenant)
        with tracer.start_as_current_span("store.lookup", context=trace_ctx) as span:
            match = await self.loop.call_now(
                lambda: self.bm.match_prefix(prompt, max_tokens=len(prompt) - 1, seed=ns.seed))
            c0 = match.num_tokens // self.chunk
            outcome.update(device_tokens=match.num_tokens, candidate_chunks=max(0, usable - c0))
            span.set_attributes(outcome)
            if (usable - c0) * self.chunk < self.min_restore:
                return await self._device_only("nothing_to_restore", prompt, outcome, ns)
            digests = chunk_hashes(prompt, ns.seed, self.chunk)[:usable]
            present = await self.present(digests[c0:], ns)
            if self.disk is not None and not all(present):  # the chunks a store's disk holds: back into the pool
                present = await self.disk.load([self.keys(d, ns) for d in digests[c0:]], present, trace_ctx)
            hits = next((i for i, p in enumerate(present) if not p), len(present))
            outcome["hit_chunks"] = hits
            span.set_attribute("hit_chunks", hits)
            if hits * self.chunk < self.min_restore:
                return await self._device_only("miss", prompt, outcome, ns)
        with tracer.start_as_current_span("store.restore", context=trace_ctx) as span:
            async with self.restore_lock:
                restored = await self._restore(prompt, digests[:c0 + hits], span, ns, keep)
                if restored is not None and self.disk is not None and restored.stats["chunks"] < hits:
                    restored = await self._rest_from_disk(restored, prompt, digests[:c0 + hits], span, ns, keep,
                                                          trace_ctx)
        if restored is None:
            return await self._device_only("no_free_blocks", prompt, outcome, ns)
        outcome["restored_chunks"] = restored.stats["chunks"]
        return self._outcome("restored" if restored.stats["chunks"] == hits else "partial", outcome, restored)

    async def _rest_from_disk(self, restored: Restored, prompt: list[int], digests: list[bytes], span,
                              ns: KVNamespace, keep: set[bytes] | None, trace_ctx) -> Restored:
        """A restore that fell short of its lookup (a store died, or evicted a chunk meanwhile): the chunks
        after the ones that came, as far as a store's disk holds them, are put back into the pool and restored
        on top. Returns the whole restore (its first part's references given back when a second part came)."""
        c = restored.token_range[1] // self.chunk
        rest = [self.keys(d, ns) for d in digests[c:]]
        present = await self.disk.load(rest, [False] * len(rest), trace_ctx, replace=True)
        n = next((i for i, p in enumerate(present) if not p), len(present))
        again = await self._restore(prompt, digests[:c + n], span, ns, keep) if n else None
        if again is None:
            return restored
        await self.loop.call_now(lambda: self.bm.release(reversed(restored.pinned)))
        stats = {k: restored.stats[k] + again.stats[k] for k in ("chunks", "bytes")}
        return Restored(again.pinned, (restored.token_range[0], again.token_range[1]), stats)

    async def _device_only(self, how: str, prompt: list[int], fields: dict, ns: KVNamespace) -> Restored:
        def pin() -> list[int]:
            held = self.bm.match_prefix(prompt, max_tokens=len(prompt) - 1, seed=ns.seed).block_ids
            self.bm.acquire(held)
            return held

        return self._outcome(how, fields, Restored(await self.loop.call_now(pin), (0, 0)))

    def _outcome(self, how: str, fields: dict, restored: Restored) -> Restored:
        """Every restore decision is counted and logged: the first thing to read when reuse is low."""
        self.counters[f"restore_{how}"] = self.counters.get(f"restore_{how}", 0) + 1
        log.info("restore", outcome=how, **fields)
        return restored

    async def _restore(self, prompt: list[int], digests: list[bytes], span, ns: KVNamespace,
                       keep: set[bytes] | None = None) -> Restored | None:
        """Restores chunks after the device prefix, up to len(digests). The device may have changed
        since the lookup (this request may have waited for the lock): start from what it holds now.
        When the free blocks cannot take every hit chunk, wait up to `restore_wait_s` for them (other
        requests finish and hand off; computing those tokens instead would need the same blocks),
        then restore as many chunks as fit (some beat none)."""
        bpc = self.blocks_per_chunk
        deadline = time.monotonic() + self.settings.restore_wait_s

        def reserve(wait: bool) -> tuple[int, list[int], list[int]] | None | bool:
            """Between steps: hold the device prefix we build on, and fresh blocks to restore into.
            False: not all chunks fit yet, ask again later."""
            held = self.bm.match_prefix(prompt, max_tokens=len(digests) * self.chunk, seed=ns.seed).block_ids
            c_start = len(held) // bpc
            prefix = held[:c_start * bpc]
            self.bm.acquire(prefix)  # first: a cached-free prefix block must not count as free below
            want = len(digests) - c_start
            n = min(want, (self.bm.num_free_blocks if keep is None else self.bm.spare_blocks(keep)) // bpc)
            verdict = None
            if wait and keep is None and n < want and want * bpc <= self.bm.num_blocks - len(prefix):
                verdict = False
            elif n * self.chunk >= self.min_restore:
                with contextlib.suppress(OutOfBlocks):
                    return c_start, prefix, self.bm.allocate(n * bpc, keep)
            self.bm.release(reversed(prefix))
            return verdict

        t_wait = time.perf_counter()
        while (reserved := await self.loop.call_now(lambda: reserve(time.monotonic() < deadline))) is False:
            self.saver.block_waiters += 1  # deferred saves holding blocks go now
            try:
                await self.loop.changed(deadline - time.monotonic())  # a step or a release may have freed blocks
            finally:
                self.saver.block_waiters -= 1
        span.set_attribute("block_wait_ms", (time.perf_counter() - t_wait) * 1e3)
        if reserved is None:
            return None
        c0, prefix, fresh = reserved
        digests = digests[c0:c0 + len(fresh) // bpc]
        t0, stage_ms, timing = time.perf_counter(), [0.0] * self.stages, {"read_wait_ms": 0.0}
        counted = dict(getattr(self.reads, "counts", {}))  # DirectReads: objects read each way (restores are serial)
        try:
            good = await self._read_verify(digests, fresh, stage_ms, timing, ns)
        except BaseException:  # nothing is registered; every block we hold goes back
            await self.loop.call_now(lambda: self.bm.release(reversed(prefix + fresh)))
            raise
        kept = fresh[:good * bpc]

        def commit() -> list[int]:
            table = prefix + kept
            if kept:
                self.bm.register_full_blocks(table, prompt, len(table), start_block=len(prefix), seed=ns.seed)
            self.bm.release(reversed(fresh[good * bpc:]))
            return table

        pinned = await self.loop.call_now(commit)
        nbytes = good * self.chunk_bytes
        self.counters["restored_chunks"] += good
        self.counters["restored_bytes"] += nbytes
        span.set_attributes({"chunks": good, "bytes": nbytes, "verify_failures": self.counters["verify_failures"],
                             "ms": (time.perf_counter() - t0) * 1e3, **timing,
                             **{f"read_{k}": n - counted[k] for k, n in getattr(self.reads, "counts", {}).items()},
                             **{f"stage{s}_ms": ms for s, ms in enumerate(stage_ms)}})
        return Restored(pinned, (c0 * self.chunk, (c0 + good) * self.chunk),
                        {"chunks": good, "bytes": nbytes})

    async def _read_verify(self, digests: list[bytes], blocks: list[int], stage_ms: list[float],
                           timing: dict, ns: KVNamespace) -> int:
        """Reads the chunks in batches while earlier batches are verified (and unpacked), in order: a chunk
        counts only when every chunk before it was good; returns how many leading chunks are good
        (restored into their blocks). One worker thread reads every batch back to back, each into the
        restore buffer the batch before last was verified from, as soon as that is free again: no event-loop
        hop between two reads (measured 1-1.5 ms each, 9-15 ms of an 8K restore, when each read was
        started from the loop). timing["read_wait_ms"]: time spent waiting for reads."""
        bpc = self.blocks_per_chunk
        plan = batch_plan(len(digests), self.settings.restore_batch_chunks)
        if not plan:
            return 0
        loop, landed = asyncio.get_running_loop(), asyncio.Queue()
        free, stop = [threading.Event(), threading.Event()], threading.Event()
        for e in free:
            e.set()

        def reader() -> None:
            """Worker thread: batch i is read into buffer i % 2 once batch i - 2 was unpacked from it."""
            for i, (b0, n) in enumerate(plan):
                free[i % 2].wait()
                if stop.is_set():
                    return
                free[i % 2].clear()
                try:
                    got = self._read(digests[b0:b0 + n], blocks[b0 * bpc:(b0 + n) * bpc], i % 2, ns)
                except BaseException as e:  # the restore raises it, in order
                    loop.call_soon_threadsafe(landed.put_nowait, e)
                    return
                loop.call_soon_threadsafe(landed.put_nowait, got)

        reading = asyncio.ensure_future(finish_in_thread(reader))
        good = 0
        try:
            for i, (b0, n) in enumerate(plan):
                t = time.perf_counter()
                got = await landed.get()
                timing["read_wait_ms"] += (time.perf_counter() - t) * 1e3
                if isinstance(got, BaseException):
                    raise got
                done = await finish_in_thread(self._verify, digests[b0:b0 + n], got, i % 2,
                                              blocks[b0 * bpc:(b0 + n) * bpc], ns)
                free[i % 2].set()  # batch i + 2 may be read into it now
                for s, ms in enumerate(done.stage_ms):
                    stage_ms[s] += ms
                if done.failed is not None:
                    key, why, verify_failed = done.failed
                    if verify_failed:
                        self.counters["verify_failures"] += 1
                        log.warning("pool object rejected", key=key, reason=why)
                    else:
                        log.info("pool read failed", key=key, code=why)
                good += done.good
                if done.good < n:
                    break
        finally:  # a read still in flight writes into our buffer: let it end, and let the reader start no other
            stop.set()
            for e in free:
                e.set()
            with contextlib.suppress(Exception):
                await reading
        return good

    def _read(self, digests: list[bytes], blocks: list[int], buf: int, ns: KVNamespace) -> list[int]:
        """In the reader thread: the batched read of these chunks' objects, into restore buffer `buf` (whole,
        or only their headers when the payloads go straight into `blocks`): got per object."""
        if self.in_place:
            return self._read_in_place(digests, blocks, buf, ns)
        keys, addrs, sizes, off, base = [], [], [], 0, self.restore_bufs[buf].data_ptr()
        for d in digests:
            for s, key in enumerate(self.keys(d, ns)):
                keys.append(key), addrs.append(base + off), sizes.append(self.obj_bytes[s])
                off += self.obj_bytes[s]
        return self.reads.get_into(keys, addrs, sizes)

    def _read_in_place(self, digests: list[bytes], blocks: list[int], buf: int, ns: KVNamespace) -> list[int]:
        """Each object read in pieces: its header into restore buffer `buf`, its payload into its chunk's
        blocks of its stage's page (one piece per run of consecutive blocks)."""
        bpc, keys, addrs, sizes = self.blocks_per_chunk, [], [], []
        header = self.restore_bufs[buf].data_ptr()
        for c, d in enumerate(digests):
            runs = to_runs(blocks[c * bpc:(c + 1) * bpc])
            for s, key in enumerate(self.keys(d, ns)):
                base, nb = self.page_bytes[s].data_ptr(), self.block_bytes[s]
                keys.append(key)
                addrs.append([header + len(keys) * HEADER_BYTES - HEADER_BYTES] + [base + b * nb for b, _ in runs])
                sizes.append([HEADER_BYTES] + [n * nb for _, n in runs])
        return self.reads.get_into_pieces(keys, addrs, sizes)

    def _verify(self, digests: list[bytes], got: list[int], buf: int, blocks: list[int],
                ns: KVNamespace) -> "BatchDone":
        """In a worker thread: per chunk, in order, every stage's object read whole and verified (header, and
        the CRC-32C of its payload). Stops at the first chunk that is not good; its blocks then hold bytes
        nobody may use (the caller does not register them)."""
        bpc, S, stage_ms = self.blocks_per_chunk, self.stages, [0.0] * self.stages
        for c, d in enumerate(digests):
            for s in range(S):
                i = c * S + s
                if got[i] != self.obj_bytes[s]:  # gone (store died, evicted) or unreadable: a miss from here on
                    return BatchDone(c, stage_ms, (self.keys(d, ns)[s], got[i], False))
                t = time.perf_counter()
                why = self._check(i, buf, blocks[c * bpc:(c + 1) * bpc], self.spec(d, s, ns))
                stage_ms[s] += (time.perf_counter() - t) * 1e3
                if why is not None:
                    return BatchDone(c, stage_ms, (self.keys(d, ns)[s], why, True))
        return BatchDone(len(digests), stage_ms, None)

    def _check(self, i: int, buf: int, chunk_blocks: list[int], spec: ObjectSpec) -> str | None:
        """Object i of a batch read into restore buffer `buf`, why it is not `spec`'s (None: it is). In place
        its payload is in the chunk's blocks already and its CRC is computed there; else the payload is
        unpacked into them and its CRC computed in the same pass."""
        s = spec.stage
        if self.in_place:  # one thread: beside the next read (and its busy-polling waiter) two were slower,
            # 8.8-23.6 against 5.6-15.7 ms per 2K restore (bench.restore, copy_threads 2 vs 1, same day)
            crc = blocks_crc(self.page_bytes[s], chunk_blocks, 1)
            return verify_header(self.restore_bufs[buf][i * HEADER_BYTES:(i + 1) * HEADER_BYTES], spec, crc)
        lo = i // self.stages * self.chunk_bytes + sum(self.obj_bytes[:s])
        obj = self.restore_bufs[buf][lo:lo + self.obj_bytes[s]]
        with copy_threads(self.copy_threads):
            crc = self.copies.unpack_crc(obj[HEADER_BYTES:].view(self.pool_dtype), self.engine.pages[s],
                                         chunk_blocks)
        return verify(obj, spec, payload_crc=crc)

    # ---- save (services/prefill/pool_save.py) -------------------------------------------------------
    def hold_for_save(self, prompt: list[int], block_table: list[int]) -> list[int]:
        """Called on the event loop between steps: pins the prompt's full-chunk blocks for its save."""
        return self.saver.hold(prompt, block_table)

    async def save(self, request_id: str, prompt: list[int], blocks: list[int], trace_ctx,
                   tenant: str = "", session: str | None = None) -> None:
        """Saves the chunks the pool lacks (deferred, batched) and releases `blocks` exactly once; `session`:
        the turn's end decides their soft pin (pool_save.py)."""
        await self.saver.save(request_id, prompt, blocks, trace_ctx, tenant, session)
