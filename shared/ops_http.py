"""Every service's operations endpoint: `GET /health` (200 only when ready) and `GET /metrics`
(Prometheus text) on its own HTTP port, the `[http]` section of every config.

The figures are the service's own load report, the one it publishes on the bus every second, turned
into gauges: the common fields (`moorage_ready`, `moorage_kv_free_tokens`, ...) and every number of its
`detail`, named after the role (`moorage_gate_waiting`, `moorage_prefill_handoff_bytes`). A detail
that maps names to numbers (the gate's `budget_tokens` per decode, the prefill's `pool` counters) becomes
one gauge with an `of` label (`moorage_prefill_pool{of="restored_bytes"}`). A service adds its own collectors to `OpsEndpoint.registry`. Neither path is traced.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import uvicorn
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from shared.config import ConfigError
from shared.messages import LoadReport
from shared.sockets import listen, url_of

_NAME = re.compile(r"[^a-zA-Z0-9_]")
COMMON = {"capacity_tokens": "moorage_kv_capacity_tokens", "free_tokens": "moorage_kv_free_tokens",
          "running": "moorage_running", "waiting": "moorage_waiting", "queued_tokens": "moorage_queued_tokens"}


@dataclass
class HttpSettings:
    host: str = "127.0.0.1"  # bind address of /health and /metrics (loopback unless you mean it)
    port: int = 0            # 0: any free port (logged); -1: no endpoint (the router serves both on its API port)

    def __post_init__(self) -> None:
        if not -1 <= self.port <= 65535:
            raise ConfigError(f"http.port must be -1 (off), 0 (any) or a port number, got {self.port}")


def metric_name(*parts: str) -> str:
    return _NAME.sub("_", "_".join(p for p in parts if p)).lower()


def _number(value) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


class LoadReportCollector:
    """prometheus_client collector: the service's current load report, read at scrape time."""

    def __init__(self, role: str, instance: str, report: Callable[[], LoadReport | None]):
        self.role, self.instance, self.report = role, instance, report

    def describe(self) -> list:
        return []  # unchecked collector: families depend on the report

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["role", "instance"]
        values = [self.role, self.instance]
        report = self.report()
        ready = GaugeMetricFamily("moorage_ready", "1 when the service is ready to serve", labels=labels)
        ready.add_metric(values, float(bool(report is not None and report.ready)))
        yield ready
        if report is None:
            return
        for field_name, name in COMMON.items():
            g = GaugeMetricFamily(name, f"load report field {field_name}", labels=labels)
            g.add_metric(values, float(getattr(report, field_name)))
            yield g
        yield from self._detail(report.detail or {}, labels, values)

    def _detail(self, detail: dict, labels: list[str], values: list[str]) -> Iterator[GaugeMetricFamily]:
        for key, value in detail.items():
            name = metric_name("moorage", self.role, str(key))
            number = _number(value)
            if number is not None:
                g = GaugeMetricFamily(name, f"{self.role} load report detail {key}", labels=labels)
                g.add_metric(values, number)
                yield g
            elif isinstance(value, dict):
                numbers = {str(k): _number(v) for k, v in value.items()}
                numbers = {k: v for k, v in numbers.items() if v is not None}
                if numbers:
                    g = GaugeMetricFamily(name, f"{self.role} load report detail {key}, by name",
                                          labels=[*labels, "of"])
                    for k, v in sorted(numbers.items()):
                        g.add_metric([*values, k], v)
                    yield g


class EmbeddedServer(uvicorn.Server):
    """uvicorn inside a service's own event loop, without its own signal handling: the service runtime owns
    SIGTERM / SIGINT. `serving()` waits until it accepts connections (or raises why it never will)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.ready = asyncio.Event()  # set once started

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.ready.set()

    async def serving(self, task: asyncio.Task) -> None:
        """Until `task` (this server's serve()) has started serving; its error if it ended before."""
        started = asyncio.ensure_future(self.ready.wait())
        try:
            await asyncio.wait([started, task], return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if not self.started:
            task.result()  # re-raises why it could not start
            raise RuntimeError("the HTTP server stopped during startup")


class OpsEndpoint:
    """/health and /metrics of one service. `ready()` decides health; the registry holds the figures."""

    def __init__(self, role: str, instance: str, ready: Callable[[], tuple[bool, str]],
                 report: Callable[[], LoadReport | None]):
        self.role, self.instance, self.ready = role, instance, ready
        self.registry = CollectorRegistry()
        self.registry.register(LoadReportCollector(role, instance, report))
        self.url = ""
        self._server: EmbeddedServer | None = None
        self._task = None
        self._sock: socket.socket | None = None

    def app(self) -> Starlette:
        async def health(_request) -> JSONResponse:
            ok, reason = self.ready()
            body = {"status": "ok" if ok else "unavailable", "role": self.role, "instance": self.instance}
            if not ok:
                body["reason"] = reason
            return JSONResponse(body, status_code=200 if ok else 503)

        async def metrics(_request) -> Response:
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        return Starlette(routes=[Route("/health", health), Route("/metrics", metrics)])

    async def start(self, settings: HttpSettings) -> str:
        """Listen (port 0: any free one) and serve in the background; returns the URL ("" when off)."""
        if settings.port < 0:
            return ""
        self._sock = listen(settings.host, settings.port, f"{self.role} http")
        self.url = url_of(self._sock)
        self._server = EmbeddedServer(uvicorn.Config(self.app(), log_config=None, access_log=False, lifespan="off",
                                              timeout_keep_alive=30))
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]), name=f"{self.role}-http")
        return self.url

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=3.0)
        except (asyncio.TimeoutError, Exception):
            self._server.force_exit = True
            self._task.cancel()
        if self._sock is not None:
            self._sock.close()
