"""Every service's /health and /metrics (shared/ops_http.py): health follows readiness, the metrics are the
load report's figures, parsed back with prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from shared.config import ConfigError
from shared.messages import LoadReport
from shared.ops_http import HttpSettings, OpsEndpoint


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _gate_report() -> LoadReport:
    return LoadReport("gate-0", "gate", True, 1000, 400, running=3, waiting=2,
                      detail={"admitted": 7, "malformed": 0, "live_instances": 1, "note": "text is skipped",
                              "budget_tokens": {"decode-0": 900, "decode-1": 100}, "empty": {}})


def test_metrics_are_the_load_report():
    ep = OpsEndpoint("gate", "gate-0", lambda: (True, ""), _gate_report)
    r = TestClient(ep.app()).get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    got = _samples(r.text)
    me = (("instance", "gate-0"), ("role", "gate"))
    assert got[("moorage_ready", me)] == 1
    assert got[("moorage_kv_capacity_tokens", me)] == 1000
    assert got[("moorage_kv_free_tokens", me)] == 400
    assert got[("moorage_running", me)] == 3 and got[("moorage_waiting", me)] == 2
    assert got[("moorage_gate_admitted", me)] == 7
    assert got[("moorage_gate_budget_tokens", (*me[:1], ("of", "decode-0"), *me[1:]))] == 900
    assert got[("moorage_gate_budget_tokens", (*me[:1], ("of", "decode-1"), *me[1:]))] == 100
    assert not any(name.startswith("moorage_gate_note") or name == "moorage_gate_empty" for name, _ in got)


def test_health_follows_readiness():
    state = {"ok": False}
    ep = OpsEndpoint("decode", "decode-0", lambda: (state["ok"], "engine loop stalled"), lambda: None)
    client = TestClient(ep.app())
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["reason"] == "engine loop stalled"
    assert _samples(client.get("/metrics").text)[("moorage_ready", (("instance", "decode-0"), ("role", "decode")))] == 0
    state["ok"] = True
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "role": "decode", "instance": "decode-0"}


def test_serves_on_a_real_port_and_stops():
    async def main():
        ep = OpsEndpoint("store", "store-0", lambda: (True, ""), lambda: LoadReport("store-0", "store", True))
        url = await ep.start(HttpSettings(port=0))
        assert url.startswith("http://127.0.0.1:")
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url + "/health", timeout=5).read())
        assert json.loads(body)["status"] == "ok"
        await ep.stop()
        with pytest.raises(urllib.error.URLError):
            await asyncio.to_thread(lambda: urllib.request.urlopen(url + "/health", timeout=2).read())
        assert await OpsEndpoint("x", "x-0", lambda: (True, ""), lambda: None).start(HttpSettings(port=-1)) == ""

    asyncio.run(main())


def test_port_in_use_is_a_clear_error():
    async def main():
        ep = OpsEndpoint("gate", "gate-0", lambda: (True, ""), lambda: None)
        url = await ep.start(HttpSettings(port=0))
        port = int(url.rsplit(":", 1)[1])
        with pytest.raises(OSError, match="gate http cannot listen on 127.0.0.1"):
            await OpsEndpoint("gate", "gate-1", lambda: (True, ""), lambda: None).start(HttpSettings(port=port))
        await ep.stop()

    asyncio.run(main())


def test_settings_validate():
    with pytest.raises(ConfigError, match="http.port"):
        HttpSettings(port=70000)
