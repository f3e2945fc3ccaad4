"""Prefill's pool connector, its block bookkeeping in one process: a real tiny engine, and an in-memory
stand-in for PoolClient (same calls, bytes copied to and from the registered addresses). The real
Mooncake pool is exercised end to end in test_pool_e2e; here the interleavings are pinned down.

- A restore whose hit chunks do not fit in the free device blocks waits for them (computing those tokens
  would need the same blocks) instead of recomputing history the pool holds; with `restore_wait_s=0` it
  restores what fits.
- Whatever it restores, the output stays exactly the from-scratch output, and every block comes back.
- Restores run three ways: read into the blocks (in place), read whole and unpacked, and with
  `transfer.register_pages` false ("foreign": saved and restored through a scratch buffer, as a GPU's pages
  are, shared/device_staging.py).
"""

from __future__ import annotations

import asyncio
import ctypes
import random

import pytest
import torch

from services.prefill.config import PoolSettings
from services.prefill.pool import PoolConnector, batch_plan
from shared.kv_object import HEADER_BYTES
from shared.engine.engine import Engine, EngineConfig
from shared.engine.loop import EngineLoop
from shared.engine.sampling import SamplingParams
from shared.messages import SessionTurn

CHUNK = 64
BPC = CHUNK // 16  # blocks per chunk
PROMPT = 5 * CHUNK + 10


