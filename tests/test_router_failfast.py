"""Requests that fail fast and cleanly (issue 10): the router watches each in-flight request's prefill and
decode, ends the request within seconds when one goes (an SSE error event + [DONE], or a 503 JSON with
Retry-After), retries once on other instances when the client has received nothing yet, and answers at
once when no decode is alive.

Part 1: the liveness bookkeeping as pure logic, with the clock passed in (microseconds).
Part 2: the real system (nats-server, gate, two prefills, one decode, router; tiny model) with processes
stopped and killed under it: SIGSTOP / kill -9 of a prefill before any token, kill -9 of decode mid-stream,
then no decode at all. Greedy output must equal the in-process engine's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import threading
import time

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.router.liveness import Gone, Liveness, LivenessMonitor, Watch
from services.router.routing import LoadTable
from shared.messages import LoadReport

T = 3.0  # liveness timeout in the pure tests


class Fired:
    def __init__(self):
        self.gone: list[Gone] = []

    def __call__(self, gone: Gone) -> None:
        self.gone.append(gone)


def watched(live: Liveness, *keys: tuple[str, str], now: float = 0.0) -> tuple[Watch, Fired]:
    fired = Fired()
    w = Watch(fired)
    for role, instance in keys:
        live.add(w, role, instance, now)
    return w, fired


def heartbeat(live: Liveness, t0: float, t1: float, who=(("gate", "gate-0"), ("router", "router-0")),
              step: float = 0.5) -> None:
    """Reports from `who` every `step` seconds in [t0, t1]."""
    t = t0
    while t <= t1 + 1e-9:
        for role, instance in who:
            live.report(role, instance, True, "", t)
        t += step


# ---- Part 1: Liveness ------------------------------------------------------------------------------
def test_a_not_ready_report_fires_at_once_with_its_reason():
    live = Liveness(T)
    w, fired = watched(live, ("decode", "decode-0"), ("prefill", "prefill-0"))
    live.report("prefill", "prefill-1", False, "unhealthy: engine loop dead", 0.1)  # not ours
    assert fired.gone == []
    live.report("decode", "decode-0", False, "unhealthy: engine loop dead: boom", 0.2)
    assert fired.gone == [Gone("decode", "decode-0", "unhealthy: engine loop dead: boom")]
    live.report("prefill", "prefill-0", False, "not ready (stopped)", 0.3)
    assert len(fired.gone) == 1 and w.gone is not None  # once
    assert not live.watching()  # a fired watch is forgotten


def test_an_instance_silent_while_others_report_is_gone_after_the_timeout():
    live = Liveness(T)
    _, fired = watched(live, ("decode", "decode-0"), ("prefill", "prefill-0"))
    heartbeat(live, 0.0, 1.0, who=(("decode", "decode-0"), ("prefill", "prefill-0"), ("gate", "gate-0")))
    heartbeat(live, 1.5, 4.0)  # decode-0 and prefill-0 went silent after t=1.0
    assert fired.gone == []  # 3.0 s of silence is not more than T
    heartbeat(live, 4.5, 4.5)
    assert [g.role for g in fired.gone] == ["decode"] and "no load report for 3.5 s" in fired.gone[0].reason


def test_reports_keep_an_instance_alive_and_unwatching_ends_the_watch():
    live = Liveness(T)
    w, fired = watched(live, ("decode", "decode-0"))
    heartbeat(live, 0.0, 30.0, who=(("decode", "decode-0"), ("gate", "gate-0")))
    assert fired.gone == []
    live.remove(w)
    assert not live.watching()
    heartbeat(live, 31.0, 40.0)  # decode-0 silent, but nobody watches it any more
    assert fired.gone == []


def test_an_instance_never_heard_of_gets_the_timeout_from_the_watch():
    live = Liveness(T)
    heartbeat(live, 0.0, 5.0)
    _, fired = watched(live, ("decode", "decode-9"), now=5.0)
    heartbeat(live, 5.5, 8.0)
    assert fired.gone == []
    heartbeat(live, 8.5, 8.5)
    assert fired.gone and fired.gone[0].instance == "decode-9"


def test_a_known_down_instance_fires_when_watched():
    live = Liveness(T)
    live.report("decode", "decode-0", False, "unhealthy: engine step running for 200 s", 1.0)
    _, fired = watched(live, ("decode", "decode-0"), now=1.5)
    assert fired.gone == [Gone("decode", "decode-0", "unhealthy: engine step running for 200 s")]
    live.report("decode", "decode-0", True, "", 2.0)  # back: watchable again
    _, again = watched(live, ("decode", "decode-0"), now=2.0)
    assert again.gone == []


def test_an_announced_exit_ends_the_watches_at_once_and_busy_silence_does_not():
    """Busy is not dead (issue 33): a process silent for less than the stall backstop keeps its requests,
    whatever the reason (here a saturated host); its supervisor's InstanceExited ends them at once."""
    live = Liveness(30.0)
    _, fired = watched(live, ("decode", "decode-0"), ("prefill", "prefill-0"))
    heartbeat(live, 0.0, 25.0)  # decode-0 and prefill-0 say nothing for 25 s: starved, not dead
    assert fired.gone == []
    live.exited("decode", "decode-0", "exited (killed by SIGKILL)")
    assert fired.gone == [Gone("decode", "decode-0", "exited (killed by SIGKILL)")]
    _, late = watched(live, ("decode", "decode-0"), now=25.5)  # watched after the exit: gone at once
    assert late.gone == [Gone("decode", "decode-0", "exited (killed by SIGKILL)")]
    live.report("decode", "decode-0", True, "", 27.0, boot="new")  # the restarted process reports ready
    _, again = watched(live, ("decode", "decode-0"), now=27.0)
    assert again.gone == []


