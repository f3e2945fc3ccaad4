"""The router's configuration: `[router]` holds the HTTP API and routing policy, the rest is what
every service has (instance name, bus, tracing, log)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.config import ConfigError
from shared.kv_tenant import MAX_TENANT_CHARS
from shared.ops_http import HttpSettings
from shared.service import ServiceConfig

ROUTING_POLICIES = ("cache-aware", "sticky", "p2c")  # routing.POLICIES


@dataclass
class RouterSettings:
    host: str = "127.0.0.1"           # bind address: loopback unless you mean it (then set api_keys)
    port: int = 8000                   # HTTP port
    listen_fd: int = -1                # >= 0: serve on this listening socket, inherited from the parent (moorage up binds host:port itself and hands it down); -1: bind host:port here
    model: str = "smollm2-135m"        # tokenizer + context length; what /v1/models lists
    served_model_name: str = ""        # the name clients send; "" = model
    api_keys: list[str] = field(default_factory=list)  # non-empty: require `Authorization: Bearer <key>`
    api_key_tenants: dict[str, str] = field(default_factory=dict)  # more keys, each with its tenant ({key = "tenant"}): tenants never share cached KV; keys of one tenant (and all of api_keys) do
    max_priority: int = 10             # agent hints: the highest priority (higher first) a request may ask for; above it is a 400
    tenant_max_priority: dict[str, int] = field(default_factory=dict)  # per tenant of api_key_tenants ({tenant = n}): its own ceiling
    metrics_require_key: bool = False  # GET /metrics needs an API key too (when any key is configured)
    default_max_tokens: int = 512      # when the client gives none (capped by the room left in context)
    max_request_tokens: int = 0        # prompt + max_tokens cap; 0 = the model's context
    request_timeout_s: float = 600.0   # whole request, admission to last token
    admission_timeout_s: float = 40.0  # bus timeout for the gate's reply: above the gate's own wait
    submit_timeout_s: float = 10.0     # bus timeout for the prefill's Ack
    overlap_admission: bool = True     # submit to prefill while the gate decides, when the gate's last report says it will admit at once (saves the admit round trip)
    session_idle_s: float = 600.0      # a session's sticky prefill is forgotten after this idle time
    retention: str = "session"         # session: tell prefill and decode when a session's answer ended its task (no tool call), so its cached KV is evicted before that of sessions expected back; lru: say nothing (plain LRU)
    session_pin_min_s: float = 60.0    # retention=session: a session expected back has its new pool objects soft-pinned, at least this long: for 1.5x the 95th percentile of the tool pauses seen while the pool evicts nothing; under pressure only as far past the pool's turnover as the returns it catches, weighed by the session's recompute cost, are worth the space (services/router/pauses.py)
    session_pin_max_s: float = 1800.0  # ... and at most this long (also the pin until 8 pauses were seen)
    routing: str = "cache-aware"       # cache-aware (session owner, longest resident prefix, load), sticky or p2c
    cache_aware_max_imbalance_tokens: int = 16384  # queued-token lead over the idlest prefill that voids a cache hit
    instance_timeout_s: float = 10.0   # an instance whose last load report is older is not chosen for new requests (one announced exited is out at once)
    liveness_timeout_s: float = 30.0   # stall backstop: a request whose prefill or decode sent no load report this long ends (503); an exit announced by its supervisor, or a not-ready report, ends it at once
    graceful_shutdown_s: float = 5.0   # open streams get this long to finish on shutdown
    holdings_interval_s: float = 5.0   # how often the gate is told what this router still holds (frees lost Releases)

    def __post_init__(self) -> None:
        if self.retention not in ("session", "lru"):
            raise ConfigError(f"router.retention must be session or lru, got {self.retention!r}")
        if not 0 < self.session_pin_min_s <= self.session_pin_max_s:
            raise ConfigError("router.session_pin_min_s must be positive and at most router.session_pin_max_s, got "
                              f"{self.session_pin_min_s} and {self.session_pin_max_s}")
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
                     "instance_timeout_s", "liveness_timeout_s", "holdings_interval_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"router.{name} must be positive, got {getattr(self, name)}")
        ceilings = {"max_priority": self.max_priority,
                    **{f"tenant_max_priority.{t}": n for t, n in self.tenant_max_priority.items()}}
        for name, ceiling in ceilings.items():
            if not -1000 <= ceiling <= 1000:
                raise ConfigError(f"router.{name} must be in [-1000, 1000], got {ceiling}")
        if any(not k for k in self.api_keys):
            raise ConfigError("router.api_keys must not contain empty keys")
        for key, tenant in self.api_key_tenants.items():
            if not key:
                raise ConfigError("router.api_key_tenants must not contain empty keys")
            if not tenant or len(tenant) > MAX_TENANT_CHARS:
                raise ConfigError(f"router.api_key_tenants: each tenant is a name of 1-{MAX_TENANT_CHARS} "
                                  f"characters, got {tenant!r}")
            if key in self.api_keys:
                raise ConfigError("router.api_key_tenants: a key is listed in router.api_keys too "
                                  "(the untenanted namespace); list it in one place")

    def priority_ceiling(self, tenant: str) -> int:
        return self.tenant_max_priority.get(tenant, self.max_priority)

    @property
    def key_tenants(self) -> dict[str, str]:
        """Every accepted API key and its tenant ("" = the deployment's own namespace)."""
        return {**{k: "" for k in self.api_keys}, **self.api_key_tenants}

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


@dataclass
class RouterConfig(ServiceConfig):
    instance: str = "router-0"
    http: HttpSettings = field(default_factory=lambda: HttpSettings(port=-1))  # /health and /metrics are on the API port
    router: RouterSettings = field(default_factory=RouterSettings)