class MemoryPool:
    """PoolClient's surface over a dict (keys -> bytes)."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.puts: list[list[str]] = []  # keys of each put_from call
        self.pins: list[float] = []       # soft_pin_s of each put_from call

    def register(self, tensor) -> None:
        pass

    def exists(self, keys):
        return [k in self.objects for k in keys]

    def get_into(self, keys, addrs, sizes):
        out = []
        for k, a, n in zip(keys, addrs, sizes):
            data = self.objects.get(k)
            if data is None or len(data) > n:
                out.append(-704)
                continue
            ctypes.memmove(a, data, len(data))
            out.append(len(data))
        return out

    def get_into_pieces(self, keys, addrs, sizes):
        out = []
        for k, a, n in zip(keys, addrs, sizes):
            data = self.objects.get(k)
            if data is None or len(data) > sum(n):
                out.append(-704 if data is None else -600)
                continue
            off = 0
            for piece_addr, piece_bytes in zip(a, n):
                ctypes.memmove(piece_addr, data[off:off + piece_bytes], len(data[off:off + piece_bytes]))
                off += piece_bytes
            out.append(len(data))
        return out

    def put_from(self, keys, addrs, sizes, group_id=None, soft_pin_s=0.0):
        self.puts.append(list(keys))
        self.pins.append(soft_pin_s)
        for k, a, n in zip(keys, addrs, sizes):
            self.objects.setdefault(k, ctypes.string_at(a, n))
        return [0] * len(keys)

    def remove(self, keys, force=False):
        for k in keys:
            self.objects.pop(k, None)
        return [0] * len(keys)


def prompt_ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def _prefilled_pool(tiny, pool: MemoryPool, prompt: list[int], register_pages: bool = True) -> None:
    """Another prefill computed `prompt` and saved its full chunks."""
    engine = Engine(tiny, EngineConfig(num_blocks=64, chunk_tokens=CHUNK))
    loop = EngineLoop(engine, lambda outs: asyncio.sleep(0))
    loop.start()
    try:
        conn = PoolConnector(pool, engine, loop, PoolSettings(enabled=True), register_pages=register_pages)
        assert conn.saver.copies.foreign == (not register_pages)
        seq = await loop.call(lambda: engine.add_request("w", prompt, SamplingParams(max_tokens=1), retain_kv=True))
        while not seq.is_finished:
            await asyncio.sleep(0.01)
        blocks = await loop.call(lambda: conn.hold_for_save(prompt, seq.block_table))
        await loop.call(lambda: engine.block_manager.release(reversed(seq.block_table)))
        await conn.save("w", prompt, blocks, None)
    finally:
        await loop.stop()
    assert conn.counters["saved_chunks"] == PROMPT // CHUNK


@pytest.fixture(params=["in_place", "unpacked", "foreign"])
async def restoring(tiny, request):
    """(engine, connector factory): a prefill with 24 blocks (6 chunks) of device KV, an empty device
    cache, and a pool that holds the 5 full chunks of the prompt. Every restore test runs three ways:
    read into the blocks and verified there (restore_in_place), read whole, then unpacked, and (foreign:
    register_pages false on the saving and the restoring prefill) unpacked through a scratch buffer."""
    foreign = request.param == "foreign"
    pool = MemoryPool()
    await _prefilled_pool(tiny, pool, prompt_ids(7, PROMPT), register_pages=not foreign)
    engine = Engine(tiny, EngineConfig(num_blocks=24, chunk_tokens=CHUNK))
    loop = EngineLoop(engine, lambda outs: asyncio.sleep(0))
    loop.start()
    yield engine, loop, lambda **kw: PoolConnector(pool, engine, loop, PoolSettings(
        enabled=True, **{"restore_in_place": request.param == "in_place", **kw}), register_pages=not foreign)
    await loop.stop()
    engine.block_manager.check_integrity()


def scratch(tiny, prompt: list[int]) -> list[int]:
    engine = Engine(tiny, EngineConfig(num_blocks=64, enable_prefix_cache=False))
    [seq] = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    return seq.output_ids


async def _run(engine, loop, restored, prompt) -> list[int]:
    seq = await loop.call(lambda: engine.add_request(
        "r", prompt, SamplingParams(max_tokens=8, ignore_eos=True), pinned_blocks=restored.pinned,
        restored_range=restored.token_range))
    while not seq.is_finished:
        await asyncio.sleep(0.01)
    return seq.output_ids


async def test_restore_waits_for_blocks_held_by_running_requests(restoring, tiny):
    engine, loop, connector = restoring
    conn = connector(restore_wait_s=30)
    busy = await loop.call(lambda: engine.block_manager.allocate(20))  # requests in flight hold 20 of 24
    prompt = prompt_ids(7, PROMPT) + prompt_ids(8, 20)
    task = asyncio.create_task(conn.restore("r", prompt, None))
    await asyncio.sleep(0.2)
    assert not task.done(), "restored only part of the history instead of waiting for blocks"
    await loop.call(lambda: engine.block_manager.release(busy))  # they finish
    restored = await asyncio.wait_for(task, 10)
    assert restored.token_range == (0, 5 * CHUNK) and conn.counters["restore_restored"] == 1
    assert await _run(engine, loop, restored, prompt) == scratch(tiny, prompt)
    assert engine.block_manager.num_free_blocks == 24


async def test_without_waiting_restores_what_fits(restoring, tiny):
    engine, loop, connector = restoring
    conn = connector(restore_wait_s=0)
    busy = await loop.call(lambda: engine.block_manager.allocate(12))  # 12 free: 3 of the 5 chunks fit
    prompt = prompt_ids(7, PROMPT) + prompt_ids(8, 20)
    restored = await conn.restore("r", prompt, None)
    assert restored.token_range == (0, 3 * CHUNK) and conn.counters["restore_partial"] == 1
    await loop.call(lambda: engine.block_manager.release(busy))
    assert await _run(engine, loop, restored, prompt) == scratch(tiny, prompt)
    assert engine.block_manager.num_free_blocks == 24


async def test_device_prefix_is_pinned_when_nothing_is_restored(restoring, tiny):
    """History on device and nothing more in the pool: the device prefix is pinned for the request, so
    allocations made while it waits to be admitted cannot evict it."""
    engine, loop, connector = restoring
    conn = connector()
    first = prompt_ids(9, 3 * CHUNK)
    assert await _run(engine, loop, await conn.restore("r", first, None), first) == scratch(tiny, first)
    await loop.call(lambda: engine.abort("r"))
    prompt = first + prompt_ids(10, 8)
    restored = await conn.restore("r2", prompt, None)
    assert conn.counters["restore_miss"] == 1 and len(restored.pinned) == 3 * BPC and restored.token_range == (0, 0)
    assert engine.block_manager.num_free_blocks == 24 - 3 * BPC  # pinned: not evictable, so not free
    seq = await loop.call(lambda: engine.add_request("r2", prompt, SamplingParams(max_tokens=8, ignore_eos=True),
                                                     pinned_blocks=restored.pinned))
    while not seq.is_finished:
        await asyncio.sleep(0.01)
    assert seq.num_device_cached == 3 * CHUNK and seq.output_ids == scratch(tiny, prompt)


# ---- saves: deferred to idle time, one batched put, blocks released exactly once ----------------------
class FailingPool(MemoryPool):
    """put_from fails (-800) for every key that contains one of `bad`."""

    def __init__(self, bad: set[str]):
        super().__init__()
        self.bad = bad

    def put_from(self, keys, addrs, sizes, group_id=None, soft_pin_s=0.0):
        self.puts.append(list(keys))
        self.pins.append(soft_pin_s)
        self.groups = list(group_id)
        out = []
        for k, a, n in zip(keys, addrs, sizes):
            if any(b in k for b in self.bad):
                out.append(-800)
            else:
                self.objects.setdefault(k, ctypes.string_at(a, n))
                out.append(0)
        return out


@pytest.fixture
async def saving(tiny):
    """(engine, loop, pool-connector factory, prompt, held blocks): a prefill (2 stages) that computed
    `prompt` and pinned its 5 full chunks for a save."""
    engine = Engine(tiny, EngineConfig(num_blocks=128, chunk_tokens=CHUNK, stages=2))
    loop = EngineLoop(engine, lambda outs: asyncio.sleep(0))
    loop.start()
    prompt = prompt_ids(7, PROMPT)
    seq = await loop.call(lambda: engine.add_request("w", prompt, SamplingParams(max_tokens=1), retain_kv=True))
    while not seq.is_finished:
        await asyncio.sleep(0.01)
    made = []

    def connector(pool, register_pages: bool = True, **kw):
        made.append(PoolConnector(pool, engine, loop, PoolSettings(enabled=True, **kw), register_pages=register_pages))
        return made[-1]

    def hold(conn):
        return conn.hold_for_save(prompt, seq.block_table)

    yield engine, loop, connector, prompt, hold
    await loop.call(lambda: engine.block_manager.release(reversed(seq.block_table)))
    for c in made:
        assert c.saver.held_blocks == 0
    await loop.stop()
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == 128


async def _busy(engine, loop):
    """A request that keeps the engine stepping (decoding) until aborted."""
    return await loop.call(lambda: engine.add_request("busy", prompt_ids(11, 20),
                                                      SamplingParams(max_tokens=1500, ignore_eos=True)))


@pytest.mark.parametrize("how", ["in_place", "unpacked", "foreign"])
async def test_a_two_stage_restore_matches_scratch(saving, tiny, how):
    """Saved by a 2-stage prefill, restored by another: each stage's object lands in its own stage page
    (foreign: both prefills copy through a scratch buffer, register_pages false)."""
    engine, loop, connector, prompt, hold = saving
    pool = MemoryPool()
    conn = connector(pool, register_pages=how != "foreign")
    await conn.save("w", prompt, await loop.call(lambda: hold(conn)), None)
    other = Engine(tiny, EngineConfig(num_blocks=24, chunk_tokens=CHUNK, stages=2))
    other_loop = EngineLoop(other, lambda outs: asyncio.sleep(0))
    other_loop.start()
    try:
        settings = PoolSettings(enabled=True, restore_in_place=how == "in_place")
        restorer = PoolConnector(pool, other, other_loop, settings, register_pages=how != "foreign")
        assert restorer.in_place == (how == "in_place") and restorer.copies.foreign == (how == "foreign")
        full = prompt + prompt_ids(8, 20)
        restored = await restorer.restore("r", full, None)
        assert restored.token_range == (0, 5 * CHUNK) and restorer.counters["verify_failures"] == 0
        assert await _run(other, other_loop, restored, full) == scratch(tiny, full)
    finally:
        await other_loop.stop()
    other.block_manager.check_integrity()


@pytest.mark.parametrize("dtype,suffix,shrink", [("bfloat16", "bf16", 2), ("float8_e4m3fn", "fp8", 4)])
@pytest.mark.parametrize("how", ["unpacked", "foreign"])
async def test_compact_objects_hold_the_kv_rounded_at_a_fraction_of_the_bytes(saving, tiny, how, dtype, suffix,
                                                                                shrink):
    """pool.dtype = bfloat16 or float8_e4m3fn on float32 KV (issue 29): objects in a namespace of their own,
    payloads a half or a quarter of the bytes, and a restore leaves in its blocks exactly the saved KV
    rounded to that type (converted in the pack, widened in the unpack, the CRC over the bytes stored). A
    lossless prefill, or one of the other compact type, never reads them, and a flipped byte is a miss, as
    for any object."""
    engine, loop, connector, prompt, hold = saving
    lossless_pool, pool = MemoryPool(), MemoryPool()
    lossless = connector(lossless_pool, register_pages=how != "foreign")
    await lossless.save("w", prompt, await loop.call(lambda: hold(lossless)), None)
    conn = connector(pool, register_pages=how != "foreign", dtype=dtype)
    assert conn.converts and not conn.in_place
    await conn.save("w", prompt, await loop.call(lambda: hold(conn)), None)
    assert conn.counters["saved_chunks"] == 5 and len(pool.objects) == 5 * 2
    for key, obj in pool.objects.items():
        twin = key.replace(f"-{suffix}/", "/")
        assert f"-{suffix}/" in key and twin in lossless_pool.objects
        assert len(obj) - HEADER_BYTES == (len(lossless_pool.objects[twin]) - HEADER_BYTES) // shrink
    saved_blocks = (await loop.call(lambda: engine.block_manager.match_prefix(prompt, max_tokens=5 * CHUNK))).block_ids

    other = Engine(tiny, EngineConfig(num_blocks=24, chunk_tokens=CHUNK, stages=2))
    other_loop = EngineLoop(other, lambda outs: asyncio.sleep(0))
    other_loop.start()
    try:
        plain = PoolConnector(pool, other, other_loop, PoolSettings(enabled=True), register_pages=how != "foreign")
        assert (await plain.restore("p", prompt, None)).token_range == (0, 0)  # another namespace: no hit
        other_type = "float8_e4m3fn" if dtype == "bfloat16" else "bfloat16"
        crossed = PoolConnector(pool, other, other_loop, PoolSettings(enabled=True, dtype=other_type),
                                register_pages=how != "foreign")
        assert (await crossed.restore("x", prompt, None)).token_range == (0, 0)
        restorer = PoolConnector(pool, other, other_loop, PoolSettings(enabled=True, dtype=dtype),
                                 register_pages=how != "foreign")
        restored = await restorer.restore("r", prompt, None)
        assert restored.token_range == (0, 5 * CHUNK) and restorer.counters["verify_failures"] == 0
        for s in range(2):
            want = engine.pages[s][saved_blocks].to(getattr(torch, dtype)).float()
            assert torch.equal(other.pages[s][restored.pinned], want)
            assert not torch.equal(other.pages[s][restored.pinned], engine.pages[s][saved_blocks])  # lossy indeed
        await other_loop.call(lambda: other.block_manager.release(restored.pinned))
        await other_loop.call(lambda: other.block_manager.reset_prefix_cache())
        key = sorted(pool.objects)[3]
        raw = bytearray(pool.objects[key])
        raw[HEADER_BYTES + 100] ^= 0x01
        pool.objects[key] = bytes(raw)
        again = PoolConnector(pool, other, other_loop, PoolSettings(enabled=True, dtype=dtype),
                              register_pages=how != "foreign")
        partial = await again.restore("r2", prompt, None)
        assert again.counters["verify_failures"] == 1 and partial.token_range[1] < 5 * CHUNK
        await other_loop.call(lambda: other.block_manager.release(partial.pinned))
    finally:
        await other_loop.stop()
    other.block_manager.check_integrity()


async def test_save_waits_for_an_idle_engine_then_puts_once(saving):
    engine, loop, connector, prompt, hold = saving
    pool = MemoryPool()
    conn = connector(pool, save_max_delay_s=60)
    await _busy(engine, loop)
    blocks = await loop.call(lambda: hold(conn))
    task = asyncio.create_task(conn.save("w", prompt, blocks, None))
    await asyncio.sleep(0.5)
    assert not task.done() and pool.puts == [] and conn.saver.held_blocks == 5 * BPC
    assert engine.has_unfinished()
    await loop.call(lambda: engine.abort("busy"))  # idle now
    await asyncio.wait_for(task, 10)
    assert len(pool.puts) == 1 and len(pool.puts[0]) == 5 * 2, "one put for all chunks and stages"
    assert conn.counters["saved_chunks"] == 5 and conn.saver.held_blocks == 0
    assert conn.counters["save_went_idle"] == 1


async def test_save_waits_for_the_handoff_in_flight_then_goes_idle(saving):
    """An idle engine is not enough: the request's own handoff is still moving its KV to decode."""
    engine, loop, connector, prompt, hold = saving
    pool = MemoryPool()
    conn = connector(pool, save_max_delay_s=60)
    handoffs = {"req"}
    conn.saver.handing_off = lambda: bool(handoffs)
    blocks = await loop.call(lambda: hold(conn))
    task = asyncio.create_task(conn.save("w", prompt, blocks, None))
    await loop.call_now(lambda: None)  # engine state changed, the handoff still runs: the save keeps waiting
    await asyncio.sleep(0.3)
    assert not engine.has_unfinished() and not task.done() and pool.puts == []
    handoffs.clear()
    await loop.call_now(lambda: None)  # the handoff's release of its blocks, as prefill does it
    await asyncio.wait_for(task, 10)
    assert len(pool.puts) == 1 and conn.counters["save_went_idle"] == 1


