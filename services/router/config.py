"""The router's configuration: `[router]` holds the HTTP API and routing policy, the rest is what
every service has (instance name, bus, tracing, log)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.config import ConfigError
from shared.service import ServiceConfig

ROUTING_POLICIES = ("cache-aware", "sticky", "p2c")  # routing.POLICIES


@dataclass
class RouterSettings:
    host: str = "127.0.0.1"           # bind address: loopback unless you mean it (then set api_keys)
    port: int = 8000                   # HTTP port
    model: str = "smollm2-135m"        # tokenizer + context length; what /v1/models lists
    served_model_name: str = ""        # the name clients send; "" = model
    api_keys: list[str] = field(default_factory=list)  # non-empty: require `Authorization: Bearer <key>`
    default_max_tokens: int = 512      # when the client gives none (capped by the room left in context)
    max_request_tokens: int = 0        # prompt + max_tokens cap; 0 = the model's context
    request_timeout_s: float = 600.0   # whole request, admission to last token
    admission_timeout_s: float = 40.0  # bus timeout for the gate's reply: above the gate's own wait
    submit_timeout_s: float = 10.0     # bus timeout for the prefill's Ack
    session_idle_s: float = 600.0      # a session's sticky prefill is forgotten after this idle time
    routing: str = "cache-aware"       # cache-aware (session owner, longest resident prefix, load), sticky or p2c
    cache_aware_max_imbalance_tokens: int = 16384  # queued-token lead over the idlest prefill that voids a cache hit
    instance_timeout_s: float = 5.0    # a load report older than this: the instance is gone
    graceful_shutdown_s: float = 5.0   # open streams get this long to finish on shutdown

    def __post_init__(self) -> None:
        if self.routing not in ROUTING_POLICIES:
            raise ConfigError(f"router.routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if self.cache_aware_max_imbalance_tokens < 0:
            raise ConfigError("router.cache_aware_max_imbalance_tokens must not be negative, "
                              f"got {self.cache_aware_max_imbalance_tokens}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"router.port must be in [0, 65535], got {self.port}")
        if self.default_max_tokens < 1:
            raise ConfigError(f"router.default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_request_tokens < 0:
            raise ConfigError(f"router.max_request_tokens must not be negative, got {self.max_request_tokens}")
        for name in ("request_timeout_s", "admission_timeout_s", "submit_timeout_s", "session_idle_s",
                     "instance_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"router.{name} must be positive, got {getattr(self, name)}")
        if any(not k for k in self.api_keys):
            raise ConfigError("router.api_keys must not contain empty keys")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


@dataclass
class RouterConfig(ServiceConfig):
    instance: str = "router-0"
    router: RouterSettings = field(default_factory=RouterSettings)
