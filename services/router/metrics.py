"""The router's Prometheus metrics, in a registry of its own (one per app: tests build several)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_PREFIX_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

CLIENT_CLOSED = 499  # nginx's status for "client went away before the answer": used as a label only


class OpenRequests:
    """The requests being served now: the in-flight gauge, and a wait until none is left (shutdown)."""

    def __init__(self, gauge: Gauge):
        self.gauge, self.count = gauge, 0
        self._none = asyncio.Event()
        self._none.set()

    def opened(self) -> None:
        self.count += 1
        self.gauge.inc()
        self._none.clear()

    def closed(self) -> None:
        self.count -= 1
        self.gauge.dec()
        if self.count == 0:
            self._none.set()

    async def drained(self, timeout: float) -> bool:
        """Until no request is open (True), or `timeout` seconds (False)."""
        try:
            await asyncio.wait_for(self._none.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("moorage_router_requests", "Requests by endpoint and final HTTP status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("moorage_router_time_to_first_token_seconds",
                              "Request arrival to first token", ["endpoint"], buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram("moorage_router_request_duration_seconds",
                             "Request arrival to last byte (successful requests)", ["endpoint"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("moorage_router_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.completion_tokens = Counter("moorage_router_completion_tokens",
                                         "Completion tokens of finished requests", registry=r)
        self.cached_tokens = Counter("moorage_router_cached_tokens",
                                     "Prompt tokens not recomputed, by where their KV came from",
                                     ["source"], registry=r)
        self.admission_rejections = Counter("moorage_router_admission_rejections",
                                            "Requests the gate did not admit", ["reason"], registry=r)
        self.overlapped = Counter("moorage_router_overlapped_admissions",
                                  "Requests submitted to prefill while the gate decided, by the gate's answer "
                                  "(refused: prefill work that was cancelled)", ["outcome"], registry=r)
        self.open_requests = OpenRequests(Gauge("moorage_router_in_flight_requests", "Requests being served now",
                                                registry=r))
        self.retries = Counter("moorage_router_retries", "Requests retried on other instances after one failed "
                               "or went away, by the failed instance's role", ["role"], registry=r)
        self.routed = Counter("moorage_router_routed", "Prefill choices by what decided them", ["reason"],
                              registry=r)
        self.resident_prefix = Histogram("moorage_router_resident_prefix_tokens",
                                         "Prompt tokens the chosen prefill holds in device memory, per the KV "
                                         "index (when cache-aware routing looked)", buckets=_PREFIX_BUCKETS,
                                         registry=r)
        self.kv_events = Counter("moorage_router_kv_events", "KV lifecycle events received, by outcome",
                                 ["result"], registry=r)
        self.kv_index_blocks = Gauge("moorage_router_kv_index_blocks",
                                     "Device blocks the KV index believes resident, all prefills", registry=r)
        self.kv_store_chunks = Gauge("moorage_router_kv_store_chunks",
                                     "Store chunks the KV index has seen saved and not removed", registry=r)
        for reason in ("sticky", "cache", "load"):
            self.routed.labels(reason)
        for result in ("applied", "malformed"):
            self.kv_events.labels(result)
        for source in ("device", "store"):
            self.cached_tokens.labels(source)
        for outcome in ("admitted", "refused"):
            self.overlapped.labels(outcome)
        for reason in ("rejected", "invalid", "no_decode", "timeout"):
            self.admission_rejections.labels(reason)

    def observe_usage(self, usage: dict) -> None:
        self.prompt_tokens.inc(usage.get("prompt_tokens", 0))
        self.completion_tokens.inc(usage.get("completion_tokens", 0))
        breakdown = usage.get("moorage") or {}
        for source in ("device", "store"):
            self.cached_tokens.labels(source).inc(max(0, int(breakdown.get(source, 0) or 0)))

    def observe_route(self, decision) -> None:
        """A routing.Decision (None: nothing chosen)."""
        if decision is None:
            return
        self.routed.labels(decision.reason).inc()
        if decision.resident_tokens is not None:
            self.resident_prefix.observe(decision.resident_tokens)

    def watch_index(self, index) -> None:
        """Read the KV index's sizes at scrape time."""
        self.kv_index_blocks.set_function(lambda: index.total_blocks)
        self.kv_store_chunks.set_function(lambda: index.store_chunks)

    def render(self) -> bytes:
        return generate_latest(self.registry)
