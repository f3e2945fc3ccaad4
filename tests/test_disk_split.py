"""The stores' disk tier is on by default in `moorage up` (infra/disk_split.py): sized from the free space of the
filesystem under it, capped, split among the stores, off below a floor, and `up.disk_bytes = 0` turns it off."""

from __future__ import annotations

from pathlib import Path

from infra.disk_split import AUTO, AUTO_CAP_BYTES, MIN_STORE_BYTES, split_disk
from infra.up import UpConfig, disk_of, plan
from shared.config import load_config

GIB = 1 << 30


def test_auto_takes_a_quarter_of_the_free_space_capped_and_split():
    d = split_disk(AUTO, Path("/d"), 2, free=80 * GIB)
    assert d.per_store == 10 * GIB and "disk tier: 20.00 GiB at /d (2 stores x 10.00 GiB" in d.describe()
    assert split_disk(AUTO, Path("/d"), 2, free=4000 * GIB).per_store == AUTO_CAP_BYTES // 2
    small = split_disk(AUTO, Path("/d"), 2, free=MIN_STORE_BYTES * 4)  # a quarter is half a store's floor each
    assert small.per_store == 0 and "off (only" in small.describe()


def test_an_explicit_size_or_zero_wins():
    assert split_disk(6 * GIB, Path("/d"), 3, free=0).per_store == 6 * GIB
    off = split_disk(0, Path("/d"), 2, free=100 * GIB)
    assert off.per_store == 0 and off.describe() == "disk tier: off (up.disk_bytes = 0)"


def test_a_default_system_gives_every_store_a_disk_tier_under_the_run_dir(tmp_path):
    cfg = load_config(UpConfig, overrides=["up.model=tiny", "prefill.engine.num_blocks=64",
                                           "decode.engine.num_blocks=64"])
    disk = disk_of(cfg, tmp_path)
    assert disk.directory == tmp_path / "disk" and disk.per_store > 0  # this machine has the space
    stores = {i: c for i, s, c in plan(cfg, "nats://x", tmp_path, disk=disk) if s == "store"}
    assert sorted(stores) == ["store-0", "store-1"]
    for name, c in stores.items():
        assert c.store.disk_path == str(tmp_path / "disk" / name) and c.store.disk_bytes == disk.per_store
    off = load_config(UpConfig, overrides=["up.model=tiny", "up.disk_bytes=0", "prefill.engine.num_blocks=64",
                                           "decode.engine.num_blocks=64"])
    assert all(c.store.disk_path == "" for _, s, c in plan(off, "nats://x", tmp_path) if s == "store")
