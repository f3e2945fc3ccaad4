"""The stores' disk tier end to end (services/store/disk_serve.py): a real master, one real store with a disk
tier, prefill, decode, gate and router. A history the DRAM pool evicted comes back from the store's disk and
is restored as a pool hit, token for token what the model says from scratch; a corrupted file on disk is a
miss, never served; a store killed with its objects acknowledged on disk serves them after its restart."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from urllib.parse import quote, unquote

import pytest

from shared.config import load_config
from shared.hashing import CHUNK_TOKENS, chunk_hashes, namespace_seed
from infra.up import UpConfig, launched
from tests.natsbus import latest_reports, nats_url
from tests.test_pool_e2e import complete, scratch_text, tokens

STORE_BYTES = 16 << 20  # 16 one-MiB chunk objects of tiny's KV: five 1,200-token fillers push a history out


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    with nats_url() as url:
        cfg = load_config(UpConfig, overrides=[
            "up.model=tiny", "up.port=0", f"up.nats_url={url}", "up.stores=1", f"up.store_bytes={STORE_BYTES}",
            f"up.run_dir={tmp_path_factory.mktemp('disk')}", "up.disk_bytes=268435456", "up.ready_timeout_s=120",
            "prefill.engine.num_blocks=80",   # 1280 tokens of device KV: a filler evicts a history there
            "prefill.pool.min_restore_tokens=256", "decode.engine.num_blocks=512"])
        with launched(cfg) as (launcher, base):
            yield launcher, base, url


def store_report(nats: str) -> dict:
    seen = asyncio.run(latest_reports(nats, enough=lambda s: "store-0" in s and "prefill-0" in s))
    return {"store": seen["store-0"].detail["disk"], "prefill": seen["prefill-0"].detail["pool"]}


def listed(launcher) -> list[str]:
    """The keys the store's disk tier holds, from its directory (the layout services/store/disk.py documents)."""
    objects = launcher.run_dir / "disk" / "store-0" / "objects"
    return [unquote(p.name) for p in objects.iterdir() if not p.name.endswith(".tmp")]


def history_keys(launcher, nats: str, history: list[int], timeout: float = 30.0) -> list[str]:
    """The keys of the history's full chunks, in order, once every one is on the store's disk (spills are
    asynchronous)."""
    seen = asyncio.run(latest_reports(nats, enough=lambda s: "prefill-0" in s))
    seed = namespace_seed(seen["prefill-0"].detail["kv_namespace"])
    digests = [d.hex() for d in chunk_hashes(history, seed, CHUNK_TOKENS)[:len(history) // CHUNK_TOKENS]]
    deadline = time.monotonic() + timeout
    while True:
        keys = sorted((k for k in listed(launcher) if k.rsplit("/", 1)[-1] in digests),
                      key=lambda k: digests.index(k.rsplit("/", 1)[-1]))
        if len(keys) == len(digests) or time.monotonic() > deadline:
            assert len(keys) == len(digests), f"on disk: {len(keys)} of the history's {len(digests)} chunks"
            return keys
        time.sleep(0.5)


def pool_keys(nats: str) -> set[str]:
    """The keys the DRAM pool holds, from the master's listing (read-only: asking grants no lease, which
    would keep the objects from being evicted)."""
    seen = asyncio.run(latest_reports(nats, enough=lambda s: "master-0" in s))
    url = seen["master-0"].detail["metrics_url"].removesuffix("/metrics") + "/get_all_keys"
    with urllib.request.urlopen(url, timeout=10) as r:  # noqa: S310 - the test's own loopback master
        return set(r.read().decode().split())


def push_out(base: str, nats: str, keys: list[str], salt: int) -> None:
    """Fillers until these objects have left the DRAM pool (and the history prefill's device cache)."""
    for i in range(12):
        complete(base, tokens(salt * 100 + i, 1200), f"filler-{salt}-{i}")
        if i >= 4 and not set(keys) & pool_keys(nats):
            return
    raise AssertionError("the history never left the pool")


def test_a_history_evicted_from_dram_comes_back_from_disk(system, tiny):
    launcher, base, nats = system
    history = tokens(1, 700)
    first = complete(base, history, "s-disk")
    assert first["choices"][0]["text"] == scratch_text(tiny, history)
    push_out(base, nats, history_keys(launcher, nats, history), 1)
    before = store_report(nats)
    turn2 = history + tokens(2, 60)
    second = complete(base, turn2, "s-disk")
    assert second["usage"]["moorage"]["store"] == 2 * CHUNK_TOKENS  # both chunks: disk -> pool -> prefill
    assert second["choices"][0]["text"] == scratch_text(tiny, turn2)
    after = store_report(nats)
    assert after["prefill"]["disk_loaded_chunks"] - before["prefill"]["disk_loaded_chunks"] == 2
    assert after["store"]["read"] - before["store"]["read"] == 2
    assert after["store"]["verify_failures"] == before["store"]["verify_failures"]


def test_a_corrupted_file_on_disk_is_a_miss_never_served(system, tiny):
    launcher, base, nats = system
    history = tokens(3, 700)
    complete(base, history, "s-corrupt")
    keys = history_keys(launcher, nats, history)
    push_out(base, nats, keys, 2)
    path = launcher.run_dir / "disk" / "store-0" / "objects" / quote(keys[0], safe="")
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x40  # one bit of the payload
    path.write_bytes(bytes(raw))
    before = store_report(nats)
    turn2 = history + tokens(4, 60)
    second = complete(base, turn2, "s-corrupt")
    assert second["usage"]["moorage"]["store"] == 0  # the first chunk failed: nothing after it counts either
    assert second["choices"][0]["text"] == scratch_text(tiny, turn2)
    after = store_report(nats)
    assert after["store"]["verify_failures"] == before["store"]["verify_failures"] + 1
    # deleted at once; the turn's own save brought the chunk back into the pool, and a good copy to disk
    assert not path.exists() or path.read_bytes() != bytes(raw)


def test_a_killed_store_serves_from_disk_what_it_acknowledged(system, tiny):
    launcher, base, nats = system
    history = tokens(5, 700)
    complete(base, history, "s-killed")
    history_keys(launcher, nats, history)
    launcher.procs["store-0"].kill()  # its DRAM objects die with it; `moorage up` restarts it
    deadline = time.monotonic() + 90
    while launcher.restarts()["store-0"] < 1 or "store-0" not in asyncio.run(latest_reports(nats)):
        assert time.monotonic() < deadline, "store-0 was not restarted"
        time.sleep(0.5)
    complete(base, tokens(50, 1200), "s-killed-filler")  # the device cache lets the history go
    turn2 = history + tokens(6, 60)
    second = complete(base, turn2, "s-killed")
    assert second["usage"]["moorage"]["store"] == 2 * CHUNK_TOKENS
    assert second["choices"][0]["text"] == scratch_text(tiny, turn2)
