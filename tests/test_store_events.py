"""Store-tier KV events: the master reports chunks that leave the pool, so the router's store index follows
the pool instead of only growing.

Pure logic first (key parsing, the listing diff with prefills' claims, the index), then the real thing:
a master service (supervising mooncake_master) and a store service with a 16 MiB segment, filled with
2 MiB chunks far past its size so the pool evicts all the time, a prefill-like client that claims each
save on the bus, and the router's KVIndex fed by the bus. The index must end equal to the pool's own key
list (true) and never hold more than the pool can (bounded); then the store is killed (every chunk goes,
cause "store_gone") and mooncake_master is killed (the pool is "cleared").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import torch

from services.master.store_tier import StoreTier, parse_keys
from services.router.kv_index import KVIndex
from shared.kv_object import object_key

REPO = Path(__file__).resolve().parents[1]
NS = "tiny-ns"


def d(i: int) -> bytes:
    return i.to_bytes(16, "big")


def keys_of(*chunks: int, stages: int = 2, ns: str = NS) -> list[str]:
    return [object_key(ns, s, stages, d(c)) for c in chunks for s in range(stages)]


# ---- pure logic ------------------------------------------------------------------------------------

def test_parse_keys_counts_a_chunk_only_with_every_stage():
    keys = keys_of(1, 2) + [object_key(NS, 0, 2, d(3))] + ["other/key", f"{NS}/s2of2/{d(4).hex()}", "x/s0of1/zz"]
    listing = parse_keys(keys)
    assert listing.chunks == {d(1), d(2)}
    assert listing.partial == 1 and listing.foreign == 3


def test_tier_reports_what_left_and_what_came():
    tier = StoreTier()
    tier.begin_listing()
    assert tier.observe(parse_keys(keys_of(1, 2))).stored == [d(1), d(2)]
    tier.begin_listing()
    diff = tier.observe(parse_keys(keys_of(2, 3)))
    assert diff.stored == [d(3)] and diff.removed == [d(1)]
    assert tier.counters["stored"] == 3 and tier.counters["removed"] == 1 and tier.held == {d(2), d(3)}


def test_claimed_chunk_gone_before_the_listing_is_reported_removed():
    """A save the pool evicted within one interval: the prefill said "stored", so the master says "removed"."""
    tier = StoreTier()
    tier.claim([d(7), b"short"])
    tier.begin_listing()
    assert tier.observe(parse_keys(keys_of(1))).removed == [d(7)]


def test_claim_during_a_listing_waits_for_the_next_one():
    tier = StoreTier()
    tier.begin_listing()
    tier.claim([d(8)])                     # the listing in flight may predate this save
    assert tier.observe(parse_keys([])).removed == []
    tier.begin_listing()
    assert tier.observe(parse_keys([])).removed == [d(8)]


def test_failed_listing_keeps_claims_and_clear_forgets_everything():
    tier = StoreTier()
    tier.claim([d(1)])
    tier.begin_listing()
    tier.listing_failed()
    tier.begin_listing()
    assert tier.observe(parse_keys([])).removed == [d(1)]
    tier.begin_listing()
    tier.observe(parse_keys(keys_of(5)))
    tier.clear()
    tier.begin_listing()
    assert tier.observe(parse_keys([])).removed == [] and tier.counters["cleared"] == 1


def test_index_follows_store_events_and_counts_transfers():
    idx = KVIndex(max_store_chunks=3)
    idx.apply("prefill-0", [{"type": "stored", "hashes": [d(1), d(2)], "medium": "store"}])
    idx.apply("master-0", [{"type": "removed", "hashes": [d(1)], "medium": "store", "causes": ["evicted"]}])
    assert idx.store_prefix([d(1), d(2)]) == 0 and idx.store_prefix([d(2), d(1)]) == 1
    idx.apply("prefill-0", [{"type": "stored", "hashes": [d(i) for i in range(10, 20)], "medium": "store"}])
    assert idx.store_chunks == 3  # bounded whatever the publishers say
    idx.apply("prefill-0", [{"type": "transferred", "hashes": [d(1)], "medium": "device", "to": "decode-0"}])
    idx.apply("master-0", [{"type": "cleared", "hashes": [], "medium": "store"}])
    assert idx.store_chunks == 0 and idx.blocks("prefill-0") == 0
    assert idx.counts == {"stored/store": 2, "removed/store": 1, "transferred/device": 1, "cleared/store": 1}
    idx.check_integrity()


# ---- a real master, a real store, the real bus -------------------------------------------------------

def start(tmp: Path, name: str, service: str, url: str, *sets: str) -> subprocess.Popen:
    args = [sys.executable, "-m", f"services.{service}", "--set", f"bus.url={url}", "--set", f"instance={name}",
            "--set", "load_interval_s=0.2", "--set", "tracing.exporter=none", "--set", "http.port=-1",
            *[a for s in sets for a in ("--set", s)]]
    log = open(tmp / f"{name}.log", "wb")
    return subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def pool_truth(metrics_url: str) -> set[bytes]:
    base = metrics_url.rsplit("/", 1)[0]
    with urllib.request.urlopen(base + "/get_all_keys", timeout=5) as r:
        return parse_keys(k for k in r.read().decode().splitlines() if k).chunks


class Watcher:
    """The router's KVIndex, fed from the bus; `until(pred)` waits for an event after which pred holds."""

    def __init__(self, bus):
        self.bus, self.index, self.events, self.reports = bus, KVIndex(), [], {}
        self.changed = asyncio.Condition()

    async def start(self) -> None:
        from shared.messages import KVEventBatch, LoadReport

        async def on_events(batch, _raw):
            self.index.apply(batch.instance, batch.events)
            self.events += [(batch.instance, e) for e in batch.events]
            async with self.changed:
                self.changed.notify_all()

        async def on_load(report, _raw):
            self.reports[report.instance] = report
            async with self.changed:
                self.changed.notify_all()

        await self.bus.subscribe(self.bus.subjects.kv_events("*"), KVEventBatch, on_events)
        await self.bus.subscribe(self.bus.subjects.load_all, LoadReport, on_load)

    async def until(self, pred, timeout: float, what: str) -> None:
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(pred), timeout)
            except asyncio.TimeoutError:
                raise AssertionError(f"timed out waiting for {what}") from None


