"""The router's hot routes (services/router/app.py HotRoutes): POST /v1/completions and /v1/chat/completions
go straight to a Generation, everything else to the FastAPI app; the request is finished (Release,
metrics, span, log) only after its response went out. In process, nothing on a bus (the `scripted` app
of test_router_failfast.py)."""

from __future__ import annotations

import asyncio
import json

from services.router.app import HotRoutes
from services.router.generate import Generation
from tests.test_router_failfast import BODY, _chunk, scripted  # noqa: F401 (scripted is a fixture)


def _state(client):
    app = client._transport.app
    assert isinstance(app, HotRoutes)
    return app.state


def _requests_total(state, status: str) -> float:
    return state.metrics.registry.get_sample_value("moorage_router_requests_total",
                                                   {"endpoint": "completions", "status": status}) or 0.0


async def test_the_response_goes_out_before_the_request_is_finished(scripted):
    async with scripted([_chunk("ab"), _chunk("c", True)]) as client:
        app = client._transport.app
    state, sent = _state(client), []

    body, connected = [json.dumps(BODY).encode()], asyncio.Event()

    async def receive():  # the body once, then nothing until a disconnect that never comes
        if body:
            return {"type": "http.request", "body": body.pop(), "more_body": False}
        await connected.wait()

    async def send(message):  # what the router had accounted for when each message left
        sent.append((message["type"], state.metrics.open_requests.count, _requests_total(state, "200")))

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json")], "query_string": b"", "root_path": "", "scheme": "http", "server": ("router", 80), "http_version": "1.1"}
    await app(scope, receive, send)
    assert [t for t, _, _ in sent] == ["http.response.start", "http.response.body"]
    assert all(in_flight == 1 and done == 0 for _, in_flight, done in sent)  # not finished while sending
    assert state.metrics.open_requests.count == 0 and _requests_total(state, "200") == 1  # finished after


async def test_every_other_method_and_path_is_the_fastapi_apps_with_openai_errors(scripted):
    async with scripted([]) as c:
        wrong_method = await c.get("/v1/completions")
        unknown = await c.post("/v1/nothing", json=BODY)
        schema = await c.get("/openapi.json")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
    assert schema.status_code == 200 and "/v1/completions" in schema.json()["paths"]


async def test_a_bug_before_the_response_is_an_openai_500_not_plain_text(scripted, monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(Generation, "__init__", broken)
    async with scripted([]) as c:
        r = await c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 500 and r.json()["error"] == {"message": "internal error in the router",
                                                          "type": "server_error", "param": None, "code": None}


async def test_errors_are_finished_too_and_counted_once(scripted):
    async with scripted([]) as c:
        state = _state(c)
        r = await c.post("/v1/completions", json={**BODY, "model": "no-such-model"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert _requests_total(state, "404") == 1
    assert state.metrics.open_requests.count == 0
