"""The store's configuration: `[store]` says how much DRAM to contribute and where the master is."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.config import ConfigError
from shared.service import ServiceConfig


@dataclass
class StoreSettings:
    segment_bytes: int = 1 << 30           # DRAM this instance contributes to the pool (one object must fit in it)
    master_addr: str = "127.0.0.1:50051"   # mooncake_master RPC address (host:port)
    hostname: str = "127.0.0.1"            # address clients reach this store on
    protocol: str = "tcp"                  # "rdma" on clusters
    device_name: str = ""                  # RDMA NIC(s), e.g. "mlx5_0"
    metadata_server: str = "P2PHANDSHAKE"  # P2PHANDSHAKE (no metadata server) or an etcd/http URL
    hugepages: str = "auto"                # auto: huge pages when enough are reserved | on: required | off
    connect_timeout_s: float = 60.0        # how long to wait at start for the master to answer
    disk_path: str = ""                    # the disk tier's directory (services/store/disk.py): "" = none, DRAM only
    disk_bytes: int = 16 << 30             # most bytes the disk tier keeps (it evicts its least recently used objects)
    disk_buffer_bytes: int = 64 << 20      # each of the disk tier's two copy buffers (spill, load): the largest object it takes

    def __post_init__(self) -> None:
        if self.segment_bytes <= 0:
            raise ConfigError(f"store.segment_bytes must be positive, got {self.segment_bytes}")
        if self.disk_path and min(self.disk_bytes, self.disk_buffer_bytes) <= 0:
            raise ConfigError("store.disk_bytes and store.disk_buffer_bytes must be positive with a disk_path")
        if self.hugepages not in ("auto", "on", "off"):
            raise ConfigError(f"store.hugepages must be auto, on or off, got {self.hugepages!r}")


@dataclass
class StoreConfig(ServiceConfig):
    instance: str = "store-0"
    store: StoreSettings = field(default_factory=StoreSettings)