def test_the_load_table_drops_an_exited_instance_and_its_late_reports():
    """The announcement takes the instance out of choice; a report its process sent before dying that
    arrives after the announcement (another connection, no order between them) does not bring it back;
    a late announcement of an earlier process changes nothing for the one reporting now."""
    from shared.messages import InstanceExited

    loads, heard = LoadTable(10.0), []
    loads.exit_listeners.append(lambda msg, now: heard.append(msg.instance))
    report = LoadReport("decode-0", "decode", True, capacity_tokens=100, free_tokens=100, boot="b1")
    loads.update(report, 0.0)
    assert [v.instance for v in loads.fresh("decode", 0.1)] == ["decode-0"]
    assert loads.exited(InstanceExited("decode", "decode-0", boot="b1", how="killed by SIGKILL"), 0.2)
    assert loads.fresh("decode", 0.2) == [] and heard == ["decode-0"]
    loads.update(report, 0.3)  # sent by b1 before it died
    assert loads.fresh("decode", 0.3) == []
    loads.update(msgspec.structs.replace(report, boot="b2"), 2.0)  # the restarted process
    assert [v.instance for v in loads.fresh("decode", 2.0)] == ["decode-0"]
    assert not loads.exited(InstanceExited("decode", "decode-0", boot="b0"), 2.1)  # an earlier run: stale
    assert [v.instance for v in loads.fresh("decode", 2.1)] == ["decode-0"] and heard == ["decode-0"]


def test_an_instance_restarted_faster_than_the_timeout_is_gone_for_what_the_old_process_held():
    """A supervisor brings a killed gate back in ~3 s: never silent for the timeout, but the admits the old
    process held will never be answered. Its reports carry a new boot id: that ends the watches at once."""
    live = Liveness(T)
    live.report("gate", "gate-0", True, "", 0.0, boot="a1")
    _, fired = watched(live, ("gate", "gate-0"), now=0.5)
    live.report("gate", "gate-0", True, "", 1.0, boot="a1")
    assert fired.gone == []
    live.report("gate", "gate-0", True, "", 2.0, boot="b2")  # the restarted process
    assert fired.gone == [Gone("gate", "gate-0", "restarted")]
    _, again = watched(live, ("gate", "gate-0"), now=2.1)  # the new one is watchable as usual
    live.report("gate", "gate-0", True, "", 2.5, boot="b2")
    assert again.gone == []


def test_a_router_that_heard_nothing_for_a_while_blames_nobody_for_the_burst_that_follows():
    """Its event loop was blocked 6 s: the queued reports then arrive in a burst, in no useful order."""
    live = Liveness(T)
    _, fired = watched(live, ("decode", "decode-0"), ("prefill", "prefill-0"))
    who = (("decode", "decode-0"), ("prefill", "prefill-0"), ("gate", "gate-0"))
    heartbeat(live, 0.0, 1.0, who=who)
    live.report("gate", "gate-0", True, "", 7.0)  # first of the burst: decode-0 looks 6 s old
    live.report("decode", "decode-0", True, "", 7.0)
    live.report("prefill", "prefill-0", True, "", 7.0)
    assert fired.gone == []
    heartbeat(live, 7.5, 9.5, who=who)
    assert fired.gone == []


