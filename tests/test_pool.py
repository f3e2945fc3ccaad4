"""The KV pool for real: the master service (running mooncake_master), store services contributing DRAM
segments, and a PoolClient in this process, all on loopback with a real nats-server. Small segments
(32-64 MiB) and objects of 1-3 MiB keep it fast on two cores."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from services.master.main import parse_metrics
from services.store.main import meminfo, plan_hugepages
from shared.bus import Bus, BusConfig
from shared.messages import LoadReport
from shared.pool import (INVALID_PARAMS, NO_AVAILABLE_HANDLE, OBJECT_NOT_FOUND, TRANSFER_FAIL, PoolClient, PoolConfig,
                         PoolError)
from shared.pool_reads import DirectReads
from shared.transfer import KVTransport, TransferError
from shared.sockets import free_port

pytest.importorskip("mooncake.store")

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


class Service:
    """`python -m services.<role>` as a real process; ready once its log says so."""

    def __init__(self, role: str, url: str, prefix: str, tmp: Path, *overrides: str, wait: bool = True):
        self.role, self.log_path = role, tmp / f"{role}-{uuid.uuid4().hex[:6]}.log"
        args = [sys.executable, "-m", f"services.{role}", "--set", f"bus.url={url}", "--set", f"bus.prefix={prefix}",
                "--set", "tracing.exporter=none", "--set", "load_interval_s=0.2",
                *[a for o in overrides for a in ("--set", o)]]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while b'"ready"' not in self.log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.role} did not start:\n{self.tail()}")
            time.sleep(0.05)

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


async def _load_report(url: str, prefix: str, want, timeout: float) -> LoadReport:
    bus = await Bus.connect(BusConfig(url=url, prefix=prefix), "test-pool")
    found: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_load(msg: LoadReport, _raw):
        if not found.done() and want(msg):
            found.set_result(msg)

    try:
        await bus.subscribe(bus.subjects.load_all, LoadReport, on_load)
        return await asyncio.wait_for(found, timeout)
    finally:
        await bus.close()


def load_report(pool, want, timeout: float = 10.0) -> LoadReport:
    """The first LoadReport on the pool's prefix for which want(report) is true."""
    return asyncio.run(_load_report(pool.url, pool.prefix, want, timeout))


class Pool:
    """A master service and some store services on one bus prefix."""

    def __init__(self, url: str, tmp: Path, master_overrides=(), store_bytes=(64 * MiB, 64 * MiB)):
        self.url, self.tmp, self.prefix = url, tmp, "t" + uuid.uuid4().hex[:10]
        self.rpc_port = free_port()
        self.master_addr = f"127.0.0.1:{self.rpc_port}"
        self.services: list[Service] = []
        self.master = self.start("master", f"master.rpc_port={self.rpc_port}", "master.client_ttl_s=2",
                                 "master.restart_backoff_s=0.2", *master_overrides)
        self.stores = [self.start("store", *self.store_args(i, n), wait=False) for i, n in enumerate(store_bytes)]
        for s in self.stores:
            s.wait_ready()

    def store_args(self, i, nbytes) -> list[str]:
        return [f"instance=store-{i}", f"store.master_addr={self.master_addr}", f"store.segment_bytes={nbytes}"]

    def start(self, role: str, *overrides: str, wait: bool = True) -> Service:
        s = Service(role, self.url, self.prefix, self.tmp, *overrides, wait=wait)
        self.services.append(s)
        return s

    def segment_of(self, instance: str) -> str:
        return load_report(self, lambda r: r.role == "store" and r.instance == instance).detail["segment"]

    def stop(self) -> None:
        for s in reversed(self.services):
            s.stop()


@pytest.fixture(scope="module")
def pool(nats_url, tmp_path_factory):
    p = None
    try:
        p = Pool(nats_url, tmp_path_factory.mktemp("pool"))
        yield p
    finally:
        if p is not None:
            p.stop()


