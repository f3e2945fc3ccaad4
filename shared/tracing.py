"""OpenTelemetry tracing for every moorage service, and W3C trace-context propagation over NATS headers.

The SDK lets the *global* tracer provider be set only once per process, which makes re-configuration
(tests, a service restarting its pipeline) impossible. So the real provider lives in this module
(`_provider`), replaced by each `setup_tracing` call, and everything hands out *delegating* tracers
that look it up when a span starts: a module-level `tracer = get_tracer(__name__)` taken before setup
still records once setup runs, and stops (no-op) after `shutdown_tracing()`. The global API provider is
set, once, to a delegating provider too, so `opentelemetry.trace.get_tracer` works the same way.

Exporters: "jsonl" (one JSON object per span appended to a file, several processes may share it),
"otlp-grpc", "otlp-http", or "none" (spans still get ids and propagate, nothing is exported); several at
once as a comma list, e.g. "jsonl,otlp-http" (what `moorage up --set up.trace_ui=phoenix` sets: the file for
`moorage trace`, OTLP for the UI). Any OTLP endpoint works: a collector, Jaeger or Phoenix, on gRPC (4317)
or HTTP (4318, or Phoenix's own port; a bare address gets /v1/traces).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

EXPORTERS = ("jsonl", "otlp-grpc", "otlp-http", "none")
PROJECT = "moorage"  # resource openinference.project.name: the project Phoenix files the spans under


@dataclass
class TracingConfig:
    exporter: str = "jsonl"  # jsonl | otlp-grpc | otlp-http | none, or a comma list of them (jsonl,otlp-http)
    endpoint: str = ""  # OTLP: http://127.0.0.1:4317 (grpc) or http://127.0.0.1:4318/v1/traces (http)
    path: str = "moorage-traces.jsonl"  # the jsonl exporter's file (several services may share it)
    headers: dict[str, str] = field(default_factory=dict)  # OTLP auth
    sample_ratio: float = 1.0  # share of new traces recorded (children follow their parent)

    def __post_init__(self) -> None:
        names = self.exporters
        bad = [n for n in names if n not in EXPORTERS]
        if bad or not names or ("none" in names and len(names) > 1):
            raise ValueError(f"unknown trace exporter {self.exporter!r}: expected one of {', '.join(EXPORTERS)} "
                             f"or a comma list of them (without none)")
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be in [0, 1], got {self.sample_ratio}")

    @property
    def exporters(self) -> list[str]:
        return [n.strip() for n in self.exporter.split(",") if n.strip()]


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON line per finished span. Each line is one `os.write` on an O_APPEND descriptor,
    so lines from several processes appending to the same file never interleave."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        self._fd: int | None = None

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [(json.dumps(span_to_dict(s), default=str, separators=(",", ":")) + "\n").encode()
                 for s in spans]
        try:
            with self._lock:
                if self._fd is None:
                    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                for line in lines:
                    os.write(self._fd, line)  # regular-file O_APPEND write: whole line, atomically
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # unbuffered

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _hex_trace(trace_id: int) -> str:
    return format(trace_id, "032x")


def _hex_span(span_id: int) -> str:
    return format(span_id, "016x")


def _plain(attrs: Mapping | None) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in (attrs or {}).items()}


def span_to_dict(span: ReadableSpan) -> dict:
    ctx = span.context
    res = span.resource.attributes if span.resource else {}
    start, end = span.start_time or 0, span.end_time or 0
    return {
        "name": span.name,
        "trace_id": _hex_trace(ctx.trace_id),
        "span_id": _hex_span(ctx.span_id),
        "parent_span_id": _hex_span(span.parent.span_id) if span.parent else None,
        "service": res.get("service.name"),
        "instance": res.get("service.instance.id"),
        "kind": span.kind.name,
        "start_ns": start,
        "end_ns": end,
        "duration_ms": (end - start) / 1e6,
        "attributes": _plain(span.attributes),
        "status": {"code": span.status.status_code.name, "description": span.status.description},
        "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": _plain(e.attributes)}
                   for e in span.events],
    }


def read_spans(path: str | os.PathLike[str]) -> list[dict]:
    """All spans in a jsonl trace file (missing file: none)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


# --- provider holder and delegating tracers ------------------------------------------------------

_provider: TracerProvider | None = None
_setup_lock = threading.Lock()


