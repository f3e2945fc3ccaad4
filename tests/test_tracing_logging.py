"""Tracing (jsonl / OTLP / none exporters, W3C propagation across processes) and JSON logging."""

from __future__ import annotations

import json
import logging as std_logging
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import structlog
from opentelemetry import trace

from shared import logging as mlog
from shared import tracing
from shared.tracing import TracingConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _reset():
    yield
    tracing.shutdown_tracing()
    structlog.contextvars.clear_contextvars()
    mlog.reset_logging()


def _jsonl(tmp_path: Path, name: str = "svc", instance: str = "i0") -> Path:
    path = tmp_path / "traces.jsonl"
    tracing.setup_tracing(name, instance, TracingConfig(exporter="jsonl", path=str(path)))
    return path


def test_span_tree_exported_with_links_and_attributes(tmp_path):
    path = _jsonl(tmp_path, "router", "r-1")
    tracer = tracing.get_tracer("test")  # a delegating tracer: fine to take before or after setup
    with tracer.start_as_current_span("request", attributes={"request.id": "abc", "tokens": [1, 2]}) as root:
        with tracer.start_as_current_span("prefill") as child:
            child.add_event("kv.stored", {"blocks": 3})
            with tracer.start_as_current_span("kernel"):
                pass
        with tracer.start_as_current_span("decode"):
            pass
    tracing.shutdown_tracing()  # flushes the batch processor

    spans = {s["name"]: s for s in tracing.read_spans(path)}
    assert set(spans) == {"request", "prefill", "kernel", "decode"}
    trace_id = format(root.get_span_context().trace_id, "032x")
    for s in spans.values():
        assert s["trace_id"] == trace_id and len(s["trace_id"]) == 32 and len(s["span_id"]) == 16
        assert s["service"] == "router" and s["instance"] == "r-1"
        assert s["end_ns"] >= s["start_ns"] and s["duration_ms"] >= 0
    assert spans["request"]["parent_span_id"] is None
    assert spans["prefill"]["parent_span_id"] == spans["request"]["span_id"]
    assert spans["decode"]["parent_span_id"] == spans["request"]["span_id"]
    assert spans["kernel"]["parent_span_id"] == spans["prefill"]["span_id"]
    assert spans["request"]["attributes"] == {"request.id": "abc", "tokens": [1, 2]}
    assert spans["prefill"]["events"][0]["name"] == "kv.stored"
    assert spans["prefill"]["events"][0]["attributes"] == {"blocks": 3}
    assert spans["request"]["status"]["code"] == "UNSET"
    # after shutdown, tracers are no-ops
    with tracer.start_as_current_span("late") as late:
        assert not late.is_recording()


def test_setup_twice_replaces_provider_and_global_api_delegates(tmp_path):
    first = tmp_path / "a.jsonl"
    second = tmp_path / "b.jsonl"
    p1 = tracing.setup_tracing("s", "1", TracingConfig(path=str(first)))
    module_tracer = trace.get_tracer("via-global-api")  # global provider is our delegating one
    with module_tracer.start_as_current_span("one"):
        pass
    p2 = tracing.setup_tracing("s", "2", TracingConfig(path=str(second)))  # shuts p1 down (flush)
    assert p1 is not p2 and tracing.current_provider() is p2
    with module_tracer.start_as_current_span("two"):
        pass
    tracing.shutdown_tracing()
    assert [s["name"] for s in tracing.read_spans(first)] == ["one"]
    assert [(s["name"], s["instance"]) for s in tracing.read_spans(second)] == [("two", "2")]


