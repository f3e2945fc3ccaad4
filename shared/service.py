"""What every service's `main` shares: config from file + env + CLI, logging, tracing, the bus
connection, a periodic load report, and a clean shutdown on SIGTERM/SIGINT.

A service main reads: `run_service(ROLE, MyConfig, serve)` where `serve(ctx)` subscribes and returns;
the runtime then waits for a signal, calls the service's `on_stop` hooks, drains the bus and flushes
traces. Nothing here knows about any particular service.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from shared.bus import Bus, BusConfig
from shared.config import ConfigError, describe, load_config
from shared.logging import get_logger, setup_logging
from shared.messages import LoadReport
from shared.ops_http import HttpSettings, OpsEndpoint
from shared.sdnotify import notify
from shared.threads import default_workers, started_executor
from shared.tracing import TracingConfig, setup_tracing, shutdown_tracing


BOOT_ENV = "MOORAGE_BOOT"


def process_boot() -> str:
    """This process's incarnation (the `boot` of its load reports). A supervisor that announces exits sets
    it, so its InstanceExited names the process that ended: `moorage up` and `moorage watch` in MOORAGE_BOOT,
    systemd in INVOCATION_ID (its ExecStopPost sees the same). Otherwise a fresh id."""
    return os.environ.get(BOOT_ENV) or os.environ.get("INVOCATION_ID") or uuid.uuid4().hex[:12]


@dataclass
class LogConfig:
    level: str = "info"  # debug | info | warning | error
    json: bool = True    # JSON lines on stderr (false: human-readable console output)


@dataclass
class ServiceConfig:
    """The keys every service has; each service's config adds its own section(s)."""
    instance: str = "service-0"       # this instance's name on the bus
    load_interval_s: float = 1.0      # how often it publishes its load report
    bus: BusConfig = field(default_factory=BusConfig)
    http: HttpSettings = field(default_factory=HttpSettings)  # this service's /health and /metrics
    tracing: TracingConfig = field(default_factory=TracingConfig)
    log: LogConfig = field(default_factory=LogConfig)


@dataclass
class ServiceContext:
    role: str
    instance: str
    config: Any
    bus: Bus
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    load_report: Callable[[], LoadReport] | None = None  # published every load_interval_s
    report_soon: asyncio.Event = field(default_factory=asyncio.Event)  # set: publish the load report now (KV freed)
    serving: bool = False  # serve() returned and no stop yet: what /health says with the load report
    http_url: str = ""     # where /health and /metrics answer ("" when http.port is -1)
    started_at: float = field(default_factory=time.time)
    boot: str = field(default_factory=process_boot)  # this process's incarnation
    exit_code: int = 0  # what the process exits with once stopped: non-zero asks its supervisor for a restart

    def fail(self, reason: str, code: int = 1) -> None:
        """Stop the service and exit with `code`: it cannot go on (a pipeline rank died), a restart may."""
        if not self.exit_code:
            get_logger(self.role).error("service failed: stopping for a restart", reason=reason, exit_code=code)
            self.exit_code = code
        self.stop.set()

    @property
    def log(self):
        return get_logger(self.role)


REPORT_GAP_S = 0.02  # reports asked for with report_soon go out at most this often (a burst is one report)


async def _report_load(ctx: ServiceContext, interval: float) -> None:
    """The load report every `interval`, and at once when the service sets `report_soon` (a decode that
    freed KV: a gate that counts decode's reported free KV would otherwise wait up to `interval` to admit
    the next request). Each report carries `detail.loop_lag_ms`: how late this loop woke for its previous
    deadline (the event loop blocked, or the whole process starved or frozen): what a silence is made of."""
    lag_ms = 0.0
    while not ctx.stop.is_set():
        ctx.report_soon.clear()
        if ctx.load_report is not None:
            with contextlib.suppress(Exception):
                await ctx.bus.publish(ctx.bus.subjects.load(ctx.role, ctx.instance), _stamped(ctx, lag_ms))
        waits = [asyncio.ensure_future(ctx.stop.wait()), asyncio.ensure_future(ctx.report_soon.wait())]
        deadline = time.monotonic() + interval
        try:
            done, _ = await asyncio.wait(waits, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if not done:
            lag_ms = max(0.0, time.monotonic() - deadline) * 1e3
        if ctx.report_soon.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ctx.stop.wait(), timeout=REPORT_GAP_S)


