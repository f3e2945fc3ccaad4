"""The store's disk tier on the bus: copies the pool objects of its own segment to disk as prefills save
them, and puts them back into the pool when a prefill asks (services/store/disk.py holds the files).

- Spill (`moorage.store.disk.spill`, DiskSpill from every prefill save): of the keys saved, those whose
  replica lies in this store's segment are read through Mooncake into a registered buffer and written to
  disk. Copying at save time, not at eviction, is what lets an evicted chunk come back at all: Mooncake
  frees an object's bytes when it evicts it, and tells no one first. An object evicted before its copy
  was made is counted (`spill_missed`) and stays a miss; a copy that does not verify is not written
  (`spill_rejected`).
- Drop (`moorage.store.disk.drop`, DiskDrop from a prefill that closed a session): the copies of the session's
  own objects are deleted, as the pool's are, so a closed session's history never comes back from disk.
- Index (`moorage.store.disk.index`, DiskIndex): every write and deletion is announced, and the whole listing
  at start and on request (`moorage.store.disk.sync`), so prefills know which store holds which object
  without asking on every miss.
- Load (`moorage.store.<instance>.disk.load`, DiskLoad -> DiskLoaded): the objects are read from disk and
  verified (every byte: header and CRC-32C), then put back into the pool, preferring this store's segment,
  each chunk's objects one eviction group as a prefill puts them, soft-pinned for LOAD_PIN_S (the restore that
  asked reads them next). The reply counts the leading keys that are
  in the pool again; the prefill then restores them as any pool hit, verifying them once more.
Bulk bytes move through Mooncake and the local disk only; the bus carries keys.
"""

from __future__ import annotations

import asyncio
import contextlib

import torch

from services.store.disk import DiskTier
from shared.kv_object import verify_as
from shared.messages import DiskDrop, DiskIndex, DiskLoad, DiskLoaded, DiskSpill, DiskSync
from shared.pool import PoolClient, PoolConfig

INDEX_KEYS_PER_MESSAGE = 4000  # ~400 KB of keys: under the bus cap
# objects put back for a restore are soft-pinned this long: a busy pool evicts a fresh, unread object first,
# and without it 39 of one bench run's restores lost chunks between their load and their read (bench tiers)
LOAD_PIN_S = 10.0


def batches(sizes: list[int], room: int) -> list[tuple[int, int]]:
    """(first, end) index ranges of consecutive items whose sizes fit `room` together (an item larger than
    `room` is a range of its own, which the caller skips)."""
    out, lo, used = [], 0, 0
    for i, n in enumerate(sizes):
        if i > lo and used + n > room:
            out.append((lo, i))
            lo, used = i, 0
        used += n
    if lo < len(sizes):
        out.append((lo, len(sizes)))
    return out