class Buffers:
    """A PoolClient with a registered source (random bytes) and destination buffer."""

    def __init__(self, master_addr: str, nbytes: int = 16 * MiB):
        self.client = PoolClient(PoolConfig(master_addr=master_addr))
        self.src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        self.dst = torch.zeros(nbytes, dtype=torch.uint8)
        self.client.register(self.src)
        self.client.register(self.dst)

    def put(self, keys, size, offset=0, group_id=None, **kw) -> list[int]:
        base = self.src.data_ptr() + offset
        return self.client.put_from(keys, [base + i * size for i in range(len(keys))], [size] * len(keys),
                                    group_id, **kw)

    def get(self, keys, size) -> list[int]:
        self.dst.zero_()
        base = self.dst.data_ptr()
        return self.client.get_into(keys, [base + i * size for i in range(len(keys))], [size] * len(keys))

    def close(self) -> None:
        self.client.close()


@pytest.fixture(scope="module")
def bufs(pool):
    b = Buffers(pool.master_addr)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def direct(bufs):
    """DirectReads over bufs' client: a Transfer Engine of its own, with bufs.dst registered."""
    transport = KVTransport()
    transport.register(bufs.dst)
    try:
        yield DirectReads(bufs.client, transport)
    finally:
        transport.close()


def _key(name: str) -> str:
    return f"test/{uuid.uuid4().hex[:8]}/{name}"


# ---- units ----------------------------------------------------------------------------------------
def test_hugepage_plan():
    free = {"Hugepagesize": 2048, "HugePages_Free": 600, "HugePages_Rsvd": 0}
    assert plan_hugepages("auto", 1 << 30, free).use
    assert not plan_hugepages("auto", 2 << 30, free).use
    assert not plan_hugepages("auto", 64 * MiB, {"Hugepagesize": 2048, "HugePages_Free": 0}).use
    assert plan_hugepages("on", 64 * MiB, {"Hugepagesize": 2048}).use
    assert not plan_hugepages("off", 64 * MiB, free).use
    with pytest.raises(PoolError):
        plan_hugepages("on", 64 * MiB, {"Hugepagesize": 4})


def test_parse_metrics():
    text = ("# HELP x y\n# TYPE x gauge\nmaster_key_count 3\nmaster_allocated_bytes 1.048576e+06\n"
            'segment_allocated_bytes{segment="10.0.0.1:1"} 4096\nsegment_allocated_bytes{segment="10.0.0.2:1"} 0\n'
            'two{a="b",c="d"} 1\n# TYPE master_evicted_key_count counter\nmaster_evicted_key_count 7\n')
    assert parse_metrics(text) == {"master_key_count": 3.0, "master_allocated_bytes": 1048576.0,
                                   "master_evicted_key_count": 7.0, "master_evicted_key_count_total": 7.0,
                                   "segment_allocated_bytes{segment}": {"10.0.0.1:1": 4096.0, "10.0.0.2:1": 0.0}}


def test_client_fails_fast_without_master():
    t = time.monotonic()
    with pytest.raises(PoolError, match="unreachable"):
        PoolClient(PoolConfig(master_addr=f"127.0.0.1:{free_port()}", connect_timeout_s=0.3))
    assert time.monotonic() - t < 5


# ---- one pool: master + two stores ------------------------------------------------------------------
def test_put_get_exact_bytes_and_exists(bufs):
    keys = [_key("a"), _key("b"), _key("c"), _key("d")]
    assert bufs.client.exists(keys) == [False] * 4
    size = 3 * MiB
    assert bufs.put(keys, size) == [0] * 4
    assert bufs.client.exists(keys) == [True] * 4
    assert bufs.get(keys, size) == [size] * 4
    assert torch.equal(bufs.src[:4 * size], bufs.dst[:4 * size])
    # a missing key reads as -704 (never as data); reading into a larger buffer is fine
    assert bufs.get([_key("missing")], size) == [OBJECT_NOT_FOUND]
    assert bufs.client.get_into([keys[0]], [bufs.dst.data_ptr()], [size + 4096]) == [size]
    # 12 MiB round trip (timings for the record; run with -s to see them)
    big = _key("12m")
    t0 = time.perf_counter()
    assert bufs.put([big], 12 * MiB) == [0]
    t1 = time.perf_counter()
    assert bufs.get([big], 12 * MiB) == [12 * MiB]
    t2 = time.perf_counter()
    assert torch.equal(bufs.src[:12 * MiB], bufs.dst[:12 * MiB])
    print(f"12 MiB put {1e3 * (t1 - t0):.1f} ms, get {1e3 * (t2 - t1):.1f} ms")