def _stamped(ctx: ServiceContext, loop_lag_ms: float | None = None) -> LoadReport:
    report = ctx.load_report()
    report.boot = ctx.boot
    if loop_lag_ms is not None and isinstance(report.detail, dict):
        report.detail["loop_lag_ms"] = round(loop_lag_ms, 1)
    return report


def _health(ctx: ServiceContext) -> tuple[bool, str]:
    """Ready when serve() has returned, no stop has begun, and the service's own report says ready."""
    if not ctx.serving:
        return False, "stopping" if ctx.stop.is_set() else "starting"
    if ctx.load_report is None:
        return True, ""
    report = ctx.load_report()
    if report.ready:
        return True, ""
    return False, str((report.detail or {}).get("unhealthy") or "not ready")


async def _run(role: str, config: Any, serve: Callable[[ServiceContext], Awaitable[None]]) -> int:
    instance = config.instance
    setup_logging(role, instance, config.log.level, config.log.json)
    setup_tracing(role, instance, config.tracing)
    log = get_logger(role)
    loop = asyncio.get_running_loop()
    loop.set_default_executor(started_executor(default_workers(), "asyncio"))  # to_thread's, up front
    bus = await Bus.connect(config.bus, f"{role}-{instance}")
    ctx = ServiceContext(role, instance, config, bus)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ctx.stop.set)
    reporter = None
    ops = OpsEndpoint(role, instance, lambda: _health(ctx), lambda: ctx.load_report() if ctx.load_report else None)
    try:
        ctx.http_url = await ops.start(config.http)  # answers 503 until serve() returns
        await serve(ctx)
        ctx.serving = True
        reporter = asyncio.create_task(_report_load(ctx, getattr(config, "load_interval_s", 1.0)))
        log.info("ready", role=role, instance=instance, nats=config.bus.url, http=ctx.http_url or None)
        notify("READY=1")
        await ctx.stop.wait()
        log.info("stopping")
    finally:
        ctx.serving = False
        notify("STOPPING=1")
        # A second signal must not turn a clean exit into -15: ignore them from here, in one step. The loop's
        # remove_signal_handler would pass through SIG_DFL first (a window CI hit); uvloop leaves dispositions
        # alone when it closes, so its stale entries are harmless.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        for hook in reversed(ctx.on_stop):
            with contextlib.suppress(Exception):
                await hook()
        if reporter:
            reporter.cancel()
        if ctx.load_report is not None:  # say goodbye so routers and gates stop choosing us at once
            with contextlib.suppress(Exception):
                report = _stamped(ctx)
                report.ready = False
                await bus.publish(bus.subjects.load(role, instance), report)
        await bus.close()
        await ops.stop()
        shutdown_tracing()
        log.info("stopped", exit_code=ctx.exit_code)
    return ctx.exit_code


def parse_service_args(role: str, config_cls: type, argv: list[str] | None = None):
    p = argparse.ArgumentParser(prog=f"moorage serve {role}", description=f"the moorage {role} service")
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key (repeatable)")
    p.add_argument("--print-config", action="store_true", help="print every key with its default and exit")
    args = p.parse_args(argv)
    if args.print_config:
        for key, tp, default in describe(config_cls):
            print(f"{key} = {default!r}  # {tp}")
        sys.exit(0)
    return load_config(config_cls, args.config, args.set)


def run_service(role: str, config_cls: type, serve: Callable[[ServiceContext], Awaitable[None]],
                argv: list[str] | None = None) -> int:
    try:
        config = parse_service_args(role, config_cls, argv)
    except ConfigError as e:
        print(f"moorage {role}: config error: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop

        return uvloop.run(_run(role, config, serve))
    except ImportError:  # pragma: no cover - uvloop is a core dependency
        return asyncio.run(_run(role, config, serve))


__all__ = ["BusConfig", "LogConfig", "ServiceConfig", "ServiceContext", "TracingConfig", "run_service"]