def test_inject_extract_round_trip(tmp_path):
    _jsonl(tmp_path)
    tracer = tracing.get_tracer("test")
    assert tracing.inject_headers() == {}  # no span: nothing to propagate
    with tracer.start_as_current_span("client") as client:
        headers = tracing.inject_headers({"Nats-Msg-Id": "x"})
    assert headers["Nats-Msg-Id"] == "x" and headers["traceparent"].startswith("00-")
    ctx = tracing.extract_context({"TraceParent": headers["traceparent"]})  # names are case-insensitive
    with tracer.start_as_current_span("server", context=ctx) as server:
        pass
    assert server.get_span_context().trace_id == client.get_span_context().trace_id
    assert server.parent.span_id == client.get_span_context().span_id and server.parent.is_remote
    # no headers / garbage: a new root
    for bad in (None, {}, {"traceparent": "nonsense"}):
        with tracer.start_as_current_span("root", context=tracing.extract_context(bad)) as r:
            assert r.parent is None


_CHILD = """
import sys
from shared import tracing
tracing.setup_tracing("decode", "d-7", tracing.TracingConfig(exporter="jsonl", path=sys.argv[1]))
ctx = tracing.extract_context({"traceparent": sys.argv[2]})
with tracing.get_tracer("child").start_as_current_span("decode.step", context=ctx, attributes={"pid": 1}):
    pass
tracing.shutdown_tracing()
"""


def test_child_in_other_process_joins_trace(tmp_path):
    path = _jsonl(tmp_path, "router", "r-1")
    tracer = tracing.get_tracer("test")
    with tracer.start_as_current_span("route") as parent:
        traceparent = tracing.inject_headers()["traceparent"]
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        subprocess.run([sys.executable, "-c", _CHILD, str(path), traceparent],
                       cwd=REPO, env=env, check=True, timeout=60)
    tracing.shutdown_tracing()
    spans = {s["name"]: s for s in tracing.read_spans(path)}  # both processes appended to one file
    assert set(spans) == {"route", "decode.step"}
    child, route = spans["decode.step"], spans["route"]
    assert child["trace_id"] == route["trace_id"] == format(parent.get_span_context().trace_id, "032x")
    assert child["parent_span_id"] == route["span_id"]
    assert (child["service"], child["instance"]) == ("decode", "d-7")


def test_none_exporter_still_propagates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tracing.setup_tracing("gate", "g", TracingConfig(exporter="none"))
    with tracing.get_tracer("t").start_as_current_span("x") as span:
        assert span.get_span_context().is_valid
        assert "traceparent" in tracing.inject_headers()
    tracing.shutdown_tracing()
    assert list(tmp_path.iterdir()) == []


def test_unknown_exporter_raises():
    with pytest.raises(ValueError) as err:
        tracing.setup_tracing("s", "i", TracingConfig(exporter="zipkin"))
    for name in tracing.EXPORTERS:
        assert name in str(err.value)


