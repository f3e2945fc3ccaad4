"""The gate's configuration: `[gate]` holds the admission policy, the rest is what every service has."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.config import ConfigError
from shared.service import ServiceConfig


@dataclass
class GateSettings:
    budget_fraction: float = 0.9        # share of a decode instance's KV capacity the gate may promise
    admission_wait_s: float = 30.0      # longest a request waits for budget before it is rejected (429)
    max_input_tokens: int = 0           # 0: no limit beyond the decode capacity
    max_output_tokens: int = 0          # 0: no limit beyond the decode capacity
    reservation_ttl_s: float = 900.0    # a reservation never released (its router died) expires after this
    instance_timeout_s: float = 10.0    # a decode whose last load report is older is not chosen (one announced exited is out at once)
    retry_after_s: float = 1.0          # least Retry-After sent with a rejection (it is estimated from the queue)
    retry_after_max_s: float = 30.0     # most Retry-After sent (also when nothing was released lately)
    release_window_s: float = 60.0      # releases in this window give the rate the queue drains at
    holdings_grace_s: float = 5.0       # a reservation a router's Holdings no longer lists is dropped once this old
    osl_margin: float = 1.25            # a request with an expected output length (agent hint nvext.agent_hints.osl) reserves osl x this, up to max_tokens; 0: reserve max_tokens regardless
    priority_step_s: float = 2.0        # queue head start per priority level (agent hints): priority 5 is served as if it had waited 10 s more
    router_timeout_s: float = 30.0      # stall backstop: a router process with no load report this long is gone, what it holds is dropped and its requests cancelled (an announced exit does that at once; 0: off; keep it well above the routers' load_interval_s)

    def __post_init__(self) -> None:
        if not 0.0 < self.budget_fraction <= 1.0:
            raise ConfigError(f"gate.budget_fraction must be in (0, 1], got {self.budget_fraction}")
        for name in ("admission_wait_s", "retry_after_s", "max_input_tokens", "max_output_tokens", "router_timeout_s",
                     "priority_step_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"gate.{name} must not be negative, got {getattr(self, name)}")
        if self.osl_margin != 0 and self.osl_margin < 1.0:
            raise ConfigError(f"gate.osl_margin must be 0 (off) or at least 1, got {self.osl_margin}")
        if self.retry_after_max_s < self.retry_after_s:
            raise ConfigError(f"gate.retry_after_max_s ({self.retry_after_max_s}) must be >= gate.retry_after_s "
                              f"({self.retry_after_s})")
        for name in ("reservation_ttl_s", "instance_timeout_s", "release_window_s", "holdings_grace_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"gate.{name} must be positive, got {getattr(self, name)}")


@dataclass
class GateConfig(ServiceConfig):
    instance: str = "gate-0"
    gate: GateSettings = field(default_factory=GateSettings)
