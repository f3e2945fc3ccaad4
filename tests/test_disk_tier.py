"""The store's disk tier as files (services/store/disk.py) and the prefill's directory of it
(services/prefill/disk_loads.py): durable writes, verified reads, LRU space, restart, and the faults a disk
has (full, unusable, corrupted, a write cut short)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import torch

from services.prefill.disk_loads import DiskDirectory, DiskLoader
from services.store.disk import DiskTier
from services.store.disk_serve import batches
from shared.kv_object import HEADER_BYTES, ObjectSpec, checksum, object_key, write_header
from shared.logging import get_logger
from shared.messages import DiskIndex

log = get_logger("test.disk")
PAYLOAD = 4096


def kv_object(n: int, ns: str = "ns-test") -> tuple[str, torch.Tensor]:
    """A real pool object (header + payload), the n-th of its namespace."""
    digest = n.to_bytes(16, "big")
    spec = ObjectSpec(ns, digest, 0, 1, 256, PAYLOAD)
    obj = torch.empty(HEADER_BYTES + PAYLOAD, dtype=torch.uint8)
    obj[HEADER_BYTES:] = torch.randint(0, 256, (PAYLOAD,), generator=torch.Generator().manual_seed(n),
                                       dtype=torch.uint8)
    write_header(obj, spec, checksum(obj[HEADER_BYTES:]))
    return object_key(ns, 0, 1, digest), obj


def stored(tier: DiskTier, *ns: int) -> list[str]:
    objs = [kv_object(n) for n in ns]
    added, _ = tier.write([(k, memoryview(o.numpy())) for k, o in objs])
    return added


def read(tier: DiskTier, key: str) -> tuple[str | None, torch.Tensor]:
    out = torch.zeros(tier.size(key) or HEADER_BYTES + PAYLOAD, dtype=torch.uint8)
    return tier.read_into(key, out), out


def test_an_object_comes_back_byte_for_byte(tmp_path):
    tier = DiskTier(str(tmp_path), 1 << 20, log)
    key, obj = kv_object(1)
    assert stored(tier, 1) == [key]
    assert (tmp_path / "objects" / quote(key, safe="")).stat().st_size == obj.numel()
    why, out = read(tier, key)
    assert why is None and torch.equal(out, obj)
    assert stored(tier, 1) == []  # held already: not written twice
    assert tier.stats()["written"] == 1 and tier.stats()["read"] == 1


def test_a_corrupted_file_is_a_miss_and_is_deleted(tmp_path):
    tier = DiskTier(str(tmp_path), 1 << 20, log)
    [key] = stored(tier, 1)
    path = tier.path(key)
    raw = bytearray(path.read_bytes())
    raw[HEADER_BYTES + 100] ^= 1
    path.write_bytes(bytes(raw))
    why, _ = read(tier, key)
    assert why == "payload checksum mismatch"
    assert not path.exists() and not tier.holds(key) and tier.stats()["verify_failures"] == 1
    assert read(tier, key)[0] == "not on disk"


def test_a_file_under_another_key_or_cut_short_is_refused(tmp_path):
    tier = DiskTier(str(tmp_path), 1 << 20, log)
    [a, b] = stored(tier, 1, 2)
    tier.path(b).write_bytes(tier.path(a).read_bytes())  # b's file now holds a's object
    assert read(tier, b)[0] == f"header names another key than {b}"
    [c] = stored(tier, 3)
    tier.path(c).write_bytes(tier.path(c).read_bytes()[:-10])  # truncated (same index size)
    assert read(tier, c)[0] == "size differs from the index"
    assert tier.stats()["verify_failures"] == 2 and tier.holds(a)


def test_space_is_bounded_and_the_least_recently_read_go_first(tmp_path):
    size = HEADER_BYTES + PAYLOAD
    tier = DiskTier(str(tmp_path), 3 * size, log)
    k1, k2, k3 = stored(tier, 1, 2, 3)
    assert read(tier, k1)[0] is None  # k1 is now the most recently used
    added, evicted = tier.write([(kv_object(4)[0], memoryview(kv_object(4)[1].numpy()))])
    assert evicted == [k2] and tier.used == 3 * size and not tier.path(k2).exists()
    assert {tier.holds(k) for k in (k1, k3, added[0])} == {True}


def test_a_restart_keeps_what_was_acknowledged_and_drops_a_write_cut_short(tmp_path):
    tier = DiskTier(str(tmp_path), 1 << 20, log)
    keys = stored(tier, 1, 2)
    partial = tier.path(kv_object(3)[0])
    partial = partial.with_name(partial.name + ".tmp")
    partial.write_bytes(b"half an object")  # what a store killed mid-write leaves
    again = DiskTier(str(tmp_path), 1 << 20, log)
    assert list(again.index) == keys and again.used == tier.used
    assert again.stats()["partial_removed"] == 1 and not partial.exists()
    assert all(read(again, k)[0] is None for k in keys)


def test_an_unusable_path_turns_the_tier_off_with_a_reason(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    tier = DiskTier(str(blocker / "disk"), 1 << 20, log)
    assert not tier.writable and "unusable" in tier.off_reason
    assert stored(tier, 1) == []  # writes are refused, nothing raised
    ro = DiskTier("/proc/moorage-disk", 1 << 20, log)  # a filesystem nobody can create in
    assert not ro.writable and "unusable" in ro.off_reason


FULL_DISK = r"""
import resource, signal, sys, torch
sys.path.insert(0, sys.argv[2])
from tests.test_disk_tier import kv_object, log, read, stored
from services.store.disk import DiskTier
tier = DiskTier(sys.argv[1], 1 << 30, log)
first = stored(tier, 1)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
second = stored(tier, 2)
print(len(first), len(second), tier.writable, "File too large" in tier.off_reason, read(tier, first[0])[0] is None,
      tier.holds(kv_object(2)[0]))