def test_a_lost_bus_fires_everything_sooner_when_the_connection_is_down():
    live = Liveness(T)
    _, a = watched(live, ("decode", "decode-0"))
    heartbeat(live, 0.0, 1.0)
    assert live.check_bus(2.0, True, 0) == pytest.approx(1.0 + T + 0.01)  # when to look again
    live.check_bus(4.1, True, 0)  # silent 3.1 s with the connection up: maybe our own loop; wait
    assert a.gone == []
    assert live.check_bus(4.1, True, 0) == pytest.approx(1.0 + 2 * T + 0.01)
    live.check_bus(4.2, False, 0)  # silent and disconnected: gone
    assert a.gone and a.gone[0].role == "bus"

    live2 = Liveness(T)
    _, b = watched(live2, ("decode", "decode-0"))
    heartbeat(live2, 0.0, 1.0)
    live2.check_bus(6.9, True, 0)
    assert b.gone == []
    live2.check_bus(7.1, True, 0)  # 2 x T with nothing heard at all: gone even if connected
    assert b.gone and b.gone[0].role == "bus"


def test_a_reconnected_bus_fires_the_watches_that_started_before_it():
    live = Liveness(T)
    _, old = watched(live, ("decode", "decode-0"))
    live.check_bus(0.5, True, 1)  # the router reconnected: what was published meanwhile is lost
    assert old.gone and "re-established" in old.gone[0].reason
    _, new = watched(live, ("decode", "decode-0"), now=0.6)
    live.check_bus(0.7, True, 1)
    assert new.gone == []


async def test_the_monitor_fires_a_watch_from_its_timer_when_nothing_arrives():
    clock = time.monotonic
    monitor = LivenessMonitor(0.2, clock)
    fired = asyncio.Event()
    w = Watch(lambda gone: fired.set())
    monitor.on_report(LoadReport("decode-0", "decode", True), clock())
    monitor.watch(w, "decode", "decode-0")
    t0 = time.monotonic()
    await asyncio.wait_for(fired.wait(), 5.0)  # no reports at all: 2 x 0.2 s, then the bus counts as lost
    assert 0.3 < time.monotonic() - t0 < 3.0 and w.gone.role == "bus"
    await monitor.close()


async def test_the_monitor_fires_on_a_pushed_goodbye_without_waiting_for_its_timer():
    clock = time.monotonic
    monitor = LivenessMonitor(30.0, clock)
    fired: list[Gone] = []
    w = Watch(fired.append)
    monitor.watch(w, "prefill", "prefill-0")
    monitor.on_report(LoadReport("prefill-0", "prefill", False, detail={"unhealthy": "engine loop dead: x"}), clock())
    assert fired == [Gone("prefill", "prefill-0", "unhealthy: engine loop dead: x")]
    await monitor.close()


# ---- the HTTP side in process: what the client gets when something breaks ------------------------------
@pytest.fixture
def scripted(monkeypatch):
    """An app whose dispatches replay a script of TokenChunks and exceptions (nothing on a bus), with
    prefill-0/1 and decode-0 reported ready."""
    from types import SimpleNamespace

    from services.router.app import create_app
    from services.router.config import RouterSettings
    from services.router.dispatch import Dispatch, RouterState
    from services.router.routing import LoadTable, make_picker
    from shared.engine.models import load_tokenizer

    tokenizer, max_context = load_tokenizer("tiny")

    def make(script: list, starts: list | None = None):
        steps, attempts = iter(script), iter(starts or [])

        async def start(self):
            self.prefill, self.decode = f"prefill-{self.attempt}", "decode-0"
            failure = next(attempts, None)
            if failure is not None:
                raise failure

        async def next_chunk(self):
            item = next(steps)
            if isinstance(item, BaseException):
                raise item
            return item

        monkeypatch.setattr(Dispatch, "start", start)
        monkeypatch.setattr(Dispatch, "next_chunk", next_chunk)
        loads = LoadTable(5.0)
        bus = SimpleNamespace(max_message_bytes=1 << 20)  # what prepare() asks of the bus; nothing is sent
        state = RouterState(RouterSettings(model="tiny"), bus, tokenizer, max_context, loads,
                            make_picker("p2c", loads, 600.0))
        for role, name in (("prefill", "prefill-0"), ("prefill", "prefill-1"), ("decode", "decode-0")):
            loads.update(LoadReport(name, role, True), state.clock())
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url="http://router")
    return make


