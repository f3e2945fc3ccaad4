"""Prefill's pool connector, its block bookkeeping in one process: a real tiny engine, and an in-memory
stand-in for PoolClient (same calls, bytes copied to and from the registered addresses). The real
Mooncake pool is exercised end to end in test_pool_e2e; here the interleavings are pinned down.

- A restore whose hit chunks do not fit in the free device blocks waits for them (computing those tokens
  would need the same blocks) instead of recomputing history the pool holds; with `restore_wait_s=0` it
  restores what fits.
- Whatever it restores, the output stays exactly the from-scratch output, and every block comes back.
"""

from __future__ import annotations

import asyncio
import ctypes

import pytest
import torch

from services.prefill.config import PoolSettings
from services.prefill.pool import PoolConnector
from shared.engine.engine import Engine, EngineConfig
from shared.engine.loop import EngineLoop
from shared.engine.sampling import SamplingParams

CHUNK = 64
BPC = CHUNK // 16  # blocks per chunk
PROMPT = 5 * CHUNK + 10


class MemoryPool:
    """PoolClient's surface over a dict (keys -> bytes)."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}

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

    def put_from(self, keys, addrs, sizes, group_id=None):
        for k, a, n in zip(keys, addrs, sizes):
            self.objects.setdefault(k, ctypes.string_at(a, n))
        return [0] * len(keys)

    def remove(self, keys, force=False):
        for k in keys:
            self.objects.pop(k, None)
        return [0] * len(keys)


def prompt_ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def _prefilled_pool(tiny, pool: MemoryPool, prompt: list[int]) -> None:
    """Another prefill computed `prompt` and saved its full chunks."""
    engine = Engine(tiny, EngineConfig(num_blocks=64, chunk_tokens=CHUNK))
    loop = EngineLoop(engine, lambda outs: asyncio.sleep(0))
    loop.start()
    try:
        conn = PoolConnector(pool, engine, loop, PoolSettings(enabled=True))
        seq = await loop.call(lambda: engine.add_request("w", prompt, SamplingParams(max_tokens=1), retain_kv=True))
        while not seq.is_finished:
            await asyncio.sleep(0.01)
        blocks = await loop.call(lambda: conn.hold_for_save(prompt, seq.block_table))
        await loop.call(lambda: engine.block_manager.release(reversed(seq.block_table)))
        await conn.save("w", prompt, blocks, None)
    finally:
        await loop.stop()
    assert conn.counters["saved_chunks"] == PROMPT // CHUNK


@pytest.fixture
async def restoring(tiny):
    """(engine, connector factory): a prefill with 24 blocks (6 chunks) of device KV, an empty device
    cache, and a pool that holds the 5 full chunks of the prompt."""
    pool = MemoryPool()
    await _prefilled_pool(tiny, pool, prompt_ids(7, PROMPT))
    engine = Engine(tiny, EngineConfig(num_blocks=24, chunk_tokens=CHUNK))
    loop = EngineLoop(engine, lambda outs: asyncio.sleep(0))
    loop.start()
    yield engine, loop, lambda **kw: PoolConnector(pool, engine, loop, PoolSettings(enabled=True, **kw))
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
