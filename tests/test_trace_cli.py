"""`moorage trace show|breakdown`: per-request traces and per-stage latency from the spans, first on
hand-made spans (pure logic), then on a real system's traces.jsonl (tiny model, pool on, a turn
restored from the pool): one trace per request with the right parents, no health-check spans."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from infra.tracecli import parse_since
from infra.tracequery import breakdown, find_request, read_jsonl, request_traces
from infra.traceview import waterfall
from infra.up import UpConfig, launched
from shared.config import load_config
from tests.natsbus import nats_url
from tests.tracetree import EXPECTED, SYSTEM, arrived, check_tree, restored_turn

REPO = Path(__file__).resolve().parents[1]
MS = 1_000_000


def span(name, trace, sid, parent, start_ms, dur_ms, service="prefill", **attrs):
    return {"name": name, "trace_id": trace, "span_id": sid, "parent_span_id": parent, "service": service,
            "start_ns": start_ms * MS, "end_ns": (start_ms + dur_ms) * MS, "duration_ms": float(dur_ms),
            "attributes": attrs, "status": {"code": "UNSET"}}


def request(trace: str, t0: int, compute: int, rid: str) -> list[dict]:
    """A request: 5 ms in the router before prefill (1 of them at the gate), two handoff rounds."""
    return [
        span("router.request", trace, f"{trace}r", None, t0, 100 + compute, "router", request_id=rid, ttft_ms=20.0 + compute),
        span("gate.admit", trace, f"{trace}g", f"{trace}r", t0 + 2, 1, "gate"),
        span("prefill.queue", trace, f"{trace}q", f"{trace}r", t0 + 5, 3),
        span("prefill.compute", trace, f"{trace}c", f"{trace}r", t0 + 8, compute),
        span("kv.handoff", trace, f"{trace}h", f"{trace}r", t0 + 8 + compute, 10),
        *[span(n, trace, f"{trace}{n}{i}", f"{trace}h", t0 + 9 + compute + i, 2, s)
          for i in range(2) for n, s in (("kv.gather", "prefill"), ("kv.write", "prefill"), ("decode.scatter", "decode"))],
        span("decode.generate", trace, f"{trace}d", f"{trace}r", t0 + 20 + compute, 80, "decode",
             first_token_ms=4.0, itl_mean_ms=10.0 + compute / 100),
    ]


def test_stages_of_one_request():
    [t] = request_traces(request("a" * 32, 1000, 50, "req-1") + [span("GET /x", "b" * 32, "x", None, 0, 1)])
    st = t.stages()
    assert st["router"] == pytest.approx(4.0)  # 5 ms to the first prefill span, less the gate's 1 ms
    assert (st["gate"], st["queue"], st["compute"], st["handoff"]) == (1.0, 3.0, 50.0, 10.0)
    assert (st["gather"], st["write"], st["scatter"]) == (4.0, 4.0, 4.0)  # two rounds, summed
    assert (st["first_token"], st["itl"], st["ttft"], st["total"]) == (4.0, 10.5, 70.0, 150.0)
    assert "restore" not in st and "lookup" not in st  # not gone through: absent, not 0
    assert [s["name"] for s in t.spans][:2] == ["router.request", "gate.admit"]
    assert t.depth(t.named("kv.write")[0]) == 2


def test_breakdown_percentiles_across_requests():
    spans = [s for i in range(10) for s in request(f"{i:032x}", i * 1000, 10 * (i + 1), f"req-{i}")]
    bd = breakdown(request_traces(spans))
    rows = {s.key: s for s in bd.stages}
    assert bd.requests == 10
    want = np.percentile([10 * (i + 1) for i in range(10)], [50, 90, 99])
    assert (rows["compute"].p50, rows["compute"].p90, rows["compute"].p99) == pytest.approx(tuple(want))
    assert rows["compute"].n == 10 and "restore" not in rows
    assert [s.key for s in bd.stages][:3] == ["router", "gate", "queue"]  # a request's order


def test_find_request_by_id_prefix_or_last():
    traces = request_traces(request("a" * 32, 0, 5, "req-abc") + request("b" * 32, 10, 500, "req-def"))
    assert find_request(traces, "req-abc").trace_id == "a" * 32
    assert find_request(traces, "cmpl-abc").trace_id == "a" * 32  # the completion's id
    assert find_request(traces, "b" * 32).request_id == "req-def"  # a trace id
    assert find_request(traces, None).request_id == "req-def"  # --last: the latest to finish
    with pytest.raises(LookupError):
        find_request(traces, "req-nope")
    with pytest.raises(LookupError):
        find_request([], None)


def test_parse_since():
    assert parse_since(None) == 0 and parse_since("") == 0
    assert parse_since("10m", now=1000.0) == int(400 * 1e9)
    assert parse_since("1.5h", now=10_000.0) == int(4600 * 1e9)
    assert parse_since("1700000000") == 1_700_000_000 * 10**9
    assert parse_since("2026-01-02T03:04:05+00:00") == 1767323045 * 10**9
    with pytest.raises(ValueError):
        parse_since("yesterday")


def test_waterfall_renders_every_span_in_tree_order():
    from rich.console import Console

    [t] = request_traces(request("c" * 32, 0, 30, "req-w"))
    console = Console(width=220, record=True)
    console.print(waterfall(t))
    lines = console.export_text().splitlines()
    names = [ln.split("│")[1].strip() for ln in lines if ln.startswith("│")]
    assert names[0] == "router.request" and names[-1] == "decode.generate"
    assert names.index("kv.handoff") < names.index("kv.gather") < names.index("decode.generate")
    assert "req-w" in lines[0]


def moorage(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.cli", "trace", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def wait_trace(path: Path, request_id: str, names: set[str], timeout: float = 30.0) -> list[dict]:
    """The request's trace once every name is in it and it is complete (services export spans in batches, so the file may not even
    exist yet). Polls: the spans arrive in another process's file, with nothing to await."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            traces = request_traces(read_jsonl(path))
        except FileNotFoundError:  # no batch exported yet: the file appears with the first one
            traces = []
        t = next((t for t in traces if t.request_id == request_id), None)
        if (t and names <= {s["name"] for s in t.spans} and arrived(t.spans)) or time.monotonic() > deadline:
            return t.spans if t else []
        time.sleep(0.5)