def test_otlp_http_exports_to_collector():
    got: list[tuple[str, dict, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_port}"  # bare address: /v1/traces is appended
        tracing.setup_tracing("prefill", "p", TracingConfig(exporter="otlp-http", endpoint=endpoint,
                                                            headers={"Authorization": "Bearer t"}))
        with tracing.get_tracer("t").start_as_current_span("prefill.chunk"):
            pass
        tracing.shutdown_tracing()
    finally:
        server.shutdown()
    assert got and got[0][0] == "/v1/traces"
    assert got[0][1].get("authorization") == "Bearer t"
    assert b"prefill.chunk" in got[0][2]


def test_otlp_grpc_constructs_and_shuts_down():
    provider = tracing.setup_tracing("s", "i", TracingConfig(exporter="otlp-grpc",
                                                             endpoint="http://127.0.0.1:4317",
                                                             headers={"X-Token": "t"}))
    assert provider is tracing.current_provider()
    tracing.shutdown_tracing()  # no spans: nothing is sent, nothing blocks


def _log_lines(err: str) -> list[dict]:
    return [json.loads(line) for line in err.splitlines() if line.strip()]


def test_logging_module_does_not_shadow_stdlib():
    assert mlog.logging is std_logging and "shared" not in Path(std_logging.__file__).parts[-2:]


def test_json_logs_with_context_and_trace_ids(tmp_path, capsys):
    mlog.setup_logging("decode", "d-1", level="debug")
    mlog.setup_logging("decode", "d-1", level="info")  # twice: still one handler
    _jsonl(tmp_path)
    log = mlog.get_logger("moorage.test")
    mlog.bind_request(request_id="req-42")
    log.debug("hidden")
    log.info("outside", n=1)
    with tracing.get_tracer("t").start_as_current_span("work") as span:
        log.warning("inside %s", "span")
        std_logging.getLogger("nats.aio.client").error("stdlib says %d", 7)
    mlog.clear_request()
    log.info("unbound")

    lines = _log_lines(capsys.readouterr().err)
    assert [rec["event"] for rec in lines] == ["outside", "inside span", "stdlib says 7", "unbound"]
    for rec in lines:
        assert rec["service"] == "decode" and rec["instance"] == "d-1"
        assert rec["timestamp"].endswith("Z")
    outside, inside, foreign, unbound = lines
    assert outside["level"] == "info" and outside["n"] == 1 and outside["logger"] == "moorage.test"
    assert outside["request_id"] == "req-42" and "trace_id" not in outside
    ctx = span.get_span_context()
    for rec in (inside, foreign):
        assert rec["request_id"] == "req-42"
        assert rec["trace_id"] == format(ctx.trace_id, "032x")
        assert rec["span_id"] == format(ctx.span_id, "016x")
    assert inside["level"] == "warning"
    assert foreign["level"] == "error" and foreign["logger"] == "nats.aio.client"
    assert "request_id" not in unbound


def test_exceptions_are_rendered_in_json(capsys):
    mlog.setup_logging("gate", "g-1")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        mlog.get_logger("x").exception("failed")
    (rec,) = _log_lines(capsys.readouterr().err)
    assert rec["level"] == "error" and "RuntimeError: boom" in rec["exception"]


def _collector():
    """A fake OTLP/HTTP collector: (server, received [(path, body)])."""
    got: list[tuple[str, bytes]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self):
            got.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, got


def test_several_exporters_at_once_and_service_attributes_for_otlp(tmp_path):
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    server, got = _collector()
    path = tmp_path / "t.jsonl"
    try:
        tracing.setup_tracing("prefill", "prefill-3", TracingConfig(
            exporter="jsonl, otlp-http", endpoint=f"http://127.0.0.1:{server.server_port}", path=str(path)))
        with tracing.get_tracer("t").start_as_current_span("kv.handoff", attributes={"bytes": 5}):
            pass
        tracing.shutdown_tracing()
    finally:
        server.shutdown()
    [(route, body)] = got
    req = ExportTraceServiceRequest.FromString(body)
    [rs] = req.resource_spans
    resource = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
    assert resource["service.name"] == "prefill" and resource["openinference.project.name"] == tracing.PROJECT
    [otlp] = rs.scope_spans[0].spans
    attrs = {kv.key: (kv.value.string_value or kv.value.int_value) for kv in otlp.attributes}
    # a UI that drops the resource (Phoenix) still sees which service recorded the span
    assert attrs == {"bytes": 5, "service.name": "prefill", "service.instance.id": "prefill-3"}
    [line] = tracing.read_spans(path)  # the same span in the file
    assert route == "/v1/traces" and line["name"] == "kv.handoff" and line["span_id"] == otlp.span_id.hex()


def test_service_attributes_only_when_exporting_over_otlp(tmp_path):
    path = _jsonl(tmp_path, "decode", "d-0")
    with tracing.get_tracer("t").start_as_current_span("decode.generate", attributes={"tokens": 3}):
        pass
    tracing.shutdown_tracing()
    assert tracing.read_spans(path)[0]["attributes"] == {"tokens": 3}


@pytest.mark.parametrize("exporter", ["jsonl,zipkin", "none,jsonl", "", " , "])
def test_bad_exporter_lists_are_rejected_when_configured(exporter):
    with pytest.raises(ValueError, match="trace exporter"):
        TracingConfig(exporter=exporter)


def test_sample_ratio_is_validated_when_configured():
    with pytest.raises(ValueError, match="sample_ratio"):
        TracingConfig(sample_ratio=1.5)