def _read_scattered(bufs, reader, a: str, b: str, size: int) -> None:
    """Objects a and b (bufs.src's first two `size` bytes) read by `reader` into pieces of bufs.dst: a's
    first 4 KiB at the end of dst's first MiB, its rest backwards in two pieces; b in one piece."""
    bufs.dst.zero_()
    d = bufs.dst.data_ptr()
    pieces = [[d + size - 4096, d + 2 * size, d], [4096, size // 2, size // 2 - 4096]]
    assert reader.get_into_pieces([a, b], [pieces[0], [d + 3 * size]], [pieces[1], [size]]) == [size, size]
    src, dst = bufs.src, bufs.dst
    assert torch.equal(dst[size - 4096:size], src[:4096])
    assert torch.equal(dst[2 * size:2 * size + size // 2], src[4096:4096 + size // 2])
    assert torch.equal(dst[:size // 2 - 4096], src[4096 + size // 2:size])
    assert torch.equal(dst[3 * size:4 * size], src[size:2 * size])


def test_get_into_pieces_scatters_an_object_in_order(bufs):
    a, b = _key("pieces-a"), _key("pieces-b")
    size = 1 * MiB
    assert bufs.put([a, b], size) == [0, 0]
    _read_scattered(bufs, bufs.client, a, b, size)
    d = bufs.dst.data_ptr()
    # pieces too small for the object, or a missing key: a code, never data
    short = bufs.client.get_into_pieces([a, _key("missing")], [[d, d + 4096], [d]], [[4096, 4096], [size]])
    assert short[0] < 0 and short[1] == OBJECT_NOT_FOUND
    with pytest.raises(ValueError):
        bufs.client.get_into_pieces([a], [[d, d + 4096]], [[4096]])


def test_direct_reads_scatter_like_the_store_client(bufs, direct):
    """The stores' memory read with our own Transfer Engine: the same bytes in the same places, and the
    same codes, as the store client's get_into_pieces."""
    a, b, c = _key("direct-a"), _key("direct-b"), _key("direct-c")
    size = 1 * MiB
    assert bufs.put([a, b, c], size) == [0, 0, 0]
    assert all(w is not None and w[2] == size for w in bufs.client.replicas([a, b, c]))
    assert bufs.client.replicas([_key("missing")]) == [None]
    before = dict(direct.counts)
    _read_scattered(bufs, direct, a, b, size)
    d, src, dst = bufs.dst.data_ptr(), bufs.src, bufs.dst
    assert direct.get_into([c], [d + 5 * size], [size + 4096]) == [size]  # a larger buffer is fine
    assert torch.equal(dst[5 * size:6 * size], src[2 * size:3 * size])
    assert direct.counts["direct"] - before["direct"] == 3 and direct.counts["through_store"] == before["through_store"]
    # too small, or missing (asked of the store client, which names it): a code, never data
    bufs.dst.zero_()
    short = direct.get_into_pieces([a, _key("missing")], [[d, d + 4096], [d]], [[4096, 4096], [size]])
    assert short == [INVALID_PARAMS, OBJECT_NOT_FOUND] and not bufs.dst[:size].any()
    assert direct.counts["through_store"] == before["through_store"] + 1
    with pytest.raises(ValueError):
        direct.get_into_pieces([a], [[d, d + 4096]], [[4096]])
    with pytest.raises(TransferError, match="not in a registered buffer"):  # bufs.src is not registered with it
        direct.get_into([a], [bufs.src.data_ptr()], [size])


def test_put_of_existing_key_keeps_the_old_value(bufs):
    key, size = _key("k"), 1 * MiB
    assert bufs.put([key], size, offset=0) == [0]
    assert bufs.put([key], size, offset=5 * MiB) == [0]  # "ok", but nothing is written
    assert bufs.get([key], size) == [size]
    assert torch.equal(bufs.dst[:size], bufs.src[:size])
    assert not torch.equal(bufs.dst[:size], bufs.src[5 * MiB:6 * MiB])
    assert bufs.client.remove([key], force=True) == [0]
    assert bufs.client.exists([key]) == [False]


def test_put_with_group_id_and_argument_checks(bufs):
    keys = [f"{_key('chunk')}/s{i}of3" for i in range(3)]
    assert bufs.put(keys, 1 * MiB, group_id="chunk-digest") == [0, 0, 0]
    assert bufs.get(keys, 1 * MiB) == [MiB] * 3
    assert torch.equal(bufs.src[:3 * MiB], bufs.dst[:3 * MiB])
    with pytest.raises(ValueError, match="duplicate"):
        bufs.put([keys[0], keys[0]], MiB)
    per_key = [f"{_key('two-chunks')}/c{c}/s{s}" for c in range(2) for s in range(2)]
    assert bufs.put(per_key, MiB, group_id=["c0", "c0", "c1", "c1"]) == [0] * 4  # a group per key, one call
    assert bufs.get(per_key, MiB) == [MiB] * 4 and torch.equal(bufs.src[:4 * MiB], bufs.dst[:4 * MiB])
    with pytest.raises(ValueError, match="one group per key"):
        bufs.put([_key("x"), _key("y")], MiB, group_id=["only-one"])
    with pytest.raises(ValueError, match="same length"):
        bufs.client.get_into(keys, [bufs.dst.data_ptr()], [MiB])
    assert bufs.client.exists([]) == [] and bufs.client.get_into([], [], []) == []


def test_objects_over_max_object_bytes_are_refused_locally(bufs):
    # an object must fit in one segment, and a put the master cannot place makes it evict (see the
    # eviction test), so PoolClient refuses oversized objects before asking
    with pytest.raises(ValueError, match="max_object_bytes"):
        bufs.client.put_from([_key("huge")], [bufs.src.data_ptr()], [bufs.client.config.max_object_bytes + 1])
    with pytest.raises(ValueError, match="max_object_bytes"):
        bufs.client.put_from([_key("empty")], [bufs.src.data_ptr()], [0])


def test_batches_are_chunked(pool):
    client = PoolClient(PoolConfig(master_addr=pool.master_addr, max_batch=7))
    src = torch.arange(40 * 4096, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    try:
        client.register(src)
        client.register(dst)
        keys = [_key(f"small{i}") for i in range(40)]
        assert client.put_from(keys, [src.data_ptr() + i * 4096 for i in range(40)], [4096] * 40) == [0] * 40
        assert client.get_into(keys, [dst.data_ptr() + i * 4096 for i in range(40)], [4096] * 40) == [4096] * 40
        assert torch.equal(src, dst)
        assert client.exists(keys) == [True] * 40
    finally:
        client.close()


def test_store_and_master_publish_load_reports(pool):
    store = load_report(pool, lambda r: r.role == "store" and r.instance == "store-0")
    assert store.ready and store.capacity_tokens == 0
    assert store.detail["segment_bytes"] == 64 * MiB and isinstance(store.detail["hugepages"], bool)
    assert store.detail["segment"].startswith("127.0.0.1:")
    master = load_report(pool, lambda r: r.role == "master" and r.detail.get("capacity_bytes") == 128 * MiB)
    assert master.ready and master.detail["restarts"] == 0 and master.detail["up"]
    assert master.detail["master_addr"] == pool.master_addr
    url = master.detail["metrics_url"]
    import urllib.request

    with urllib.request.urlopen(url, timeout=2) as r:
        assert "master_total_capacity_bytes" in r.read().decode()
    assert {"used_bytes", "evictions", "objects", "clients"} <= set(master.detail)


def test_killed_store_loses_only_its_objects(pool, bufs, direct):
    doomed = pool.start("store", *pool.store_args(9, 32 * MiB))
    keep_seg, doomed_seg = pool.segment_of("store-0"), pool.segment_of("store-9")
    keep, lost = _key("keep"), _key("lost")
    assert bufs.put([keep], 2 * MiB, preferred_segment=keep_seg) == [0]
    assert bufs.put([lost], 2 * MiB, offset=2 * MiB, preferred_segment=doomed_seg) == [0]
    assert bufs.get([keep, lost], 2 * MiB) == [2 * MiB, 2 * MiB]
    os.killpg(doomed.proc.pid, signal.SIGKILL)
    doomed.proc.wait()
    # read directly, the dead store's object fails (-800) while the master still lists it; the other reads
    d = bufs.dst.data_ptr()
    rcs = direct.get_into([keep, lost], [d, d + 2 * MiB], [2 * MiB, 2 * MiB])
    assert rcs[0] == 2 * MiB and torch.equal(bufs.dst[:2 * MiB], bufs.src[:2 * MiB])
    assert rcs[1] in (TRANSFER_FAIL, OBJECT_NOT_FOUND), rcs
    # reads of the dead store's object fail at once (-800), then the master forgets it (-704)
    deadline, rcs = time.monotonic() + 8, None
    while time.monotonic() < deadline:
        rcs = bufs.get([keep, lost], 2 * MiB)
        assert rcs[0] == 2 * MiB and torch.equal(bufs.dst[:2 * MiB], bufs.src[:2 * MiB])
        assert rcs[1] < 0
        if rcs[1] == OBJECT_NOT_FOUND:
            break
        time.sleep(0.2)
    assert rcs[1] == OBJECT_NOT_FOUND, rcs
    assert bufs.client.exists([keep, lost]) == [True, False]


def test_master_service_restarts_a_dead_mooncake_master(pool, bufs):
    before = load_report(pool, lambda r: r.role == "master" and r.detail.get("up"))
    os.kill(before.detail["pid"], signal.SIGKILL)
    after = load_report(pool, lambda r: r.role == "master" and r.detail.get("restarts", 0) >= 1 and r.ready
                        and r.detail.get("capacity_bytes") == 128 * MiB, timeout=15)
    assert after.detail["pid"] != before.detail["pid"]
    # the stores remounted by themselves; the pool works again (its old objects are gone)
    key = _key("after-restart")
    assert bufs.put([key], MiB) == [0]
    assert bufs.get([key], MiB) == [MiB]


@pytest.mark.skipif(meminfo().get("HugePages_Free", 0) > 0, reason="this host has huge pages reserved")
def test_store_with_hugepages_on_fails_clearly_without_them(pool):
    s = pool.start("store", *pool.store_args(8, 32 * MiB), "store.hugepages=on", wait=False)
    assert s.proc.wait(30) != 0
    assert "huge pages" in s.tail()


def test_sigterm_exits_zero(pool):
    t = time.monotonic()
    for s in pool.stores:  # stores first: they unmount their segments at the master
        s.proc.terminate()
    assert [s.stop() for s in pool.stores] == [0, 0]
    print(f"stores stopped in {time.monotonic() - t:.1f} s")
    assert time.monotonic() - t < 8
    child = load_report(pool, lambda r: r.role == "master" and r.detail.get("up")).detail["pid"]
    assert pool.master.stop() == 0
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # mooncake_master went with its service


# ---- a small pool of its own: eviction --------------------------------------------------------------
def test_objects_of_one_group_are_evicted_together(nats_url, tmp_path):
    """Stage 0 of 20 chunks is saved first, stage 1 afterwards, into a 32 MiB pool (evicts at 90%).
    With a group id per chunk whole chunks go; without, LRU evicts the old stage-0 objects alone
    (a chunk keeps only stage 1)."""
    p = Pool(nats_url, tmp_path, master_overrides=["master.default_kv_lease_ttl_ms=100"], store_bytes=[32 * MiB])
    b = None
    try:
        b = Buffers(p.master_addr, nbytes=2 * MiB)

        def fill(tag: str, grouped: bool) -> list[tuple[bool, bool]]:
            for stage in (0, 1):
                for c in range(20):
                    key = f"{tag}/c{c}/s{stage}"
                    assert b.put([key], MiB, offset=stage * MiB, group_id=f"{tag}{c}" if grouped else None) == [0]
            e = b.client.exists([f"{tag}/c{c}/s{s}" for c in range(20) for s in (0, 1)])
            return [(e[2 * c], e[2 * c + 1]) for c in range(20)]

        grouped = fill("grouped", grouped=True)
        assert (False, False) in grouped and (True, True) in grouped, grouped
        assert all(a == b_ for a, b_ in grouped), grouped  # never half a chunk
        time.sleep(0.2)  # the exists above leased the survivors for 100 ms
        plain = fill("plain", grouped=False)
        assert (False, True) in plain, plain  # LRU split chunks
        print("grouped", "".join(f"{int(a)}{int(b_)} " for a, b_ in grouped))
        print("plain  ", "".join(f"{int(a)}{int(b_)} " for a, b_ in plain))
        # the trap max_object_bytes guards against: a put larger than any segment (33 MiB > 32 MiB,
        # still under the default max_object_bytes) is refused (-200) and makes the master evict
        keys = [f"plain/c{c}/s{s}" for c in range(20) for s in (0, 1)]
        time.sleep(0.2)
        held = sum(b.client.exists(keys))
        big = torch.empty(33 * MiB, dtype=torch.uint8)
        assert b.client.put_from(["too-big"], [big.data_ptr()], [big.numel()]) == [NO_AVAILABLE_HANDLE]
        time.sleep(0.3)
        left = sum(b.client.exists(keys))
        print(f"a 33 MiB put into a 32 MiB pool evicted {held - left} of {held} objects")
        assert left < held
        evictions = load_report(p, lambda r: r.role == "master" and r.detail.get("evictions", 0) > 0)
        assert evictions.detail["used_bytes"] <= 32 * MiB
        # a batched save: both stages of 4 chunks per call, a group per chunk (group_id as a list)
        time.sleep(0.2)
        for c0 in range(0, 20, 4):
            keys = [f"batched/c{c}/s{s}" for c in range(c0, c0 + 4) for s in (0, 1)]
            base = b.src.data_ptr()
            assert b.client.put_from(keys, [base + (i % 2) * MiB for i in range(8)], [MiB] * 8,
                                     [f"batched{c}" for c in range(c0, c0 + 4) for _ in (0, 1)]) == [0] * 8
        e = b.client.exists([f"batched/c{c}/s{s}" for c in range(20) for s in (0, 1)])
        batched = [(e[2 * c], e[2 * c + 1]) for c in range(20)]
        assert (False, False) in batched and (True, True) in batched, batched
        assert all(a == b_ for a, b_ in batched), batched  # never half a chunk
    finally:
        if b is not None:
            b.close()
        p.stop()




def test_soft_pinned_objects_are_evicted_last(nats_url, tmp_path):
    """Session retention's pool half (put_from(soft_pin_s=...)): a 32 MiB pool takes 12 pinned 1 MiB objects,
    then 40 unpinned ones (twice what is left). The master evicts unpinned objects only: every pinned one is
    still there. A pin that has run out protects nothing: the same fill, pinned for 0.3 s, loses them."""
    p = Pool(nats_url, tmp_path, master_overrides=["master.default_kv_lease_ttl_ms=100"], store_bytes=[32 * MiB])
    b = None
    try:
        b = Buffers(p.master_addr, nbytes=2 * MiB)

        def fill(tag: str, pin_s: float, wait_s: float) -> tuple[int, int]:
            pinned = [f"{tag}/pinned{i}" for i in range(12)]
            for k in pinned:
                assert b.put([k], MiB, soft_pin_s=pin_s) == [0]
            time.sleep(wait_s)
            plain = [f"{tag}/plain{i}" for i in range(40)]
            for k in plain:
                assert b.put([k], MiB, offset=MiB) == [0]
            return sum(b.client.exists(pinned)), sum(b.client.exists(plain))

        kept, plain_left = fill("long", pin_s=60.0, wait_s=0.2)
        print(f"pinned 60 s: {kept}/12 pinned kept, {plain_left}/40 unpinned left")
        assert kept == 12 and plain_left < 40
        for tag in ("long",):  # make room for the second fill
            b.client.remove([f"{tag}/pinned{i}" for i in range(12)] + [f"{tag}/plain{i}" for i in range(40)], True)
        kept, plain_left = fill("short", pin_s=0.3, wait_s=0.5)
        print(f"pinned 0.3 s, filled after 0.5 s: {kept}/12 pinned kept, {plain_left}/40 unpinned left")
        assert kept < 12
        with pytest.raises(ValueError, match="soft_pin_s"):
            b.put(["x"], MiB, soft_pin_s=-1)
    finally:
        if b is not None:
            b.close()
        p.stop()