def test_a_real_system_traces_one_tree_per_request_and_the_cli_reads_it(tmp_path):
    with nats_url() as url:
        cfg = load_config(UpConfig, overrides=[*SYSTEM, "up.port=0", f"up.nats_url={url}",
                                               f"up.run_dir={tmp_path}"])
        with launched(cfg) as (launcher, base):
            rids = restored_turn(base)
            for _ in range(3):  # health and metrics polls must leave no spans
                assert httpx.get(base + "/health").status_code == 200
                assert httpx.get(base + "/metrics").status_code == 200
            path = launcher.run_dir / "traces.jsonl"
            spans = wait_trace(path, rids[-1], set(EXPECTED) | {"store.save"})
            by_name = check_tree(spans)
            gen = by_name["decode.generate"][0]["attributes"]
            assert gen["decode_tokens"] == 7 and gen["completion_tokens"] == 8  # prefill samples the first
            assert 0 < gen["itl_p50_ms"] <= gen["itl_max_ms"] and gen["first_token_ms"] > 0
        all_spans = read_jsonl(path)
        assert not [s for s in all_spans if s["name"].startswith(("GET ", "POST ", "fastapi."))]
        traces = {s["trace_id"] for s in all_spans}
        roots = [s for s in all_spans if s["parent_span_id"] is None]
        assert len(roots) == len(traces) and {s["name"] for s in roots} == {"router.request"}
        assert {t.request_id for t in request_traces(all_spans)} >= set(rids)

    shown = moorage("show", rids[-1], "--run-dir", str(tmp_path), "--width", "200")
    assert shown.returncode == 0, shown.stderr
    for name in ("router.request", "store.restore", "kv.gather", "decode.scatter", "decode.generate"):
        assert name in shown.stdout
    last = moorage("show", "--last", "--file", str(path), "--width", "200")
    assert last.returncode == 0 and rids[-1] in last.stdout
    table = moorage("breakdown", "--file", str(path), "--since", "1h", "--width", "200")
    assert table.returncode == 0, table.stderr
    for label in ("router overhead", "gate wait", "prefill queue", "store restore", "prefill compute",
                  "handoff gather", "handoff write", "handoff scatter", "decode first token", "inter-token gap"):
        assert label in table.stdout
    assert "over 3 requests" in table.stdout
    none = moorage("breakdown", "--file", str(path), "--since", "2099-01-01T00:00:00+00:00")
    assert none.returncode == 1 and "no request traces" in none.stdout
    missing = moorage("show", "--last", "--file", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 1 and "no trace file" in missing.stdout


def test_up_trace_ui_setting_and_every_service_exporting_to_it(tmp_path):
    from infra.trace_ui import export_to
    from shared.config import ConfigError

    with pytest.raises(ConfigError, match="up.trace_ui"):
        load_config(UpConfig, overrides=["up.trace_ui=jaeger"])
    cfg = load_config(UpConfig, overrides=["up.trace_ui=phoenix", "gate.tracing.path=/elsewhere.jsonl"])
    out = export_to(cfg, "http://127.0.0.1:6006", tmp_path / "traces.jsonl")
    for section in ("router", "gate", "prefill", "decode", "store", "master"):
        t = getattr(out, section).tracing
        assert (t.exporter, t.endpoint) == ("jsonl,otlp-http", "http://127.0.0.1:6006")
        assert t.path == ("/elsewhere.jsonl" if section == "gate" else str(tmp_path / "traces.jsonl"))
    assert cfg.router.tracing.exporter == "jsonl" and out.up == cfg.up  # a copy; up itself untouched


def test_decode_records_gap_stats_not_spans_per_token():
    from services.decode.main import Active

    a = Active(prompt_tokens=10, sources={}, span=None, adopted=100.0)
    assert a.summary() == {"decode_tokens": 0, "first_token_ms": 0.0}
    for t in (100.004, 100.014, 100.024, 100.064):  # first token after 4 ms, then gaps of 10, 10, 40 ms
        a.on_tokens(1, t)
    s = a.summary()
    assert s["decode_tokens"] == 4 and s["first_token_ms"] == pytest.approx(4.0)
    assert (s["itl_mean_ms"], s["itl_p50_ms"], s["itl_max_ms"]) == pytest.approx((20.0, 10.0, 40.0))