async def test_save_goes_beside_compute_when_it_pins_too_much(saving):
    engine, loop, connector, prompt, hold = saving
    pool = MemoryPool()
    conn = connector(pool, save_max_delay_s=60, save_max_held_fraction=0.1)  # 20 held > 12.8 of 128
    await _busy(engine, loop)
    blocks = await loop.call(lambda: hold(conn))
    await asyncio.wait_for(conn.save("w", prompt, blocks, None), 10)
    assert engine.has_unfinished() and conn.counters["saved_chunks"] == 5
    assert conn.counters["save_went_held_too_many"] == 1
    await loop.call(lambda: engine.abort("busy"))


async def test_save_goes_after_its_max_delay(saving):
    engine, loop, connector, prompt, hold = saving
    conn = connector(MemoryPool(), save_max_delay_s=0.3)
    await _busy(engine, loop)
    blocks = await loop.call(lambda: hold(conn))
    await asyncio.wait_for(conn.save("w", prompt, blocks, None), 10)
    assert engine.has_unfinished() and conn.counters["saved_chunks"] == 5
    assert conn.counters["save_went_max_delay"] == 1
    await loop.call(lambda: engine.abort("busy"))


async def test_a_session_save_waits_for_its_turn_end_to_pin(saving):
    """Session retention: an idle engine is not enough for a session's save; the turn's end decides the soft
    pin (a tool call: the router's pin_s; the task's end: none), and a turn that has not ended when the save
    must go (its max delay) pins for the last pin a returning turn brought."""
    engine, loop, connector, prompt, hold = saving
    pool = MemoryPool()
    conn = connector(pool, save_max_delay_s=60)
    turn = lambda back, pin_s=0.0: SessionTurn("s1", "", back, pin_s)  # noqa: E731

    async def save_of(session: str, rid: str, told=None) -> asyncio.Task:
        blocks = await loop.call(lambda: hold(conn))
        task = asyncio.create_task(conn.save(rid, prompt, blocks, None, "", session))
        await asyncio.sleep(0.3)
        assert not task.done() and conn.saver.held_blocks == 5 * BPC, "an idle engine, but the turn goes on"
        conn.saver.turns.check_integrity()
        if told is not None:
            conn.saver.turn_ended(told)
        return task

    ended = []

    async def after_ended(key):  # prefill demotes the session's blocks: they are free by now
        ended.append((key, conn.saver.held_blocks))

    conn.saver.after_ended = after_ended
    assert not conn.saver.turn_ended(turn(True, 99.0))  # a turn nobody waits for is not kept
    conn.saver.turns.check_integrity()
    await asyncio.wait_for(await save_of("s1", "back", turn(True, 120.0)), 10)
    assert pool.pins == [120.0] and conn.counters["saved_pinned_chunks"] == 5 and ended == []
    for k in list(pool.objects):
        pool.objects.pop(k)
    await asyncio.wait_for(await save_of("s1", "ended", turn(False)), 10)
    assert pool.pins == [120.0, 0.0] and conn.counters["saved_pinned_chunks"] == 5
    assert ended == [(("", "s1"), 0)]
    conn.saver.settings.save_max_delay_s = 0.5
    for k in list(pool.objects):
        pool.objects.pop(k)
    await asyncio.wait_for(await save_of("s1", "no-end"), 10)
    assert pool.pins == [120.0, 0.0, 120.0] and conn.counters["save_turn_unknown"] == 1
    conn.saver.turns.check_integrity()
    assert conn.saver.held_blocks == 0 and not conn.saver.turns._waiting


