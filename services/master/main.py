"""The master service: runs `mooncake_master` as a child, restarts it when it dies, and reports the pool.

The child binds its RPC port (what stores and clients call `master_addr`) and an HTTP port whose
`/metrics` (Prometheus text) and `/health` are the pool's own endpoints; this service only scrapes
`/metrics` every load_interval_s into its LoadReport (role "master"): capacity, use, objects, clients,
evictions, restarts and the metrics URL; and it lists the pool's keys every events_interval_s to
publish store-tier KV events (chunks that left the pool: see store_events.py). It serves nothing else.
A restarted master keeps its ports; stores remount their segments by themselves within about a second,
but every object is lost (the object metadata lived in the dead process). The child dies with this
service (SIGTERM on shutdown, PR_SET_PDEATHSIG if this process is killed outright).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from services.master.config import MasterSettings
from services.master.store_events import StoreEventPublisher
from shared.messages import KVEventBatch, LoadReport
from shared.service import ServiceContext
from shared.sockets import free_port

# LoadReport.detail key -> the master's Prometheus metric
METRICS = {
    "capacity_bytes": "master_total_capacity_bytes",
    "used_bytes": "master_allocated_bytes",
    "objects": "master_key_count",
    "clients": "master_active_clients",
    "evictions": "master_evicted_key_count",
    "evicted_bytes": "master_evicted_size_bytes",
    "eviction_passes": "master_successful_evictions_total",
    "put_alloc_failures": "master_put_start_alloc_failures_total",
}
SEGMENT_METRICS = {"segment_used_bytes": "segment_allocated_bytes{segment}",
                   "segment_capacity_bytes": "segment_total_capacity_bytes{segment}"}
HEALTH_TIMEOUT_S = 15.0
POLL_S = 0.1


def master_binary(configured: str = "") -> str:
    if configured:
        return configured
    import mooncake

    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.exists():
        raise FileNotFoundError(f"mooncake_master not found in {path.parent}: install the mooncake extra")
    return str(path)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value} for unlabelled samples, and {"name{label}": {label value: value}}
    for samples with one label (the per-segment figures, e.g. `segment_allocated_bytes{segment=...}`)."""
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels:
                out[sample.name] = float(sample.value)
                if family.type == "counter" and sample.name.endswith("_total"):  # the parser appends _total
                    out.setdefault(sample.name.removesuffix("_total"), float(sample.value))
            elif len(sample.labels) == 1:
                (label, value), = sample.labels.items()
                out.setdefault(f"{sample.name}{{{label}}}", {})[value] = float(sample.value)
    return out


def master_args(s: MasterSettings, rpc_port: int, metrics_port: int) -> list[str]:
    return [master_binary(s.binary), f"--rpc_address={s.host}", f"--rpc_port={rpc_port}",
            f"--metrics_host={s.host}", f"--metrics_port={metrics_port}",
            f"--eviction_high_watermark_ratio={s.eviction_high_watermark_ratio}",
            f"--eviction_ratio={s.eviction_ratio}", f"--default_kv_lease_ttl={s.default_kv_lease_ttl_ms}",
            f"--client_ttl={s.client_ttl_s}", "--logtostderr", *s.extra_args]


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _http_get(url: str, timeout: float = 1.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - our own loopback child
        return r.read().decode()


class Master:
    def __init__(self, ctx: ServiceContext):
        self.ctx, self.log = ctx, ctx.log
        self.s: MasterSettings = ctx.config.master
        self.rpc_port = self.s.rpc_port or free_port(self.s.host)
        self.metrics_port = self.s.metrics_port or free_port(self.s.host)
        local = "127.0.0.1" if self.s.host in ("0.0.0.0", "") else self.s.host
        self.master_addr = f"{local}:{self.rpc_port}"
        self.base_url = f"http://{local}:{self.metrics_port}"
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.stats: dict[str, float] = {}
        self.scraped_ok = False
        self.stopping = False

    async def spawn(self) -> None:
        """Start the child and wait until its /health answers; raises if it exits first."""
        args = master_args(self.s, self.rpc_port, self.metrics_port)
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}: {' '.join(args)}")
            with contextlib.suppress(Exception):
                await asyncio.to_thread(_http_get, self.base_url + "/health", 0.5)
                break
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("mooncake_master did not become healthy in time")
            await asyncio.sleep(POLL_S)
        self.log.info("mooncake_master running", pid=self.proc.pid, master_addr=self.master_addr,
                      metrics_url=self.base_url + "/metrics", restarts=self.restarts)

    async def watch(self) -> None:
        """Restart the child whenever it dies, after restart_backoff_s."""
        while not self.stopping:
            if self.proc is None:
                return
            await asyncio.to_thread(self.proc.wait)  # its exit is the event; stop() ends it too
            if self.stopping:
                return
            self.log.warning("mooncake_master died", returncode=self.proc.returncode, restarts=self.restarts)
            self.scraped_ok = False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctx.stop.wait(), timeout=self.s.restart_backoff_s)
            if self.stopping or self.ctx.stop.is_set():
                return
            self.restarts += 1
            try:
                await self.spawn()
            except RuntimeError as e:
                self.log.error("mooncake_master restart failed", error=str(e), restarts=self.restarts)

    async def scrape(self) -> None:
        while not self.stopping:
            try:
                self.stats = parse_metrics(await asyncio.to_thread(_http_get, self.base_url + "/metrics"))
                self.scraped_ok = True
            except Exception:
                self.scraped_ok = False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctx.stop.wait(), timeout=self.ctx.config.load_interval_s)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def load_report(self) -> LoadReport:
        detail: dict = {k: int(self.stats.get(m, 0)) for k, m in METRICS.items()}
        for key, metric in SEGMENT_METRICS.items():  # per store segment: {segment: bytes}
            detail[key] = {seg: int(v) for seg, v in self.stats.get(metric, {}).items()}
        detail.update(restarts=self.restarts, up=self.alive(), metrics_url=self.base_url + "/metrics",
                      master_addr=self.master_addr, pid=self.proc.pid if self.proc else 0,
                      eviction_high_watermark_ratio=self.s.eviction_high_watermark_ratio,
                      eviction_ratio=self.s.eviction_ratio)
        return LoadReport(instance=self.ctx.instance, role="master", ready=self.alive() and self.scraped_ok,
                          capacity_tokens=0, endpoint=self.master_addr, detail=detail)

    async def stop(self, timeout: float = 5.0) -> None:
        self.stopping = True
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        self.log.info("mooncake_master stopped", returncode=proc.returncode)


async def serve(ctx: ServiceContext) -> None:
    master = Master(ctx)
    await master.spawn()
    tasks = [asyncio.create_task(master.watch()), asyncio.create_task(master.scrape())]
    ctx.load_report = master.load_report
    if master.s.events_interval_s > 0:
        events = StoreEventPublisher(ctx, master, master.s.events_interval_s, _http_get)
        await ctx.bus.subscribe(ctx.bus.subjects.kv_events("*"), KVEventBatch, events.on_kv_events)
        tasks.append(asyncio.create_task(events.run()))

        def load_report() -> LoadReport:
            report = master.load_report()
            report.detail["store_events"] = events.detail()
            return report

        ctx.load_report = load_report

    async def stop() -> None:
        await master.stop()
        for t in tasks:
            t.cancel()

    ctx.on_stop.append(stop)
