"""Decode instance configuration (file + env + `--set`; see shared/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.engine.engine import EngineConfig
from shared.service import ServiceConfig
from shared.transfer import TransferConfig


@dataclass
class DecodeConfig(ServiceConfig):
    instance: str = "decode-0"
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