async def test_cancelled_waiting_save_releases_its_blocks_once(saving):
    engine, loop, connector, prompt, hold = saving
    pool = MemoryPool()
    conn = connector(pool, save_max_delay_s=60)
    await _busy(engine, loop)
    free = engine.block_manager.num_free_blocks
    blocks = await loop.call(lambda: hold(conn))
    task = asyncio.create_task(conn.save("w", prompt, blocks, None))
    await asyncio.sleep(0.2)
    assert not task.done(), conn.counters
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.puts == [] and conn.saver.held_blocks == 0
    await loop.call(lambda: engine.abort("busy"))
    assert engine.block_manager.num_free_blocks >= free  # the save's own references are gone


async def test_a_chunk_whose_put_failed_is_removed_whole_and_not_counted(saving):
    engine, loop, connector, prompt, hold = saving
    digests = __import__("shared.hashing", fromlist=["chunk_hashes"]).chunk_hashes(
        prompt, engine.kv_namespace("").seed, CHUNK)
    pool = FailingPool({f"s1of2/{digests[2].hex()}"})  # chunk 2's stage 1 fails, its stage 0 lands
    conn = connector(pool, save_batch_chunks=2)
    blocks = await loop.call(lambda: hold(conn))
    await conn.save("w", prompt, blocks, None)
    assert [len(p) for p in pool.puts] == [4, 4, 2]  # batches of 2 chunks x 2 stages
    assert conn.counters["saved_chunks"] == 4 and conn.counters["save_failures"] == 1
    assert not any(digests[2].hex() in k for k in pool.objects), "half a chunk stayed in the pool"
    assert len(pool.objects) == 4 * 2
    assert pool.groups == [digests[4].hex()] * 2  # each chunk's stages form one eviction group