"""


def test_a_full_disk_stops_writes_and_keeps_serving_what_it_has(tmp_path):
    """A real write failure (RLIMIT_FSIZE, in a child process): writes stop with a reason, nothing half-written
    is kept, and the objects already on disk are still read."""
    repo = str(Path(__file__).resolve().parents[1])
    run = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path), repo], capture_output=True, text=True,
                         timeout=120, cwd=repo)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "disk tier writes stopped" in run.stdout  # the one error line
    assert run.stdout.splitlines()[-1].split() == ["1", "0", "False", "True", "True", "False"]
    assert not [p for p in os.listdir(tmp_path / "objects") if p.endswith(".tmp")]


def test_the_directory_follows_snapshots_and_changes():
    d = DiskDirectory()
    d.apply(DiskIndex("store-0", added=["a", "b", "c"], snapshot=True))
    d.apply(DiskIndex("store-1", added=["x"]))
    d.apply(DiskIndex("store-0", removed=["b"]))
    assert d.holder(["a", "c"]) == "store-0" and d.holder(["a", "b"]) is None and d.holder(["x"]) == "store-1"
    d.apply(DiskIndex("store-0", added=["z"], snapshot=True))  # restarted: its listing replaces the old one
    assert d.holder(["a"]) is None and d.holder(["z"]) == "store-0" and len(d) == 2


def test_a_load_asks_for_what_the_pool_lacks_up_to_the_first_chunk_no_disk_holds():
    loader = DiskLoader(bus=None, instance="prefill-0", timeout_s=1.0)
    assert loader.plan([["a"], ["b"]], [False, False]) == {}  # no disk tier announced
    loader.directory.apply(DiskIndex("store-0", added=["a0", "a1", "c0", "c1", "e0", "e1"], snapshot=True))
    loader.directory.apply(DiskIndex("store-1", added=["b0", "b1"], snapshot=True))
    chunks = [["a0", "a1"], ["b0", "b1"], ["c0", "c1"], ["d0", "d1"], ["e0", "e1"]]
    # b is in the pool already; d is nowhere, so e (after it) is of no use
    assert loader.plan(chunks, [False, True, False, False, False]) == {"store-0": [0, 2]}
    assert loader.plan(chunks, [False] * 5) == {"store-0": [0, 2], "store-1": [1]}


def test_copy_batches_fit_the_buffer():
    assert batches([4, 4, 4], 8) == [(0, 2), (2, 3)]
    assert batches([10, 2, 2], 8) == [(0, 1), (1, 3)]  # an item over the room is alone (the caller skips it)
    assert batches([], 8) == []