def test_router_index_follows_forced_evictions_store_loss_and_master_restart(nats_url, tmp_path):
    from shared.bus import Bus, BusConfig
    from shared.messages import KVEventBatch
    from shared.pool import PoolClient, PoolConfig
    from shared.sockets import free_port

    rpc = free_port()
    master = start(tmp_path, "master-0", "master", nats_url, f"master.rpc_port={rpc}", "master.events_interval_s=0.3",
                   "master.client_ttl_s=2", "master.restart_backoff_s=0.2")
    store = None
    try:
        async def scenario() -> None:
            nonlocal store
            bus = await Bus.connect(BusConfig(url=nats_url), "test-router")
            w = Watcher(bus)
            await w.start()
            await w.until(lambda: "master-0" in w.reports and w.reports["master-0"].ready, 60, "the master")
            store = start(tmp_path, "store-0", "store", nats_url, f"store.master_addr=127.0.0.1:{rpc}",
                          f"store.segment_bytes={16 << 20}", "store.hugepages=off")
            await w.until(lambda: w.reports.get("store-0") and w.reports["store-0"].ready, 60, "the store")
            client = await asyncio.to_thread(PoolClient, PoolConfig(master_addr=f"127.0.0.1:{rpc}"))
            buf = torch.zeros(1 << 20, dtype=torch.uint8)
            client.register(buf)
            saved = 0
            for c in range(60):  # 60 chunks x 2 stages x 1 MiB into a 16 MiB pool: constant eviction
                keys = keys_of(100 + c)
                rc = await asyncio.to_thread(client.put_from, keys, [buf.data_ptr()] * 2, [1 << 20] * 2,
                                             d(100 + c).hex())
                if rc == [0, 0]:
                    saved += 1
                    await bus.publish(bus.subjects.kv_events("prefill-x"), KVEventBatch("prefill-x", [
                        {"type": "stored", "hashes": [d(100 + c)], "medium": "store"}]))
                await asyncio.sleep(0.03)
            await asyncio.to_thread(client.close)
            metrics_url = w.reports["master-0"].detail["metrics_url"]
            truth = await asyncio.to_thread(pool_truth, metrics_url)
            assert saved >= 40 and 0 < len(truth) <= 8  # the pool holds at most 16 MiB / 2 MiB chunks
            await w.until(lambda: w.index.store_chunks == len(truth) and all(map(w.index.store_holds, truth)), 30,
                          f"the index to equal the pool ({len(truth)} chunks)")
            removed = [e for i, e in w.events if i == "master-0" and e["type"] == "removed"]
            assert sum(len(e["hashes"]) for e in removed) >= saved - len(truth)
            assert all(e["medium"] == "store" for e in removed) and any("evicted" in e["causes"] for e in removed)
            assert w.index.store_chunks <= 8

            store.kill()  # the store dies: after client_ttl_s the master drops it and every chunk on it
            store.wait(10)
            await w.until(lambda: w.index.store_chunks == 0, 60, "the dead store's chunks to be removed")
            assert any("store_gone" in e["causes"] for i, e in w.events if e["type"] == "removed")

            child = w.reports["master-0"].detail["pid"]
            os.kill(child, signal.SIGKILL)  # mooncake_master dies: every object is lost with it
            await w.until(lambda: any(e["type"] == "cleared" and "master_restarted" in e.get("causes", [])
                                      for _, e in w.events), 60, "the pool to be cleared")
            w.index.check_integrity()
            await bus.close()

        asyncio.run(scenario())
    finally:
        for p in (store, master):
            if p is not None:
                stop(p)
        with contextlib.suppress(Exception):
            print((tmp_path / "master-0.log").read_text()[-3000:])