# ---- restores: pipelined batches --------------------------------------------------------------------
def test_batch_plan_ends_with_a_batch_of_one_chunk():
    """Nothing overlaps the last batch's verify + unpack: it is one chunk, whatever the batch size."""
    assert batch_plan(0, 4) == []
    assert batch_plan(1, 4) == [(0, 1)]
    assert batch_plan(2, 4) == [(0, 1), (1, 1)]
    assert batch_plan(8, 4) == [(0, 4), (4, 3), (7, 1)]
    assert batch_plan(9, 4) == [(0, 4), (4, 4), (8, 1)]
    assert batch_plan(5, 1) == [(i, 1) for i in range(5)]
    for n in range(40):
        for size in (1, 2, 3, 4, 7):
            plan = batch_plan(n, size)
            assert [b0 for b0, _ in plan] == [sum(k for _, k in plan[:i]) for i in range(len(plan))]
            assert sum(k for _, k in plan) == n and all(1 <= k <= size for _, k in plan)
            assert not plan or plan[-1][1] == 1


@pytest.mark.parametrize("size,reads", [(2, [2, 2, 1]), (3, [3, 1, 1]), (8, [4, 1])])
async def test_pipelined_restore_in_small_batches_matches_scratch(restoring, tiny, size, reads):
    engine, loop, connector = restoring
    conn = connector(restore_batch_chunks=size)  # 5 chunks
    read = "get_into_pieces" if conn.in_place else "get_into"
    calls, plain = [], getattr(conn.client, read)
    setattr(conn.client, read, lambda keys, addrs, sizes: calls.append(len(keys)) or plain(keys, addrs, sizes))
    prompt = prompt_ids(7, PROMPT) + prompt_ids(8, 20)
    restored = await conn.restore("r", prompt, None)
    assert restored.token_range == (0, 5 * CHUNK) and conn.counters["restored_chunks"] == 5
    assert calls == reads
    assert await _run(engine, loop, restored, prompt) == scratch(tiny, prompt)