def _chunk(text: str, finished: bool = False):
    from shared.messages import TokenChunk

    return TokenChunk("r", [ord(c) for c in text], text, finished, "length" if finished else None)


def _events(body: str) -> list:
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: ")]


BODY = {"model": "tiny", "prompt": "hi", "max_tokens": 4}


async def test_an_unexpected_error_inside_a_started_stream_is_an_error_event_then_done(scripted):
    async with scripted([_chunk("a"), _chunk("b"), RuntimeError("boom")]) as c:
        r = await c.post("/v1/completions", json={**BODY, "stream": True})
    events = _events(r.text)
    assert r.status_code == 200 and [e["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
    assert events[2] == {"error": {"message": "internal error in the router", "type": "server_error",
                                   "param": None, "code": None}}
    assert events[3:] == ["[DONE]"]


async def test_unexpected_errors_and_leaked_cancellations_are_json_never_plain_text(scripted):
    async with scripted([], starts=[RuntimeError("boom")]) as c:
        r = await c.post("/v1/completions", json=BODY)
    assert r.status_code == 500 and r.json()["error"]["message"] == "internal error in the router"
    async with scripted([], starts=[asyncio.CancelledError()]) as c:  # e.g. a bus future cancelled under us
        r = await c.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    assert int(r.headers["retry-after"]) >= 1


async def test_a_lost_instance_before_any_byte_is_retried_once_and_the_answer_is_the_retrys(scripted):
    from services.router.dispatch import InstanceLost

    lost = InstanceLost("prefill", "prefill-0", "no load report for 3.2 s", {"Retry-After": "1"})
    # non-streamed: nothing was sent yet even after two tokens, so the retry starts over
    async with scripted([_chunk("x"), _chunk("y"), lost, _chunk("ab"), _chunk("cd", True)]) as c:
        r = await c.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abcd"
    assert r.json()["usage"]["completion_tokens"] == 4  # the failed attempt's tokens are not counted
    again = InstanceLost("prefill", "prefill-1", "no load report for 3.2 s", {"Retry-After": "1"})
    async with scripted([], starts=[lost, again]) as c:  # the retry fails too: 503, never a third try
        r = await c.post("/v1/completions", json=BODY)
    assert r.status_code == 503 and r.json()["error"] == {
        "message": "the prefill instance serving this request became unavailable", "type": "server_error",
        "param": None, "code": "service_unavailable"}
    assert r.headers["retry-after"] == "1"


async def test_a_lost_instance_mid_stream_is_a_service_unavailable_event_not_a_retry(scripted):
    from services.router.dispatch import InstanceLost

    lost = InstanceLost("decode", "decode-0", "no load report for 3.1 s", {"Retry-After": "5"})
    async with scripted([_chunk("a"), lost, _chunk("never")]) as c:
        r = await c.post("/v1/completions", json={**BODY, "stream": True})
    events = _events(r.text)
    assert r.status_code == 200 and events[0]["choices"][0]["text"] == "a"
    assert events[1]["error"]["code"] == "service_unavailable" and events[2:] == ["[DONE]"]


# ---- Part 2: the real system ------------------------------------------------------------------------
PROMPTS = [f"def handler_{i}(request):\n    return" for i in range(4)]
MAX_TOKENS = 12
BOUND_S = 8.0  # the 5 s, with room for a loaded box; the measured times are printed


@pytest.fixture(scope="module")
def system(tmp_path_factory, tiny):
    from shared.config import load_config
    from infra.up import UpConfig, launched
    from tests.natsbus import nats_url

    run_dir = tmp_path_factory.mktemp("failfast")
    with nats_url() as url:
        cfg = load_config(UpConfig, overrides=[
            "up.model=tiny", "up.port=0", f"up.nats_url={url}", f"up.run_dir={run_dir}",
            "up.pool=false", "up.prefills=2", "up.ready_timeout_s=120",
            "decode.engine.num_blocks=1024", "prefill.engine.num_blocks=512",
            "router.router.routing=p2c",
            "router.router.liveness_timeout_s=3",  # the stall backstop, short: SIGSTOP below tests it
            # what is killed stays dead here (no restart by `moorage up`, where the launcher supervises)
            *(["up.restart=no"] if "restart" in {f.name for f in dataclasses.fields(UpConfig().up)} else []),
        ])
        with launched(cfg) as (launcher, base):
            yield launcher, base, url


def reference(tiny, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    from shared.engine.engine import Engine, EngineConfig
    from shared.engine.sampling import SamplingParams

    engine = Engine(tiny, EngineConfig(num_blocks=256, enable_prefix_cache=False))
    [seq] = engine.generate([tiny.tokenizer.encode(prompt)], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return seq.output_text


def metric(base: str, name: str, **labels) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


async def completions(base: str, prompts: list[str], stream: bool = False) -> list[tuple[int, str, float]]:
    """(status, text, seconds) per prompt, sent at once."""
    async def one(prompt: str):
        t0 = time.monotonic()
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        async with httpx.AsyncClient(timeout=60) as h:
            if not stream:
                r = await h.post(base + "/v1/completions", json=body)
                text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
                return r.status_code, text, time.monotonic() - t0
            async with h.stream("POST", base + "/v1/completions", json=body) as r:
                parts = []
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        parts.append(event["choices"][0]["text"] if "choices" in event else json.dumps(event))
                return r.status_code, "".join(parts), time.monotonic() - t0
    return await asyncio.gather(*(one(p) for p in prompts))


def _pid(launcher, instance: str) -> int:
    return launcher.procs[instance].pid


def test_a_frozen_then_killed_prefill_costs_a_retry_not_a_request(system, tiny):
    """SIGSTOP prefill-0: requests it took are ended by the liveness watch (its reports stop) and retried
    on prefill-1. Then kill -9 it: the launcher announces the exit (InstanceExited), the router takes it out
    of the routing table within a second (silence alone would take instance_timeout_s), and requests sent
    then all go to prefill-1. Every answer equals the greedy reference."""
    launcher, base, _ = system
    want = {p: reference(tiny, p) for p in PROMPTS}
    before = metric(base, "moorage_router_retries_total", role="prefill")
    os.kill(_pid(launcher, "prefill-0"), signal.SIGSTOP)
    try:
        results = asyncio.run(completions(base, PROMPTS))  # p2c spreads them over both prefills
    finally:
        os.kill(_pid(launcher, "prefill-0"), signal.SIGCONT)
    assert [(s, t) for s, t, _ in results] == [(200, want[p]) for p in PROMPTS]
    frozen_retries = metric(base, "moorage_router_retries_total", role="prefill") - before
    assert frozen_retries >= 1
    print(f"\nprefill SIGSTOP: {frozen_retries:.0f} of {len(PROMPTS)} retried; seconds per request "
          f"{[round(d, 2) for _, _, d in results]}")

    deadline = time.monotonic() + 20  # prefill-0 reports again and takes requests (its backlog cancelled)
    while time.monotonic() < deadline:
        health = httpx.get(base + "/health", timeout=5).json()
        if "prefill-0" in health.get("ready", {}).get("prefill", []):
            break
        time.sleep(0.2)
    before = metric(base, "moorage_router_retries_total", role="prefill")
    killed = time.monotonic()
    os.kill(_pid(launcher, "prefill-0"), signal.SIGKILL)
    while "prefill-0" in httpx.get(base + "/health", timeout=5).json().get("ready", {}).get("prefill", []):
        assert time.monotonic() - killed < 1.0, "the router still routes to a prefill killed a second ago"
        time.sleep(0.01)
    out_of_table_s = time.monotonic() - killed
    results = asyncio.run(completions(base, PROMPTS, stream=True))
    assert [(s, t) for s, t, _ in results] == [(200, want[p]) for p in PROMPTS]
    killed_retries = metric(base, "moorage_router_retries_total", role="prefill") - before
    assert killed_retries == 0  # nothing was sent to the dead instance
    print(f"prefill kill -9: out of the routing table after {out_of_table_s * 1e3:.0f} ms; seconds per request "
          f"{[round(d, 2) for _, _, d in results]}")


def _gate_idle(nats: str) -> dict:
    from tests.natsbus import latest_reports

    deadline = time.monotonic() + 20
    while True:
        seen = asyncio.run(latest_reports(nats, seconds=1.1,
                                          enough=lambda s: any(r.role == "gate" for r in s.values())))
        gate = next(r for r in seen.values() if r.role == "gate")
        if (gate.detail["reservations"] == 0 and gate.detail["waiting"] == 0) or time.monotonic() > deadline:
            return gate.detail


def test_decode_killed_mid_stream_ends_the_stream_with_an_error_event_and_done(system):
    launcher, base, nats = system
    body = {"model": "tiny", "prompt": "stream for a long time", "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0}
    non_stream: dict = {}

    def post_non_stream() -> None:  # in flight at the kill too: nothing sent yet, no other decode: 503
        r = httpx.post(base + "/v1/completions", json={**body, "prompt": "collect for a long time"}, timeout=60)
        non_stream.update(status=r.status_code, body=r.json(), headers=r.headers, at=time.monotonic())

    worker = threading.Thread(target=post_non_stream)
    events: list = []
    with httpx.Client(timeout=60) as h, h.stream("POST", base + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 5:
                    break
        worker.start()
        time.sleep(0.5)  # the non-streamed one is admitted and generating
        killed = time.monotonic()
        os.kill(_pid(launcher, "decode-0"), signal.SIGKILL)
        for line in lines:
            if line.startswith("data: "):
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
        ended = time.monotonic()
    worker.join(60)
    stream_s, non_stream_s = ended - killed, non_stream["at"] - killed
    print(f"\ndecode kill -9: stream ended {stream_s:.2f} s after the kill, "
          f"non-streamed answered {non_stream_s:.2f} s after it")
    assert events[-1] == "[DONE]"
    error = events[-2]
    assert set(error) == {"error"} and set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["code"] == "service_unavailable" and error["error"]["type"] == "server_error"
    assert "nats" not in error["error"]["message"]
    assert all("choices" in e for e in events[:-2])  # tokens, then exactly one error event
    assert stream_s < BOUND_S
    assert non_stream["status"] == 503 and non_stream["body"]["error"]["code"] == "service_unavailable"
    assert int(non_stream["headers"]["retry-after"]) >= 1 and non_stream_s < BOUND_S
    detail = _gate_idle(nats)  # every admission released exactly once: nothing held, nothing twice
    assert detail["reservations"] == 0 and all(v == 0 for v in detail["reserved_tokens"].values())
    assert detail["release_duplicate"] == 0 and detail["release_unknown"] == 0
    assert detail["admitted"] == detail["released"] + detail["expired"]


def test_with_no_decode_alive_the_503_comes_at_once(system):
    """Runs after the decode was killed: once it is known gone, stream or not, a 503 at once."""
    launcher, base, nats = system
    deadline = time.monotonic() + 20
    while "decode" not in httpx.get(base + "/health", timeout=5).json().get("missing", []):
        assert time.monotonic() < deadline, "the router never noticed decode-0 was gone"
        time.sleep(0.2)
    for stream in (False, True):
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "anyone there?", "max_tokens": 8, "stream": stream})
        took = time.monotonic() - t0
        print(f"\nno decode, stream={stream}: {r.status_code} in {took * 1000:.0f} ms, "
              f"Retry-After {r.headers.get('retry-after')}")
        assert r.status_code == 503 and r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["code"] == "service_unavailable" and int(r.headers["retry-after"]) >= 1
        assert took < 3.0

    async def ask_gate(rid: str):  # the gate itself answers at once too, with a Retry-After of its own
        from shared.bus import Bus, BusConfig
        from shared.messages import AdmitReply, AdmitRequest, Release

        bus = await Bus.connect(BusConfig(url=nats), "test-failfast")
        try:
            t0 = time.monotonic()
            reply = await bus.request(bus.subjects.gate_admit, AdmitRequest(rid, 10, 10), AdmitReply, timeout=10)
            took = time.monotonic() - t0
            if reply.status == "admitted":  # the gate still counted decode-0 live: give it back
                await bus.publish(bus.subjects.gate_release, Release(rid, "probe"))
            return reply, took
        finally:
            await bus.close()

    deadline, n = time.monotonic() + 20, 0
    while True:
        n += 1
        reply, took = asyncio.run(ask_gate(f"probe-no-decode-{n}"))
        if reply.status == "unavailable" or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # the gate may still count decode-0 live for its instance_timeout_s
    assert reply.status == "unavailable" and took < 3.0 and reply.retry_after_s >= 1
