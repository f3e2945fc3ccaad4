"""Prefill instance configuration (file + env + `--set`; see shared/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.engine import EngineConfig
from shared.pool import PoolConfig
from shared.service import ServiceConfig
from shared.transfer import TransferConfig


@dataclass
class PoolSettings(PoolConfig):
    enabled: bool = False                  # restore from and save to the shared KV pool (needs master + stores)
    min_restore_tokens: int = 0            # restore only when at least this many prompt tokens would come from the pool (and at least one chunk)
    restore_batch_chunks: int = 4          # chunks per batched read (sizes the registered restore buffer)
    restore_wait_s: float = 5.0            # wait this long for free device blocks for every hit chunk, then restore what fits
    save: bool = True                      # save each new full prompt chunk after prefill (async)


@dataclass
class PrefillConfig(ServiceConfig):
    instance: str = "prefill-0"
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    pool: PoolSettings = field(default_factory=PoolSettings)
