"""Prefill's pool connector: restore a request's history from the shared pool before computing it,
and save new full chunks after, without ever serving bytes it did not verify.

Restore (before the request enters the engine): match the device prefix; look up the next chunks in
the pool (a chunk counts only if every stage holds its object, errors count as "not now"); read them
zero-copy into a registered buffer; verify header and checksum; unpack into fresh blocks and register
them in the device prefix index. A chunk that fails ends the restore there: later tokens are computed.
Save (after the first token): every full prompt chunk the pool lacks is packed per stage and put with
the chunk's digest as its group id (a chunk's stages are evicted together). The blocks being saved hold
a reference of their own until the save ends.
Each request's chunks are named in its tenant's KV namespace (shared/kv_tenant.py): hashes, keys and
headers, so one tenant never restores another's KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

import torch

from kernels import get_kv_kernels
from shared.engine.block_manager import OutOfBlocks
from shared.engine.engine import Engine
from shared.engine.loop import EngineLoop
from shared.hashing import chunk_hashes
from shared.kv_object import HEADER_BYTES, ObjectSpec, checksum, object_key, verify, write_header
from shared.kv_tenant import KVNamespace
from shared.logging import get_logger
from shared.tracing import get_tracer

tracer = get_tracer("moorage.prefill.pool")
log = get_logger("prefill.pool")


@dataclass
class Restored:
    pinned: list[int]             # block references handed to the engine with the request
    token_range: tuple[int, int]  # prompt tokens restored from the pool
    stats: dict = field(default_factory=dict)


class PoolConnector:
    def __init__(self, client, engine: Engine, loop: EngineLoop, settings, on_store_event=None):
        self.client, self.engine, self.loop, self.settings = client, engine, loop, settings
        self.bm, self.layout = engine.block_manager, engine.layout
        self.stages = self.layout.stages
        self.payload = [self.layout.chunk_payload_bytes(s) for s in range(self.stages)]
        self.obj_bytes = [HEADER_BYTES + p for p in self.payload]
        self.chunk_bytes = sum(self.obj_bytes)
        self.chunk = self.layout.chunk_tokens
        self.blocks_per_chunk = self.chunk // self.layout.block_size
        self.min_restore = max(self.chunk, settings.min_restore_tokens)  # at least one chunk
        self.kernels = get_kv_kernels(engine.pages[0].device)
        self.restore_buf = torch.empty(settings.restore_batch_chunks * self.chunk_bytes, dtype=torch.uint8)
        self.save_buf = torch.empty(self.chunk_bytes, dtype=torch.uint8)
        client.register(self.restore_buf)
        client.register(self.save_buf)
        self.restore_lock, self.save_lock = asyncio.Lock(), asyncio.Lock()
        self.on_store_event = on_store_event
        self.counters = {"restored_chunks": 0, "restored_bytes": 0, "verify_failures": 0, "saved_chunks": 0,
                         "save_skipped": 0, "save_failures": 0, "lookup_errors": 0}

    def _keys(self, digest: bytes, ns: KVNamespace) -> list[str]:
        return [object_key(ns.name, s, self.stages, digest) for s in range(self.stages)]

    def _spec(self, digest: bytes, stage: int, ns: KVNamespace) -> ObjectSpec:
        return ObjectSpec(ns.name, digest, stage, self.stages, self.chunk, self.payload[stage])

    async def present(self, digests: list[bytes], ns: KVNamespace) -> list[bool]:
        """Per chunk: every stage's object exists. An error is "not now" (False), never data."""
        keys = [k for d in digests for k in self._keys(d, ns)]
        found = await asyncio.to_thread(self.client.exists, keys) if keys else []
        if any(f is None for f in found):
            self.counters["lookup_errors"] += 1
        S = self.stages
        return [all(f is True for f in found[i * S:(i + 1) * S]) for i in range(len(digests))]

    # ---- restore ---------------------------------------------------------------------------------
    async def restore(self, request_id: str, prompt: list[int], trace_ctx, tenant: str = "") -> Restored:
        """The blocks this request starts from, each with a reference it hands to the engine: the
        chunks restored from the pool on top of the device prefix when that is worth it, else the
        device prefix alone. Either way they are pinned until the engine admits the request, so that
        other requests cannot evict them meanwhile. (Nothing is pinned while waiting for the restore
        lock: a pin held there could starve the restore that holds the lock of blocks.)"""
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
            hits = next((i for i, p in enumerate(present) if not p), len(present))
            outcome["hit_chunks"] = hits
            span.set_attribute("hit_chunks", hits)
            if hits * self.chunk < self.min_restore:
                return await self._device_only("miss", prompt, outcome, ns)
        with tracer.start_as_current_span("store.restore", context=trace_ctx) as span:
            async with self.restore_lock:
                restored = await self._restore(prompt, digests[:c0 + hits], span, ns)
        if restored is None:
            return await self._device_only("no_free_blocks", prompt, outcome, ns)
        outcome["restored_chunks"] = restored.stats["chunks"]
        return self._outcome("restored" if restored.stats["chunks"] == hits else "partial", outcome, restored)

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

    async def _restore(self, prompt: list[int], digests: list[bytes], span, ns: KVNamespace) -> Restored | None:
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
            n = min(want, self.bm.num_free_blocks // bpc)
            verdict = None
            if wait and n < want and want * bpc <= self.bm.num_blocks - len(prefix):
                verdict = False
            elif n * self.chunk >= self.min_restore:
                with contextlib.suppress(OutOfBlocks):
                    return c_start, prefix, self.bm.allocate(n * bpc)
            self.bm.release(reversed(prefix))
            return verdict

        t_wait = time.perf_counter()
        while (reserved := await self.loop.call_now(lambda: reserve(time.monotonic() < deadline))) is False:
            await self.loop.changed(deadline - time.monotonic())  # a step or a release may have freed blocks
        span.set_attribute("block_wait_ms", (time.perf_counter() - t_wait) * 1e3)
        if reserved is None:
            return None
        c0, prefix, fresh = reserved
        digests = digests[c0:c0 + len(fresh) // bpc]
        t0, stage_ms, good, nbytes = time.perf_counter(), [0.0] * self.stages, 0, 0
        batch = self.settings.restore_batch_chunks
        try:
            for b0 in range(0, len(digests), batch):
                ok = await self._restore_batch(digests[b0:b0 + batch], fresh[b0 * bpc:], stage_ms, ns)
                good += ok
                nbytes += ok * self.chunk_bytes
                if ok < len(digests[b0:b0 + batch]):
                    break
        finally:
            kept = fresh[:good * bpc]

            def commit() -> list[int]:
                table = prefix + kept
                if kept:
                    self.bm.register_full_blocks(table, prompt, len(table), start_block=len(prefix), seed=ns.seed)
                self.bm.release(reversed(fresh[good * bpc:]))
                return table

            pinned = await self.loop.call_now(commit)
        self.counters["restored_chunks"] += good
        self.counters["restored_bytes"] += nbytes
        span.set_attributes({"chunks": good, "bytes": nbytes, "verify_failures": self.counters["verify_failures"],
                             "ms": (time.perf_counter() - t0) * 1e3,
                             **{f"stage{s}_ms": ms for s, ms in enumerate(stage_ms)}})
        return Restored(pinned, (c0 * self.chunk, (c0 + good) * self.chunk),
                        {"chunks": good, "bytes": nbytes})

    async def _restore_batch(self, digests: list[bytes], blocks: list[int], stage_ms: list[float],
                             ns: KVNamespace) -> int:
        """Reads, verifies and unpacks these chunks; returns how many leading chunks are good."""
        keys, addrs, sizes, views = [], [], [], []
        off, base = 0, self.restore_buf.data_ptr()
        for d in digests:
            for s, key in enumerate(self._keys(d, ns)):
                keys.append(key), addrs.append(base + off), sizes.append(self.obj_bytes[s])
                views.append(self.restore_buf[off:off + self.obj_bytes[s]])
                off += self.obj_bytes[s]
        got = await asyncio.to_thread(self.client.get_into, keys, addrs, sizes)
        bpc, S = self.blocks_per_chunk, self.stages
        for c, d in enumerate(digests):
            for s in range(S):
                i = c * S + s
                t = time.perf_counter()
                if got[i] != sizes[i]:  # gone (store died, evicted) or unreadable: a miss from here on
                    log.info("pool read failed", key=keys[i], code=got[i])
                    return c
                why = await asyncio.to_thread(verify, views[i], self._spec(d, s, ns))
                if why is not None:
                    self.counters["verify_failures"] += 1
                    log.warning("pool object rejected", key=keys[i], reason=why)
                    return c
                payload = views[i][HEADER_BYTES:].view(self.layout.dtype)
                await asyncio.to_thread(self.kernels.unpack_chunk, payload, self.engine.pages[s],
                                        blocks[c * bpc:(c + 1) * bpc])
                stage_ms[s] += (time.perf_counter() - t) * 1e3
        return len(digests)

    # ---- save ------------------------------------------------------------------------------------
    def hold_for_save(self, prompt: list[int], block_table: list[int]) -> list[int]:
        """Called on the event loop between steps (no engine step running): our own reference on the
        prompt's full-chunk blocks, taken before anyone else may release them."""
        blocks = block_table[:(len(prompt) // self.chunk) * self.blocks_per_chunk]
        self.bm.acquire(blocks)
        return blocks

    async def save(self, request_id: str, prompt: list[int], blocks: list[int], trace_ctx,
                   tenant: str = "") -> None:
        bpc, ns = self.blocks_per_chunk, self.engine.kv_namespace(tenant)
        try:
            with tracer.start_as_current_span("store.save", context=trace_ctx) as span:
                digests = chunk_hashes(prompt, ns.seed, self.chunk)[:len(blocks) // bpc]
                present = await self.present(digests, ns)
                saved = []
                async with self.save_lock:
                    for c, (d, have) in enumerate(zip(digests, present)):
                        if have:
                            self.counters["save_skipped"] += 1
                            continue
                        if await self._save_chunk(d, blocks[c * bpc:(c + 1) * bpc], ns):
                            saved.append(d)
                self.counters["saved_chunks"] += len(saved)
                span.set_attributes({"request_id": request_id, "chunks": len(saved),
                                     "skipped": sum(present), "bytes": len(saved) * self.chunk_bytes})
            if saved and self.on_store_event:
                await self.on_store_event(saved)
        except Exception as e:  # a save is best effort: the request already has its answer
            self.counters["save_failures"] += 1
            log.warning("save failed", request_id=request_id, error=str(e))
        finally:
            await self.loop.call_now(lambda: self.bm.release(reversed(blocks)))

    async def _save_chunk(self, digest: bytes, blocks: list[int], ns: KVNamespace) -> bool:
        keys, addrs, sizes, off = self._keys(digest, ns), [], [], 0
        for s in range(self.stages):
            obj = self.save_buf[off:off + self.obj_bytes[s]]
            payload = obj[HEADER_BYTES:]

            def pack(s=s, obj=obj, payload=payload):
                self.kernels.pack_chunk(self.engine.pages[s], blocks, out=payload.view(self.layout.dtype))
                write_header(obj, self._spec(digest, s, ns), checksum(payload))

            await asyncio.to_thread(pack)
            addrs.append(self.save_buf.data_ptr() + off), sizes.append(self.obj_bytes[s])
            off += self.obj_bytes[s]
        rc = await asyncio.to_thread(self.client.put_from, keys, addrs, sizes, digest.hex())
        if any(r != 0 for r in rc):
            # half a chunk is no hit (every stage must be there): give back what did land
            landed = [k for k, r in zip(keys, rc) if r == 0]
            if landed:
                await asyncio.to_thread(self.client.remove, landed, True)
            self.counters["save_failures"] += 1
            log.warning("pool put failed", digest=digest.hex(), codes=rc)
            return False
        return True
