"""How `moorage up` sizes the stores' disk tier (issue 52: on by default, so a paused agent's history that the DRAM
pool evicted comes back from local disk instead of being recomputed).

`up.disk_bytes` -1 (the default, "auto"): a quarter of the free space of the filesystem that holds `up.disk_dir`
(default `<run_dir>/disk`), at most 64 GiB in all, split evenly among the stores; a store whose share would be
under 256 MiB gets none (the tier is off, and `moorage up` says why). A positive value is each store's size; 0
turns the tier off (DRAM only).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from shared.engine.kv_sizing import format_bytes

AUTO = -1
AUTO_SHARE = 0.25          # of the filesystem's free space
AUTO_CAP_BYTES = 64 << 30  # in all, whatever the free space
MIN_STORE_BYTES = 256 << 20


@dataclass(frozen=True)
class DiskSplit:
    directory: Path
    stores: int
    per_store: int     # bytes each store's tier keeps (0: no tier)
    how: str           # why this size

    def describe(self) -> str:
        if not self.per_store:
            return f"disk tier: off ({self.how})"
        return (f"disk tier: {format_bytes(self.per_store * self.stores)} at {self.directory} ({self.stores} stores x "
                f"{format_bytes(self.per_store)}; {self.how}; up.disk_bytes=0 turns it off)")


def _free_bytes(directory: Path) -> int:
    path = directory
    while not path.exists() and path != path.parent:  # the run directory may not exist yet
        path = path.parent
    return shutil.disk_usage(path).free


def split_disk(disk_bytes: int, directory: Path, stores: int, free: int | None = None) -> DiskSplit:
    """Each store's disk tier for `up.disk_bytes` (see the module); `free`: the filesystem's free bytes (measured
    when not given)."""
    if stores <= 0 or disk_bytes == 0:
        return DiskSplit(directory, stores, 0, "up.disk_bytes = 0" if disk_bytes == 0 else "no stores")
    if disk_bytes > 0:
        return DiskSplit(directory, stores, disk_bytes, "up.disk_bytes")
    free = _free_bytes(directory) if free is None else free
    total = min(int(free * AUTO_SHARE), AUTO_CAP_BYTES)
    per_store = total // stores
    if per_store < MIN_STORE_BYTES:
        return DiskSplit(directory, stores, 0, f"only {format_bytes(free)} free at {directory}, under "
                                               f"{format_bytes(MIN_STORE_BYTES)} a store at a quarter of it")
    return DiskSplit(directory, stores, per_store, f"a quarter of the {format_bytes(free)} free there, "
                                                   f"{format_bytes(AUTO_CAP_BYTES)} at most")