async def test_restore_into_scattered_blocks_matches_scratch(restoring, tiny):
    """The free blocks are in random order: each chunk's blocks are several runs, read as several pieces
    (in place) or unpacked one by one; the output is still the from-scratch one."""
    engine, loop, connector = restoring
    conn = connector(restore_batch_chunks=2)
    bm = engine.block_manager

    def shuffle_free_list() -> None:
        held = bm.allocate(bm.num_free_blocks)
        random.Random(3).shuffle(held)
        bm.release(held)

    await loop.call_now(shuffle_free_list)
    pieces, plain = [], conn.client.get_into_pieces
    conn.client.get_into_pieces = lambda keys, addrs, sizes: pieces.extend(map(len, addrs)) or plain(keys, addrs, sizes)
    prompt = prompt_ids(7, PROMPT) + prompt_ids(8, 20)
    restored = await conn.restore("r", prompt, None)
    assert restored.token_range == (0, 5 * CHUNK)
    if conn.in_place:
        assert len(pieces) == 5 and max(pieces) > 2  # a header and more than one run of blocks
    assert await _run(engine, loop, restored, prompt) == scratch(tiny, prompt)


async def test_corrupt_object_in_a_later_batch_ends_the_restore_before_it(restoring, tiny):
    engine, loop, connector = restoring
    conn = connector(restore_batch_chunks=2)
    pool = conn.client
    prompt = prompt_ids(7, PROMPT) + prompt_ids(8, 20)
    [key] = conn.keys(__import__("shared.hashing", fromlist=["chunk_hashes"]).chunk_hashes(
        prompt, engine.kv_namespace("").seed, CHUNK)[3], engine.kv_namespace(""))
    raw = bytearray(pool.objects[key])
    raw[-5] ^= 0x10
    pool.objects[key] = bytes(raw)
    restored = await conn.restore("r", prompt, None)
    assert restored.token_range == (0, 3 * CHUNK) and conn.counters["verify_failures"] == 1
    assert conn.counters["restore_partial"] == 1
    # the bad chunk was unpacked before its checksum was known: its blocks must not be findable
    ns = engine.kv_namespace("")
    match = await loop.call_now(lambda: engine.block_manager.match_prefix(prompt, len(prompt) - 1, seed=ns.seed))
    assert match.num_tokens == 3 * CHUNK
    assert await _run(engine, loop, restored, prompt) == scratch(tiny, prompt)
    assert engine.block_manager.num_free_blocks == 24