class DiskService:
    def __init__(self, ctx, settings, segment):
        self.ctx, self.bus, self.segment = ctx, ctx.bus, segment
        self.tier = DiskTier(settings.disk_path, settings.disk_bytes, ctx.log)
        self.client = PoolClient(PoolConfig(master_addr=settings.master_addr), store=segment.store)
        self.room = settings.disk_buffer_bytes
        self.spill_buf = torch.empty(self.room, dtype=torch.uint8)
        self.load_buf = torch.empty(self.room, dtype=torch.uint8)
        for buf in (self.spill_buf, self.load_buf):
            self.client.register(buf)
        self.endpoint = ""  # the transfer endpoint replicas in our segment name (_find_endpoint)
        self.counters = {"spill_notices": 0, "spill_other_segment": 0, "spill_missed": 0, "spill_rejected": 0,
                         "loads": 0, "loaded_objects": 0, "load_put_failures": 0}

    async def start(self) -> None:
        subjects = self.bus.subjects
        await self.bus.subscribe(subjects.disk_spill, DiskSpill, self.spill)
        await self.bus.subscribe(subjects.disk_drop, DiskDrop, self.drop)
        await self.bus.subscribe(subjects.disk_load(self.ctx.instance), DiskLoad, self.load,
                                 on_error=lambda e, raw: DiskLoaded(0, f"bad request: {e}"))
        await self.bus.subscribe(subjects.disk_sync, DiskSync, self.sync)
        await asyncio.to_thread(self._find_endpoint)
        await self.sync(None, None)
        self.ctx.log.info("disk tier ready", path=str(self.tier.dir), objects=len(self.tier.index),
                          bytes=self.tier.used, capacity=self.tier.capacity, writable=self.tier.writable,
                          endpoint=self.endpoint)

    def stats(self) -> dict:
        return {**self.tier.stats(), **self.counters}

    async def _announce(self, added: list[str], removed: list[str]) -> None:
        if added or removed:
            with contextlib.suppress(Exception):  # advisory: a prefill that misses it asks in vain, or not at all
                await self.bus.publish(self.bus.subjects.disk_index, DiskIndex(self.ctx.instance, added, removed))

    async def sync(self, msg, raw) -> None:
        keys = list(self.tier.index)
        parts = [keys[i:i + INDEX_KEYS_PER_MESSAGE] for i in range(0, len(keys), INDEX_KEYS_PER_MESSAGE)] or [[]]
        for i, part in enumerate(parts):
            await self.bus.publish(self.bus.subjects.disk_index,
                                   DiskIndex(self.ctx.instance, added=part, snapshot=i == 0))

    # ---- spill ------------------------------------------------------------------------------------
    async def drop(self, msg: DiskDrop, raw) -> None:
        """A closed session's objects: their disk copies go too (else its history would come back from here)."""
        gone = await asyncio.to_thread(self.tier.delete, list(msg.keys))
        await self._announce([], gone)

    async def spill(self, msg: DiskSpill, raw) -> None:
        self.counters["spill_notices"] += 1
        if not self.tier.writable or len(msg.keys) != len(msg.sizes):
            return
        todo = [(k, n) for k, n in zip(msg.keys, msg.sizes) if not self.tier.holds(k) and 0 < n <= self.room]
        if not todo:
            return
        where = await asyncio.to_thread(self.client.replicas, [k for k, _ in todo])
        me = self.endpoint or await asyncio.to_thread(self._find_endpoint)
        mine = [(k, n) for (k, n), r in zip(todo, where) if r is not None and r[0] == me]
        gone = sum(r is None for r in where)  # evicted (or being replaced) before we asked: no copy
        self.counters["spill_missed"] += gone
        self.counters["spill_other_segment"] += len(todo) - len(mine) - gone
        for lo, hi in batches([n for _, n in mine], self.room):
            await self._copy(mine[lo:hi])

    def _find_endpoint(self) -> str:
        """This store's transfer endpoint, the address replicas in its segment name (not the segment's
        "host:port" name): a probe object put into its own segment says it. At start, when the segment has
        room, placement follows the preference; until a probe succeeds, nothing counts as ours."""
        key = f"moorage-disk-probe/{self.ctx.instance}"
        rcs = self.client.put_from([key], [self.spill_buf.data_ptr()], [4096], preferred_segment=self.segment.name)
        if rcs[0] == 0:
            where = self.client.replicas([key])[0]
            self.endpoint = where[0] if where else ""
            self.client.remove([key], force=True)
        return self.endpoint

    async def _copy(self, objects: list[tuple[str, int]]) -> None:
        base, offs, off = self.spill_buf.data_ptr(), [], 0
        for _, n in objects:
            offs.append(off)
            off += n
        got = await asyncio.to_thread(self.client.get_into, [k for k, _ in objects], [base + o for o in offs],
                                      [n for _, n in objects])
        read = [(k, self.spill_buf[o:o + n]) for (k, n), o, g in zip(objects, offs, got) if g == n]
        self.counters["spill_missed"] += len(objects) - len(read)

        def verify_write() -> tuple[list[str], list[str]]:  # a copy that is not the object never reaches disk
            good = [(k, memoryview(t.numpy())) for k, t in read if verify_as(t, k) is None]
            self.counters["spill_rejected"] += len(read) - len(good)
            return self.tier.write(good)

        added, evicted = await asyncio.to_thread(verify_write)
        await self._announce(added, evicted)

    # ---- load -------------------------------------------------------------------------------------
    async def load(self, msg: DiskLoad, raw) -> DiskLoaded:
        self.counters["loads"] += 1
        loaded, reason, rejected = 0, "", []
        sizes = [self.tier.size(k) for k in msg.keys]
        have = next((i for i, n in enumerate(sizes) if n == 0 or n > self.room), len(sizes))
        if have < len(sizes):
            reason = f"{msg.keys[have]} is not on disk"
        for lo, hi in batches(sizes[:have], self.room):
            n, why, bad = await asyncio.to_thread(self._read_put, msg.keys[lo:hi], sizes[lo:hi], msg.replace)
            loaded += n
            rejected += bad
            if why:
                reason = why
                break
        self.counters["loaded_objects"] += loaded
        await self._announce([], rejected)
        return DiskLoaded(loaded, reason)

    def _read_put(self, keys: list[str], sizes: list[int], replace: bool) -> tuple[int, str, list[str]]:
        """In a worker thread: reads and verifies these objects into the load buffer, then puts the leading
        good ones into the pool; (how many leading keys are in the pool now, why not more, keys rejected)."""
        base, addrs, off, why, rejected = self.load_buf.data_ptr(), [], 0, "", []
        for key, n in zip(keys, sizes):
            why = self.tier.read_into(key, self.load_buf[off:off + n])
            if why is not None:
                rejected += [key] if not self.tier.holds(key) else []
                why = f"{key}: {why}"
                break
            addrs.append(base + off)
            off += n
        good = len(addrs)
        if not good:
            return 0, why, rejected
        if replace:  # a put of a listed key keeps the listed (unreadable) object: drop it first
            self.client.remove(keys[:good], force=True)
        groups = [k.rsplit("/", 1)[-1] for k in keys[:good]]  # the chunk's digest: a prefill's group id
        rcs = self.client.put_from(keys[:good], addrs, sizes[:good], groups, preferred_segment=self.segment.name,
                                   soft_pin_s=LOAD_PIN_S)
        put = next((i for i, rc in enumerate(rcs) if rc != 0), good)
        if put < good:
            self.counters["load_put_failures"] += 1
            why = f"{keys[put]}: pool put failed ({rcs[put]})"
        return put, why, rejected

    async def stop(self) -> None:
        for buf in (self.spill_buf, self.load_buf):
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.client.unregister, buf)
