"""Decode instance configuration (file + env + `--set`; see shared/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shared.config import ConfigError
from shared.engine.engine import EngineConfig
from shared.service import ServiceConfig
from shared.transfer import TransferConfig


@dataclass
class DecodeConfig(ServiceConfig):
    instance: str = "decode-0"
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    holdings_grace_s: float = 5.0   # a request its router's Holdings no longer list is ended once this old (its router was restarted)
    dcp: int = 1                    # context-parallel ranks: this instance runs as dcp processes, rank r holding every token t with t % dcp == r for all layers (shared/engine/context_parallel.py); a divisor of 16; CPU only so far

    def __post_init__(self) -> None:
        if self.dcp > 1 or self.engine.dcp > 1:
            if self.engine.dcp not in (1, self.dcp):
                raise ConfigError(f"decode.dcp ({self.dcp}) sets engine.dcp: leave it unset (got {self.engine.dcp})")
            try:
                self.engine = replace(self.engine, dcp=self.dcp)
            except ValueError as e:
                raise ConfigError(f"decode.dcp = {self.dcp}: {e}") from None
        if self.engine.pp > 1:
            raise ConfigError(f"decode.engine.pp = {self.engine.pp}: pipeline ranks are prefill's (prefill.pp)")
        if self.holdings_grace_s < 0:
            raise ConfigError(f"holdings_grace_s must be >= 0, got {self.holdings_grace_s}")