async def test_a_read_that_raises_mid_restore_gives_every_block_back(restoring):
    """The second batch's read raises: the restore fails (prefill then computes) and holds nothing."""
    engine, loop, connector = restoring
    conn = connector(restore_batch_chunks=2)
    pool, calls = conn.client, []
    read = "get_into_pieces" if conn.in_place else "get_into"
    plain = getattr(pool, read)

    def get_into(keys, addrs, sizes):
        calls.append(len(keys))
        if len(calls) == 2:
            raise RuntimeError("transfer engine gone")
        return plain(keys, addrs, sizes)

    setattr(pool, read, get_into)
    with pytest.raises(RuntimeError, match="transfer engine gone"):
        await conn.restore("r", prompt_ids(7, PROMPT) + prompt_ids(8, 20), None)
    assert len(calls) >= 2 and engine.block_manager.num_free_blocks == 24


async def test_save_max_mbps_paces_the_puts(saving):
    """save_max_mbps: a put starts only once the previous puts' bytes have had their time at that rate
    (a lower bound on the gap, so load cannot make it fail)."""
    engine, loop, connector, prompt, hold = saving
    import time as _time

    class Forgetful(MemoryPool):  # never has anything: every save puts
        def exists(self, keys):
            return [False] * len(keys)

        def put_from(self, keys, addrs, sizes, group_id=None, soft_pin_s=0.0):
            self.times = getattr(self, "times", []) + [_time.monotonic()]
            return super().put_from(keys, addrs, sizes, group_id, soft_pin_s)

    pool = Forgetful()
    probe = connector(MemoryPool())
    nbytes = 5 * probe.chunk_bytes
    conn = connector(pool, save_max_mbps=nbytes / 1e6 / 0.4)  # one save's bytes take 0.4 s at this rate
    for _ in range(2):
        blocks = await loop.call(lambda: hold(conn))
        await conn.save("w", prompt, blocks, None)
    assert len(pool.times) == 2 and pool.times[1] - pool.times[0] >= 0.39


