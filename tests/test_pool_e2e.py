"""The shared pool end to end: a real master, two real store services, two prefill instances (KV split
into two pipeline stages), decode, gate and router. A turn whose history left device memory restores
it from the pool, computes only its new tokens, and says so in `usage`; whatever goes wrong in the
pool (a missing stage object, a corrupted object, a store that died), the output stays exactly the
from-scratch output."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
import torch

from shared.config import load_config
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.hashing import CHUNK_TOKENS, chunk_hashes, namespace_seed
from shared.kv_object import HEADER_BYTES, object_key
from shared.messages import LoadReport
from shared.pool import PoolClient, PoolConfig
from shared.tracing import read_spans
from infra.up import UpConfig, launched
from tests.natsbus import latest_reports, nats_url

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    with nats_url() as url:
        cfg = load_config(UpConfig, overrides=[
            "up.model=tiny", "up.port=0", f"up.nats_url={url}", "up.prefills=2",
            f"up.run_dir={tmp_path_factory.mktemp('pool')}", "up.store_bytes=67108864", "up.ready_timeout_s=120",
            "prefill.engine.num_blocks=80",   # 1280 tokens of device KV: a second session evicts the first
            "prefill.engine.stages=2", "prefill.pool.min_restore_tokens=256",
            "router.router.instance_timeout_s=2", "decode.engine.num_blocks=512",
            "master.master.client_ttl_s=2",  # a dead store is dropped from the pool after this
            "up.disk_bytes=0"])  # the DRAM pool's own behaviour: no disk tier to put back what a test removes
        with launched(cfg) as (launcher, base):
            yield launcher, base, url


def complete(base: str, prompt: list[int], session: str, max_tokens: int = MAX_TOKENS) -> dict:
    r = httpx.post(base + "/v1/completions", timeout=120, headers={"X-Session-ID": session}, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    u = body["usage"]
    assert u["moorage"]["device"] + u["moorage"]["store"] + u["moorage"]["computed"] == u["prompt_tokens"]
    assert u["prompt_tokens_details"]["cached_tokens"] == u["moorage"]["device"] + u["moorage"]["store"]
    return body


def scratch_text(tiny, prompt: list[int]) -> str:
    engine = Engine(tiny, EngineConfig(num_blocks=256, enable_prefix_cache=False))
    [seq] = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return seq.output_text


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def reports(nats: str, prefills: int = 1) -> dict[str, LoadReport]:
    """Latest report per instance, once `prefills` prefills have reported."""
    return await latest_reports(nats, enough=lambda seen: sum(r.role == "prefill" for r in seen.values()) >= prefills)


def evict_device(base: str, session: str, salt: int) -> None:
    """Fill the sticky prefill's 80-block device cache with another history."""
    complete(base, tokens(10_000 + salt, 1200), session)


def owner_of(nats: str, served_before: dict[str, int]) -> str:
    """The prefill whose restore/save counters moved (which instance served the last turns)."""
    now = asyncio.run(reports(nats, prefills=2))
    moved = [i for i, r in now.items() if r.role == "prefill"
             and r.detail["pool"]["saved_chunks"] != served_before.get(i, 0)]
    assert len(moved) == 1, moved
    return moved[0]


def trace_of(launcher, response_id: str, want: set[str]) -> list[dict]:
    """The spans of one request's trace (waits for the exporters to flush)."""
    request_id = "req-" + response_id.split("-", 1)[1]
    deadline = time.monotonic() + 15
    while True:
        spans = read_spans(launcher.run_dir / "traces.jsonl")
        root = [s for s in spans if s["name"] == "router.request" and s["attributes"].get("request_id") == request_id]
        trace = [s for s in spans if root and s["trace_id"] == root[0]["trace_id"]]
        if want <= {s["name"] for s in trace} or time.monotonic() > deadline:
            return trace
        time.sleep(0.3)


def test_turn_restores_history_from_pool_after_device_eviction(system, tiny):
    launcher, base, _ = system
    history = tokens(1, 700)
    first = complete(base, history, "s-evict")
    assert first["choices"][0]["text"] == scratch_text(tiny, history)
    evict_device(base, "s-evict", 1)
    turn2 = history + tokens(2, 60)
    second = complete(base, turn2, "s-evict")
    assert second["usage"]["moorage"]["store"] == 2 * CHUNK_TOKENS  # both full chunks came from the pool
    assert second["usage"]["moorage"]["computed"] == len(turn2) - 2 * CHUNK_TOKENS
    assert second["choices"][0]["text"] == scratch_text(tiny, turn2)
    saved = {s["name"]: s for s in trace_of(launcher, first["id"], {"store.save"})}
    assert saved["store.save"]["attributes"]["chunks"] == 2
    spans = {s["name"]: s for s in trace_of(launcher, second["id"], {"store.lookup", "store.restore"})}
    restore = spans["store.restore"]["attributes"]
    assert spans["store.lookup"]["attributes"]["hit_chunks"] == 2
    assert restore["chunks"] == 2 and restore["bytes"] > 0 and "stage1_ms" in restore
    # read from the stores' memory by prefill's own Transfer Engine (pool.restore_direct_reads), all 2 x 2 objects
    assert restore["read_direct"] == 4 and restore["read_through_store"] == 0


