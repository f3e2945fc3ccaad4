"""The master's configuration: `[master]` holds the flags `mooncake_master` is started with."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.config import ConfigError
from shared.service import ServiceConfig


@dataclass
class MasterSettings:
    host: str = "127.0.0.1"                    # address the master's RPC and metrics servers bind to
    rpc_port: int = 50051                      # RPC port: stores' and clients' master_addr is host:rpc_port (0: pick one)
    metrics_port: int = 0                      # HTTP port of the master's /metrics and /health (0: pick one)
    eviction_high_watermark_ratio: float = 0.9  # evict when the pool is this full
    eviction_ratio: float = 0.05               # share of objects evicted per pass (least recently used first)
    default_kv_lease_ttl_ms: int = 10000       # read lease an exists/get grants an object (not evicted meanwhile)
    client_ttl_s: int = 10                     # a store silent this long is dropped with its objects
    extra_args: list[str] = field(default_factory=list)  # more mooncake_master flags, e.g. ["--rpc_thread_num=4"]
    restart_backoff_s: float = 1.0             # wait before restarting a master that died
    binary: str = ""                           # mooncake_master to run (empty: the one in the mooncake package)
    events_interval_s: float = 1.0             # list the pool's keys this often; publish chunks removed/stored as KV events (0: off)

    def __post_init__(self) -> None:
        for name in ("eviction_high_watermark_ratio", "eviction_ratio"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ConfigError(f"master.{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("rpc_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ConfigError(f"master.{name} must be a port number, got {getattr(self, name)}")
        if self.default_kv_lease_ttl_ms <= 0 or self.client_ttl_s <= 0:
            raise ConfigError("master.default_kv_lease_ttl_ms and master.client_ttl_s must be positive")
        if self.events_interval_s < 0:
            raise ConfigError(f"master.events_interval_s must not be negative, got {self.events_interval_s}")
        if self.restart_backoff_s < 0:
            raise ConfigError(f"master.restart_backoff_s must not be negative, got {self.restart_backoff_s}")


@dataclass
class MasterConfig(ServiceConfig):
    instance: str = "master-0"
    master: MasterSettings = field(default_factory=MasterSettings)