def test_prefill_publishes_transferred_events():
    """The prefill's publisher carries a handoff as a "transferred" event naming the decode instance."""
    from services.prefill.events import KVEventPublisher
    from shared.bus import Subjects

    class Bus:  # the publisher's only use of the bus: subjects + publish
        subjects = Subjects("t")
        sent: list = []

        async def publish(self, subject, msg):
            self.sent.append((subject, msg))

    bus = Bus()
    pub = KVEventPublisher(bus, "prefill-0")
    pub.emit_transferred([d(1), d(2)], "decode-3")
    asyncio.run(pub.flush())
    [(subject, batch)] = bus.sent
    assert subject == "t.kv.events.prefill-0" and batch.instance == "prefill-0"
    assert batch.events == [{"type": "transferred", "hashes": [d(1), d(2)], "medium": "device", "to": "decode-3"}]
    idx = KVIndex()
    assert idx.apply(batch.instance, batch.events) == 0 and idx.counts == {"transferred/device": 1}


def test_events_from_the_engine_thread_go_out_as_one_batch_after_the_window_and_an_idle_publisher_sends_nothing():
    """The engine thread's events wake the loop once and leave together; with nothing emitted, nothing is sent."""
    import threading

    from services.prefill.events import KVEventPublisher
    from shared.bus import Subjects

    class Bus:
        subjects = Subjects("t")

        def __init__(self):
            self.sent, self.fail = [], False

        async def publish(self, subject, msg):
            if self.fail:
                raise ConnectionError("bus down")
            self.sent.append((subject, msg))

    async def main():
        bus = Bus()
        pub = KVEventPublisher(bus, "prefill-0", window_s=0.05)
        pub.start()
        await asyncio.sleep(0.2)
        assert bus.sent == []  # idle: no batch, empty or not
        engine = threading.Thread(target=lambda: [pub.emit_transferred([d(i)], "decode-0") for i in range(5)])
        engine.start()
        engine.join()
        for _ in range(100):
            if bus.sent:
                break
            await asyncio.sleep(0.01)
        assert [len(b.events) for _, b in bus.sent] == [5]
        bus.fail = True  # a batch that cannot go out is sent after the next window, once the bus is back
        pub.emit_transferred([d(9)], "decode-1")
        await asyncio.sleep(0.12)
        bus.fail = False
        for _ in range(100):
            if len(bus.sent) == 2:
                break
            await asyncio.sleep(0.01)
        await pub.stop()
        return bus.sent

    sent = asyncio.run(main())
    assert len(sent) == 2 and sent[1][1].events[0]["to"] == "decode-1"
