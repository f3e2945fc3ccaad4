"""Prefill's pool saves: a finished prompt's new full chunks go to the pool in batched puts, when the
engine has nothing to compute, so that saving never slows the traffic that pays for it.

Why deferred: on traffic that never returns, saving every chunk at once, one put per chunk, cost 12% of
throughput (bench/zero_hit.py: packing, checksums, master round trips and transfers beside the engine's
compute); saves with no compute to compete with cost nothing measurable. A save is no less sure for the
wait: its blocks stay pinned on the device (`hold_for_save`) and stay in the device prefix cache, so the
session's next turn on this prefill hits them either way. A waiting save goes at once when
- the engine is idle (nothing running or waiting) and no handoff is moving KV to a decode (`handing_off`:
  a cold turn's save would otherwise pack and put its chunks beside its own handoff's write, on the
  path to decode's first token);
- something waits for blocks: the engine is stalled, or a restore waits for free blocks;
- waiting saves pin more than `save_max_held_fraction` of the device blocks;
- it waited `save_max_delay_s` (traffic that never lets up still gets saved, beside compute).

Session retention (the router's `retention = "session"`, PrefillSubmit.retain): a session's save also
waits for its turn's end (SessionTurn, at the answer's end, seconds later), under the same pressure rules.
A turn that ended in a tool call is expected back: its new objects are soft-pinned for the router's `pin_s`
(sized from the tool pauses it saw), so the master evicts them only once no unpinned object is left. A turn
that ended the task, and every save of a request without a session, stay unpinned (plain LRU). A save that
has to go before its turn ended pins for the last `pin_s` a turn brought (none yet: unpinned). A chunk keeps
the pin of its first save: a later turn finds it present and skips it; reads renew a pin.

How: saves run one at a time (FIFO). A save asks which of its chunks the pool lacks (now, not when it
was queued: an earlier save may have put a shared prefix), packs them into one registered buffer, header
and CRC-32C per object, in one worker call, and puts them with ONE batched put (up to
`save_batch_chunks` chunks; each chunk's stages one eviction group). A chunk a put could not complete is
removed (half a chunk is no hit). `save_max_mbps` paces the puts. The blocks are released exactly once,
whatever happens (failure, cancel, stop).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

from shared.device_staging import KVStaging, host_buffer
from shared.engine.loop import EngineLoopDead
from shared.hashing import chunk_hashes
from shared.kv_object import HEADER_BYTES, write_header
from shared.kv_tenant import KVNamespace
from shared.logging import get_logger
from shared.tracing import get_tracer

tracer = get_tracer("moorage.prefill.pool")
log = get_logger("prefill.pool")


async def finish_in_thread(fn, *args):
    """asyncio.to_thread, but a cancelled caller still waits for the thread to end: its buffer and its
    blocks are not let go while a worker reads or writes them."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut])
        raise


class TurnEnds:
    """How the turns of sessions with a waiting save ended (SessionTurn), keyed by (tenant, session)."""

    def __init__(self):
        self._waiting: Counter[tuple[str, str]] = Counter()
        self._ended: dict[tuple[str, str], object] = {}
        self.last_pin_s = 0.0  # the newest pin a returning turn brought: for saves that could not wait

    def expect(self, key: tuple[str, str]) -> None:
        if not self._waiting[key]:
            self._ended.pop(key, None)
        self._waiting[key] += 1

    def told(self, msg) -> bool:
        """A SessionTurn arrived; True when a save waits for it."""
        if msg.expected_back:
            self.last_pin_s = msg.pin_s
        key = (msg.tenant, msg.session_id)
        if not self._waiting.get(key):
            return False
        self._ended[key] = msg
        return True

    def known(self, key: tuple[str, str]) -> bool:
        return key in self._ended

    def waiting(self, key: tuple[str, str]) -> bool:
        return bool(self._waiting.get(key))

    def take(self, key: tuple[str, str]):
        """The turn's end (None: not told) for one save that stops waiting."""
        self._waiting[key] -= 1
        if self._waiting[key]:
            return self._ended.get(key)
        del self._waiting[key]
        return self._ended.pop(key, None)

    def check_integrity(self) -> None:
        assert all(n > 0 for n in self._waiting.values()), "a session waits for a negative number of saves"
        assert set(self._ended) <= set(self._waiting), "a turn's end is kept with no save waiting for it"