class _DelegatingTracer(trace.Tracer):
    """Resolves the module's current provider at every span start (no-op when none is set up)."""

    def __init__(self, name: str, version: str | None = None, schema_url: str | None = None):
        self._args = (name, version, schema_url)
        self._cache: tuple[object, trace.Tracer] | None = None

    def _target(self) -> trace.Tracer:
        provider, cache = _provider, self._cache
        if cache is not None and cache[0] is provider:
            return cache[1]
        tracer = provider.get_tracer(*self._args) if provider is not None else trace.NoOpTracer()
        self._cache = (provider, tracer)
        return tracer

    def start_span(self, *args, **kwargs) -> trace.Span:
        return self._target().start_span(*args, **kwargs)

    def start_as_current_span(self, *args, **kwargs):
        return self._target().start_as_current_span(*args, **kwargs)


class _DelegatingTracerProvider(trace.TracerProvider):
    def get_tracer(self, instrumenting_module_name, instrumenting_library_version=None,
                   schema_url=None, attributes=None) -> trace.Tracer:
        return _DelegatingTracer(instrumenting_module_name, instrumenting_library_version, schema_url)


def get_tracer(name: str) -> trace.Tracer:
    return _DelegatingTracer(name)


def current_provider() -> TracerProvider | None:
    return _provider


def _make_exporter(name: str, config: TracingConfig) -> SpanExporter | None:
    if name == "none":
        return None
    if name == "jsonl":
        return JsonLinesSpanExporter(config.path)
    if name == "otlp-grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc

        headers = {k.lower(): v for k, v in config.headers.items()} or None  # grpc metadata: lowercase
        return Grpc(endpoint=config.endpoint or None, headers=headers)
    if name == "otlp-http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

        endpoint = config.endpoint or None
        if endpoint and urlsplit(endpoint).path in ("", "/"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"  # a bare collector address
        return Http(endpoint=endpoint, headers=dict(config.headers) or None)
    raise ValueError(f"unknown trace exporter {name!r}: expected one of {', '.join(EXPORTERS)}")


class _ServiceAttributes(SpanProcessor):
    """Copies the service name and instance onto every span, for OTLP UIs that keep span attributes
    but not the resource (Phoenix): two attribute writes per span, only when an OTLP exporter is on."""

    def __init__(self, service_name: str, instance: str):
        self._attrs = {"service.name": service_name, "service.instance.id": instance}

    def on_start(self, span, parent_context=None) -> None:
        span.set_attributes(self._attrs)


def setup_tracing(service_name: str, instance: str, config: TracingConfig | None = None) -> TracerProvider:
    """Install a fresh provider (flushing and shutting down any previous one) and return it."""
    config = config or TracingConfig()
    exporters = [_make_exporter(n, config) for n in config.exporters]  # built before anything is torn down
    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name, "service.instance.id": instance,
                                  "openinference.project.name": PROJECT}),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
    )
    if any(n.startswith("otlp") for n in config.exporters):
        provider.add_span_processor(_ServiceAttributes(service_name, instance))
    for exporter in exporters:
        if exporter is not None:
            provider.add_span_processor(BatchSpanProcessor(exporter))
    global _provider
    with _setup_lock:
        old, _provider = _provider, provider
        if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):  # global not set yet
            trace.set_tracer_provider(_DelegatingTracerProvider())
    if old is not None:
        old.shutdown()
    return provider


def shutdown_tracing() -> None:
    """Flush and shut down the current provider; tracers become no-ops until the next setup."""
    global _provider
    with _setup_lock:
        old, _provider = _provider, None
    if old is not None:
        old.force_flush()
        old.shutdown()


# --- W3C trace context over NATS headers ---------------------------------------------------------

_PROPAGATOR = TraceContextTextMapPropagator()


def inject_headers(headers: dict | None = None, context: Context | None = None) -> dict[str, str]:
    """Add `traceparent` (and `tracestate`) for the current (or given) context to `headers` (a new
    dict when None) and return it. Nothing is added outside a valid span."""
    headers = {} if headers is None else headers
    _PROPAGATOR.inject(headers, context=context)
    return headers


def extract_context(headers: Mapping[str, str] | None) -> Context:
    """The remote parent carried by message headers (case-insensitive names), for
    `tracer.start_as_current_span(name, context=ctx)`. No or bad headers: an empty context (root span)."""
    carrier = {str(k).lower(): v for k, v in (headers or {}).items()}
    return _PROPAGATOR.extract(carrier, context=Context())