async def test_prefetch_brings_a_paused_session_back_into_free_blocks_only(saving, tiny):
    """Prefetch on resume (services/prefill/prefetch.py): halfway through the expected pause, the chunks of the
    session's last prompt come back from the pool into free blocks, and its next request finds them on the
    device (used) and computes from them the tokens it would have from scratch. Cached blocks of a session
    expected back sooner are never taken (those of one expected later are); prefetched blocks evicted before
    the return are wasted."""
    from services.prefill.prefetch import PREFETCH_AT, Prefetcher
    from shared.sessions import SessionIndex, SessionKV

    engine, loop, connector, prompt, hold = saving
    pool = MemoryPool()
    saver = connector(pool)
    await saver.save("w", prompt, await loop.call(lambda: hold(saver)), None)
    other = Engine(tiny, EngineConfig(num_blocks=48, chunk_tokens=CHUNK, stages=2))
    other_loop = EngineLoop(other, lambda outs: asyncio.sleep(0))
    other_loop.start()
    tasks = []
    try:
        conn = PoolConnector(pool, other, other_loop, PoolSettings(enabled=True))
        sessions = SessionIndex()
        pf = Prefetcher(conn, lambda coro: tasks.append(asyncio.ensure_future(coro)), sessions)
        bm, key, sooner = other.block_manager, ("", "s1"), ("", "p")

        async def device_tokens(p):
            return await other_loop.call(lambda: bm.match_prefix(p, max_tokens=len(p) - 1).num_tokens)

        async def pause(expect_s: float):
            pf.expect(key, expect_s)
            await asyncio.sleep(expect_s * PREFETCH_AT + 0.2)
            await asyncio.gather(*tasks)
            pf.check_integrity()

        pf.submitted(key, prompt)
        pf.expect(("", "unknown"), 0.2)  # a session it never saw: nothing
        await pause(0.0)  # the router has seen too few pauses: no prefetch
        assert pf.counters["prefetches"] == 0 and await device_tokens(prompt) == 0
        # another paused session's 5 cached chunks are all the device has free, with 2 plain blocks
        other_prompt = prompt_ids(12, PROMPT)
        seq = await other_loop.call(lambda: other.add_request("p", other_prompt, SamplingParams(max_tokens=1)))
        while not seq.is_finished:
            await asyncio.sleep(0.01)
        sessions.record(sooner, SessionKV(tuple(bm.block_hashes(other_prompt)), ()))
        pf.submitted(sooner, other_prompt)
        busy = await other_loop.call(lambda: bm.allocate(bm.num_plain_free_blocks - 2))
        assert bm.num_free_blocks == 2 + 5 * BPC
        pf.expect(sooner, 0.1)  # back sooner than s1: its blocks are kept
        await pause(0.2)
        # s1's prefetch found no block it may take; p's own found its history still on the device
        assert pf.counters["prefetches"] == 0 and pf.counters["prefetch_nothing_to_do"] == 2
        assert await device_tokens(other_prompt) == 5 * CHUNK
        pf.expect(sooner, 100.0)  # back later than s1: its blocks may go
        await pause(0.2)
        assert pf.counters["prefetches"] == 1 and await device_tokens(other_prompt) < 5 * CHUNK
        await other_loop.call(lambda: bm.release(busy))
        await other_loop.call(lambda: bm.drop_cached(bm.block_hashes(prompt)))  # evicted before s1 came back
        pf.submitted(key, prompt)
        await asyncio.gather(*tasks)
        assert pf.counters["prefetch_wasted"] == 1
        await pause(0.2)
        assert pf.counters["prefetches"] == 2 and pf.counters["prefetched_chunks"] == 10
        assert await device_tokens(prompt) == 5 * CHUNK
        full = prompt + prompt_ids(8, 20)
        pf.submitted(key, full)  # the session is back
        await asyncio.gather(*tasks)
        assert pf.counters["prefetch_used"] == 1 and pf.counters["prefetch_wasted"] == 1
        restored = await conn.restore("r", full, None)
        assert restored.token_range == (0, 0) and len(restored.pinned) == 5 * BPC  # all from the device
        assert await _run(other, other_loop, restored, full) == scratch(tiny, full)
        # again, but the device loses the prefetched blocks before the session returns
        await other_loop.call(lambda: bm.drop_cached(bm.block_hashes(full)))
        await pause(0.2)
        assert pf.counters["prefetches"] == 3
        await other_loop.call(lambda: bm.drop_cached(bm.block_hashes(full)))
        pf.submitted(key, full + prompt_ids(9, 20))
        await asyncio.gather(*tasks)
        assert pf.counters["prefetch_wasted"] == 2
        await pause(0.2)  # again, then closed: wasted too
        pf.forget(key)
        assert pf.counters["prefetch_wasted"] == 3
        pf.check_integrity()
        await pf.close()
    finally:
        await other_loop.stop()
    other.block_manager.check_integrity()