def test_turn_that_ends_in_prefill_still_saves_its_history(system, tiny):
    """max_tokens=1 finishes in prefill (no handoff): its full chunks must reach the pool all the same."""
    launcher, base, _ = system
    history = tokens(20, 600)
    first = complete(base, history, "s-short", max_tokens=1)
    assert first["usage"]["completion_tokens"] == 1
    saved = {s["name"]: s for s in trace_of(launcher, first["id"], {"store.save"})}
    assert saved["store.save"]["attributes"]["chunks"] == 2
    evict_device(base, "s-short", 20)
    turn2 = history + tokens(21, 40)
    second = complete(base, turn2, "s-short")
    assert second["usage"]["moorage"]["store"] == 2 * CHUNK_TOKENS
    assert second["choices"][0]["text"] == scratch_text(tiny, turn2)


def pool_client(system) -> tuple[PoolClient, str]:
    """A client of the same pool, and the prefills' KV namespace (to name their objects)."""
    launcher, _, nats = system
    client = PoolClient(PoolConfig(master_addr=launcher.configs["prefill-0"].pool.master_addr))
    ns = next(r.detail["kv_namespace"] for r in asyncio.run(reports(nats)).values() if r.role == "prefill")
    return client, ns


def test_chunk_missing_a_stage_is_not_a_hit(system, tiny):
    _, base, _ = system
    history = tokens(3, 700)
    complete(base, history, "s-stage")
    client, ns = pool_client(system)
    try:
        digests = chunk_hashes(history, namespace_seed(ns))
        time.sleep(1.0)  # the save is asynchronous: let it land
        assert client.exists([object_key(ns, s, 2, d) for d in digests for s in range(2)]) == [True] * 4
        assert client.remove([object_key(ns, 1, 2, digests[1])], force=True) == [0]  # chunk 1 loses stage 1
    finally:
        client.close()
    evict_device(base, "s-stage", 3)
    turn2 = history + tokens(4, 40)
    second = complete(base, turn2, "s-stage")
    assert second["usage"]["moorage"]["store"] == CHUNK_TOKENS  # chunk 0 only
    assert second["choices"][0]["text"] == scratch_text(tiny, turn2)


def test_corrupted_object_is_detected_and_recomputed(system, tiny):
    _, base, nats = system
    history = tokens(5, 600)
    complete(base, history, "s-corrupt")
    client, ns = pool_client(system)
    try:
        time.sleep(1.0)
        key = object_key(ns, 0, 2, chunk_hashes(history, namespace_seed(ns))[0])
        buf = torch.zeros(8 << 20, dtype=torch.uint8)
        client.register(buf)
        [n] = client.get_into([key], [buf.data_ptr()], [buf.numel()])
        assert n > HEADER_BYTES
        buf[HEADER_BYTES + 123] ^= 0xFF  # one flipped payload byte; the header still names the object
        assert client.remove([key], force=True) == [0]
        assert client.put_from([key], [buf.data_ptr()], [n]) == [0]
    finally:
        client.close()
    failures = {i: r.detail["pool"]["verify_failures"] for i, r in asyncio.run(reports(nats)).items()
                if r.role == "prefill"}
    evict_device(base, "s-corrupt", 5)
    turn2 = history + tokens(6, 30)
    second = complete(base, turn2, "s-corrupt")
    assert second["usage"]["moorage"]["store"] == 0  # chunk 0 failed verification: nothing after it is used
    assert second["choices"][0]["text"] == scratch_text(tiny, turn2)
    after = {i: r.detail["pool"]["verify_failures"] for i, r in asyncio.run(reports(nats)).items()
             if r.role == "prefill"}
    assert sum(after.values()) > sum(failures.values())


def test_next_turn_restores_on_the_other_prefill_when_its_owner_stops(system, tiny):
    launcher, base, nats = system
    before = {i: r.detail["pool"]["saved_chunks"] for i, r in asyncio.run(reports(nats, prefills=2)).items()
              if r.role == "prefill"}
    history = tokens(7, 800)
    complete(base, history, "s-move")
    time.sleep(1.0)
    owner = owner_of(nats, before)
    launcher.procs[owner].send_signal(signal.SIGTERM)
    assert launcher.procs[owner].wait(30) == 0
    turn2 = history + tokens(8, 50)
    second = complete(base, turn2, "s-move")
    assert second["usage"]["moorage"]["store"] == 3 * CHUNK_TOKENS  # every full chunk, from the pool
    assert second["choices"][0]["text"] == scratch_text(tiny, turn2)


def test_killed_store_costs_hits_not_correctness(system, tiny):
    launcher, base, _ = system
    history = tokens(9, 1100)
    complete(base, history, "s-store")
    time.sleep(1.0)
    launcher.procs["store-1"].kill()
    launcher.procs["store-1"].wait(10)
    evict_device(base, "s-store", 9)
    turn2 = history + tokens(10, 40)
    second = complete(base, turn2, "s-store")  # chunks on store-1 are misses (or errors): computed
    assert second["usage"]["moorage"]["store"] < 4 * CHUNK_TOKENS
    assert second["choices"][0]["text"] == scratch_text(tiny, turn2)
    # once the master drops the dead store (client_ttl_s), the pool keeps serving from the survivor:
    # a new history is saved there and restored
    time.sleep(3.0)
    fresh = tokens(11, 600)
    complete(base, fresh, "s-after")
    time.sleep(1.0)
    evict_device(base, "s-after", 11)
    again = complete(base, fresh + tokens(12, 20), "s-after")
    assert again["usage"]["moorage"]["store"] == 2 * CHUNK_TOKENS
    assert again["choices"][0]["text"] == scratch_text(tiny, fresh + tokens(12, 20))