class PoolSaver:
    """The save half of PoolConnector (`conn`: geometry, names, counters, client and engine)."""

    def __init__(self, conn, on_store_event=None):
        self.conn, self.settings, self.on_store_event = conn, conn.settings, on_store_event
        self.on_spill = None  # async (keys, sizes) of the objects each save put (the stores' disk tier)
        self.engine, self.loop, self.bm = conn.engine, conn.loop, conn.bm
        self.batch = self.settings.save_batch_chunks
        self.buf = host_buffer(self.batch * conn.chunk_bytes, self.engine.pages[0].device)
        conn.client.register(self.buf)
        self.copies = KVStaging(self.engine.pages, conn.register_pages)  # pages -> buf, beside a restore's copies
        self.lock = asyncio.Lock()  # FIFO: one save at a time, in the order they were queued
        self.held_blocks = 0        # blocks pinned by saves that have not ended
        self.block_waiters = 0      # restores waiting for free blocks (a deferred save then goes)
        self.handing_off = lambda: False  # the prefill's: whether a handoff is in flight (its end pulses the loop)
        self.turns = TurnEnds()     # session retention: saves waiting to know whether to pin
        self.after_ended = None     # async fn(key): a session's task ended and its last waiting save let go of its blocks
        self._paced_until = 0.0

    def hold(self, prompt: list[int], block_table: list[int]) -> list[int]:
        """Called on the event loop between steps (no engine step running): our own reference on the
        prompt's full-chunk blocks, taken before anyone else may release them."""
        blocks = block_table[:(len(prompt) // self.conn.chunk) * self.conn.blocks_per_chunk]
        self.bm.acquire(blocks)
        self.held_blocks += len(blocks)
        return blocks

    def _pressed(self, deadline: float) -> str | None:
        """Why a waiting save must go now, idle or not (a counter's name), or None."""
        if self.engine.stalled or self.block_waiters > 0:
            return "blocks_wanted"
        if self.held_blocks > self.settings.save_max_held_fraction * self.bm.num_blocks:
            return "held_too_many"
        if time.monotonic() >= deadline:
            return "max_delay"
        return None

    def _why_go(self, deadline: float) -> str | None:
        """Why this save may go now (a counter's name), or None: wait."""
        if not self.settings.save_when_idle:
            return "eager"
        if not self.engine.has_unfinished() and not self.handing_off():
            return "idle"
        return self._pressed(deadline)

    def turn_ended(self, msg) -> bool:
        """A SessionTurn (the prefill's subscription): a save waiting for it may go. True when one waits (a
        task's end then reaches `after_ended` once that save let go of its blocks)."""
        if self.turns.told(msg):
            self.loop.pulse()
            return True
        return False

    async def _pin_for(self, session: tuple[str, str] | None, deadline: float) -> tuple[float, bool]:
        """How long this save's objects are soft-pinned: 0 without a session; else once its turn ended (or it
        must go first: pressure, the deadline): the pin a returning turn brought, 0 for a task's end. And
        whether this save, the session's last waiting one, learned that its task ended (after_ended's turn)."""
        if session is None:
            return 0.0, False
        self.turns.expect(session)
        try:
            while (self.settings.save_when_idle and not self.turns.known(session)
                   and self._pressed(deadline) is None):
                await asyncio.shield(self.loop.changed(max(deadline - time.monotonic(), 1e-3)))
        finally:
            turn = self.turns.take(session)
        if turn is None:
            self.conn.counters["save_turn_unknown"] += 1
            return self.turns.last_pin_s, False
        if turn.expected_back:
            return turn.pin_s, False
        return 0.0, not self.turns.waiting(session)

    async def _turn(self, deadline: float) -> tuple[str, float]:
        """Waits (on engine state changes, never polling) until this save may go: (why, ms waited)."""
        t0 = time.monotonic()
        while (why := self._why_go(deadline)) is None:
            # shielded: a cancel that lands as the wait ends is not lost in wait_for (Python 3.11)
            await asyncio.shield(self.loop.changed(max(deadline - time.monotonic(), 1e-3)))
        self.conn.counters[f"save_went_{why}"] = self.conn.counters.get(f"save_went_{why}", 0) + 1
        return why, (time.monotonic() - t0) * 1e3

    async def save(self, request_id: str, prompt: list[int], blocks: list[int], trace_ctx, tenant: str = "",
                   session: str | None = None) -> None:
        """`session`: the request's, when its turn's end decides the pin (PrefillSubmit.retain)."""
        conn, bpc = self.conn, self.conn.blocks_per_chunk
        ns = self.engine.kv_namespace(tenant)
        deadline = time.monotonic() + self.settings.save_max_delay_s
        key, ended = None if session is None else (tenant, session), False
        try:
            pin_s, ended = await self._pin_for(key, deadline)
            async with self.lock:
                with tracer.start_as_current_span("store.save", context=trace_ctx) as span:
                    went, waited_ms = await self._turn(deadline)
                    digests = chunk_hashes(prompt, ns.seed, conn.chunk)[:len(blocks) // bpc]
                    present = await conn.present(digests, ns)
                    todo = [c for c, have in enumerate(present) if not have]
                    conn.counters["save_skipped"] += len(digests) - len(todo)
                    saved, puts = [], 0
                    for b0 in range(0, len(todo), self.batch):
                        part = todo[b0:b0 + self.batch]
                        saved += await self._put([digests[c] for c in part],
                                                 [blocks[c * bpc:(c + 1) * bpc] for c in part], ns, pin_s)
                        puts += 1
                    conn.counters["saved_chunks"] += len(saved)
                    conn.counters["saved_pinned_chunks"] += len(saved) if pin_s > 0 else 0
                    span.set_attributes({"request_id": request_id, "chunks": len(saved), "puts": puts,
                                         "pin_s": pin_s,
                                         "skipped": len(digests) - len(todo), "waited_ms": waited_ms, "went": went,
                                         "bytes": len(saved) * conn.chunk_bytes})
            if saved and self.on_store_event:
                await self.on_store_event(saved)
            if saved and self.on_spill is not None:  # the stores' disk tier copies them
                await self.on_spill([k for d in saved for k in conn.keys(d, ns)], conn.obj_bytes * len(saved))
        except Exception as e:  # a save is best effort: the request already has its answer
            conn.counters["save_failures"] += 1
            log.warning("save failed", request_id=request_id, error=str(e))
        finally:
            self.held_blocks -= len(blocks)
            with contextlib.suppress(EngineLoopDead):  # a dead engine's blocks matter no more
                await self.loop.call_now(lambda: self.bm.release(reversed(blocks)))
                if ended and self.after_ended is not None:
                    await self.after_ended(key)

    async def _pace(self, nbytes: int) -> None:
        """save_max_mbps: this put starts when the previous ones' bytes have had their time."""
        if self.settings.save_max_mbps <= 0:
            return
        now = time.monotonic()
        start = max(now, self._paced_until)
        self._paced_until = start + nbytes / (self.settings.save_max_mbps * 1e6)
        if start > now:
            await asyncio.sleep(start - now)

    async def _put(self, digests: list[bytes], chunks: list[list[int]], ns: KVNamespace,
                   pin_s: float = 0.0) -> list[bytes]:
        """One batched put of these chunks (every stage of each), soft-pinned for pin_s when > 0; returns the
        digests that landed whole."""
        conn, S = self.conn, self.conn.stages
        keys, addrs, sizes, groups, views = [], [], [], [], []
        off, base = 0, self.buf.data_ptr()
        for d in digests:
            for s, key in enumerate(conn.keys(d, ns)):
                n = conn.obj_bytes[s]
                keys.append(key), addrs.append(base + off), sizes.append(n), groups.append(d.hex())
                views.append(self.buf[off:off + n])
                off += n

        def pack() -> None:  # one worker call for the whole batch
            for c, (d, blocks) in enumerate(zip(digests, chunks)):
                for s in range(S):
                    obj = views[c * S + s]
                    payload = obj[HEADER_BYTES:].view(conn.pool_dtype)  # compact objects: converted in the pack
                    crc = self.copies.pack_crc(self.engine.pages[s], blocks, payload)  # CRC of the bytes put
                    write_header(obj, conn.spec(d, s, ns), crc)

        await finish_in_thread(pack)
        await self._pace(off)
        rc = await finish_in_thread(lambda: conn.client.put_from(keys, addrs, sizes, groups, soft_pin_s=pin_s))
        good, landed_of_bad = [], []
        for c, d in enumerate(digests):
            mine = rc[c * S:(c + 1) * S]
            if all(r == 0 for r in mine):
                good.append(d)
            else:  # half a chunk is no hit (every stage must be there): give back what did land
                landed_of_bad += [k for k, r in zip(keys[c * S:(c + 1) * S], mine) if r == 0]
                conn.counters["save_failures"] += 1
                log.warning("pool put failed", digest=d.hex(), codes=mine)
        if landed_of_bad:
            await finish_in_thread(conn.client.remove, landed_of_bad, True)
        return good
