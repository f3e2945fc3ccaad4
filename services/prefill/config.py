"""Prefill instance configuration (file + env + `--set`; see shared/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.bus import BusConfig
from shared.engine.engine import EngineConfig
from shared.service import LogConfig
from shared.tracing import TracingConfig
from shared.transfer import TransferConfig


@dataclass
class PrefillConfig:
    instance: str = "prefill-0"
    load_interval_s: float = 1.0
    bus: BusConfig = field(default_factory=BusConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    log: LogConfig = field(default_factory=LogConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
