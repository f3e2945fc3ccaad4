"""The router's HTTP behaviour, served for real (`python -m services.router`, model `tiny`) on a real
nats-server, with FAKE gate / prefill / decode responders on the bus (a thread with its own loop).

The fakes stand in for the services so that every path of the router can be driven: what the prefill
"generates" is chosen by a marker in the prompt ([slow], [silent], [err-first], [err-mid], [nack]); the
gate's answer by `fake.gate_mode`. End-to-end tests with the real services live elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from shared.bus import Bus, BusConfig
from shared.engine.sampling import SamplingParams, TokenLogprob
from shared.engine.tokenizer import ByteTokenizer
from shared.messages import (Ack, AdmitReply, AdmitRequest, Cancel, LoadReport, PrefillSubmit, Release, SessionClose,
                             SessionTurn, TokenChunk)
from infra.natsd import start_nats_server
from shared.sockets import free_port
from shared.tracing import read_spans

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-test"
REQUEST_TIMEOUT_S = 2.0
TOK = ByteTokenizer()
USER = [{"role": "user", "content": "hello there"}]


def wait_for(cond, timeout: float = 5.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


class FakeCluster:
    """Fake gate, two prefill instances (which also play decode: they stream every TokenChunk) and a
    decode load reporter, on the real bus. Everything they receive is recorded."""

    PREFILLS = ("prefill-0", "prefill-1")

    def __init__(self, url: str, prefix: str):
        self.url, self.prefix = url, prefix
        self.admits: list[tuple[AdmitRequest, dict]] = []
        self.submits: list[tuple[str, PrefillSubmit, dict]] = []
        self.releases: list[Release] = []
        self.cancels: list[Cancel] = []
        self.closes: list[SessionClose] = []
        self.turns: list[SessionTurn] = []
        self.gate_mode = "admit"     # admit | reject | nodecode | invalid | hold
        self.reporting = False
        self.ready = {"gate": True, "prefill": True, "decode": True}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._tasks: set[asyncio.Task] = set()

    def call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> "FakeCluster":
        self.thread.start()
        try:
            self.call(self._setup())
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise
        return self

    def stop(self) -> None:
        try:
            self.call(self._teardown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)
            self.loop.close()

    async def _setup(self) -> None:
        self.bus = bus = await Bus.connect(BusConfig(url=self.url, prefix=self.prefix), "fake-cluster")
        s = bus.subjects
        await bus.subscribe(s.gate_admit, AdmitRequest, self._admit)
        await bus.subscribe(s.gate_release, Release, self._record(self.releases))
        await bus.subscribe(s.cancel_all, Cancel, self._record(self.cancels))
        await bus.subscribe(s.session_close, SessionClose, self._record(self.closes))
        await bus.subscribe(s.session_turn, SessionTurn, self._record(self.turns))
        for name in self.PREFILLS:
            await bus.subscribe(s.prefill_submit(name), PrefillSubmit, self._submit_handler(name))
        self._spawn(self._report_loop())
        await bus.nc.flush()
        await bus.nc.flush()  # nats-py: one flush's PING can overtake buffered SUBs; a second cannot

    async def _teardown(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.bus.close()

    def _spawn(self, coro) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _record(self, into: list):
        async def handler(msg, _raw):
            into.append(msg)
        return handler

    async def _report_loop(self) -> None:
        s = self.bus.subjects
        while True:
            if self.reporting:
                reports = [LoadReport("gate-0", "gate", self.ready["gate"]),
                           LoadReport("decode-0", "decode", self.ready["decode"], capacity_tokens=100_000,
                                      free_tokens=100_000)]
                reports += [LoadReport(p, "prefill", self.ready["prefill"]) for p in self.PREFILLS]
                for r in reports:
                    await self.bus.publish(s.load(r.role, r.instance), r)
            await asyncio.sleep(0.1)

    async def _admit(self, msg: AdmitRequest, raw) -> AdmitReply | None:
        self.admits.append((msg, dict(raw.headers or {})))
        rid, mode = msg.request_id, self.gate_mode
        if mode == "hold":
            return None  # never answers: the router's admission timeout (or the client) ends it
        if mode == "reject":
            return AdmitReply(rid, "rejected", reason="over budget after 30 s", retry_after_s=2.5, waited_ms=30)
        if mode == "nodecode":
            return AdmitReply(rid, "unavailable", reason="no decode instance available", retry_after_s=0.2)
        if mode == "invalid":
            return AdmitReply(rid, "invalid", reason="prompt + max_tokens exceed the context length of decode-0")
        return AdmitReply(rid, "admitted", decode_instance="decode-0", waited_ms=1.5)

    def _submit_handler(self, name: str):
        async def handler(msg: PrefillSubmit, raw) -> Ack:
            self.submits.append((name, msg, dict(raw.headers or {})))
            text = TOK.decode(msg.prompt_ids)
            if "[nack]" in text:
                return Ack(msg.request_id, False, "prefill queue full")
            self._spawn(self._generate(msg, text))
            return Ack(msg.request_id, True)
        return handler

    async def _generate(self, msg: PrefillSubmit, text: str) -> None:
        rid, out = msg.request_id, self.bus.subjects.request_out(msg.request_id)
        n = len(msg.prompt_ids)
        usage = {"prompt_tokens": n, "completion_tokens": 0, "total_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": 12}, "moorage": {"device": 4, "store": 8,
                                                                               "computed": n - 12}}

        async def send(ids, piece, finished=False, reason=None, error=None):
            u = None
            if finished and error is None:
                u = {**usage, "completion_tokens": sent + len(ids), "total_tokens": n + sent + len(ids)}
            k = msg.sampling.logprobs  # made-up numbers: the i-th token -0.5 - i/10, alternatives 7, 8, ... below
            lps = None if k is None or not ids else [
                TokenLogprob(-0.5 - sent / 10, tuple([(ids[0], -0.5 - sent / 10)] + [(7 + j, -3.0 - j) for j in
                                                                                       range(k - 1)])[:k])]
            await self.bus.publish(out, TokenChunk(rid, ids, piece, finished, reason, u, error, logprobs=lps))

        sent = 0
        if "[silent]" in text:
            return
        if "[err-first]" in text:
            await send([], "", True, error={"status": 503, "type": "server_error", "message": "decode lost"})
            return
        pieces = ["Hello", " world", "!"]
        if "[call]" in text:  # moorage's own (Hermes) call format: tiny's template has no tools
            pieces = ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>']
        if "[slow]" in text:
            pieces = ["x"] * 100
        limit = msg.sampling.max_tokens
        for i, piece in enumerate(pieces[:limit]):
            if any(c.request_id == rid for c in self.cancels):
                return
            if "[err-mid]" in text and i == 2:
                await send([], "", True, error={"status": 500, "type": "server_error", "message": "oops"})
                return
            last = i == min(len(pieces), limit) - 1
            await send([100 + i], piece, last, ("length" if limit < len(pieces) else "stop") if last else None)
            sent += 1
            if "[slow]" in text:
                await asyncio.sleep(0.03)

    def count(self, kind: str, rid: str) -> int:
        items = {"release": self.releases, "cancel": self.cancels}[kind]
        return sum(1 for m in items if m.request_id == rid)

    def submit_of(self, rid: str):
        return next((name, m, h) for name, m, h in self.submits if m.request_id == rid)

    def admit_of(self, rid: str) -> AdmitRequest:
        return next(m for m, _ in self.admits if m.request_id == rid)


def _start_router(url: str, prefix: str, port: int, log, traces: Path, *extra: str) -> subprocess.Popen:
    sets = [*extra, f"bus.url={url}", f"bus.prefix={prefix}", f"router.port={port}", "router.model=tiny",
            "tracing.exporter=jsonl", f"tracing.path={traces}", f"router.api_keys={KEY}",
            "router.instance_timeout_s=1.0", f"router.request_timeout_s={REQUEST_TIMEOUT_S}",
            "router.admission_timeout_s=2.0", "router.max_request_tokens=4096", "load_interval_s=0.5"]
    return subprocess.Popen(
        [sys.executable, "-m", "services.router", *[a for kv in sets for a in ("--set", kv)]],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OTEL_BSP_SCHEDULE_DELAY": "100"})  # spans flushed fast


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def cluster():
    with contextlib.ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="moorage-router-test-"))
        if not os.environ.get("KEEP_ROUTER_LOG"):
            stack.callback(shutil.rmtree, tmp, True)
        url = os.environ.get("NATS_URL")
        if not url:
            nats = start_nats_server()
            stack.callback(nats.stop)
            url = nats.url
        prefix = "t" + uuid.uuid4().hex[:10]  # a shared NATS_URL server never mixes test runs
        fake = FakeCluster(url, prefix).start()
        stack.callback(fake.stop)
        port, log_path, traces = free_port(), tmp / "router.log", tmp / "spans.jsonl"
        log = stack.enter_context(open(log_path, "wb"))
        proc = _start_router(url, prefix, port, log, traces)
        stack.callback(_stop, proc)
        base = f"http://127.0.0.1:{port}"

        def up():
            if proc.poll() is not None:
                raise RuntimeError(f"router exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                return httpx.get(f"{base}/health", timeout=1.0)
            except httpx.TransportError:
                return None

        first_health = wait_for(up, timeout=60, interval=0.1)
        fake.reporting = True
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, timeout=5)
        yield {"base": base, "fake": fake, "first_health": first_health, "log": log_path, "traces": traces,
               "url": url, "prefix": prefix, "tmp": tmp}


@pytest.fixture
def fake(cluster) -> FakeCluster:
    fake = cluster["fake"]
    fake.gate_mode = "admit"
    yield fake
    fake.gate_mode = "admit"
    fake.ready.update(gate=True, prefill=True, decode=True)


@pytest.fixture
def client(cluster) -> openai.OpenAI:
    with openai.OpenAI(api_key=KEY, base_url=cluster["base"] + "/v1", max_retries=0, timeout=10) as c:
        yield c


@pytest.fixture
def http(cluster) -> httpx.Client:
    with httpx.Client(base_url=cluster["base"], headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as c:
        yield c


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


# ---- health, models, auth ------------------------------------------------------------------------
def test_health_503_until_every_role_reports_then_200(cluster, fake):
    first = cluster["first_health"]
    assert first.status_code == 503
    assert set(first.json()["missing"]) == {"gate", "prefill", "decode"}
    base = cluster["base"]
    assert httpx.get(f"{base}/health").json()["status"] == "ok"
    fake.ready["prefill"] = False
    resp = wait_for(lambda: (r := httpx.get(f"{base}/health")).status_code == 503 and r)
    assert resp.json()["missing"] == ["prefill"]
    fake.ready["prefill"] = True
    wait_for(lambda: httpx.get(f"{base}/health").status_code == 200)


def test_models_and_api_key(cluster, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with openai.OpenAI(api_key="wrong", base_url=cluster["base"] + "/v1", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    resp = httpx.post(cluster["base"] + "/v1/chat/completions", json={"model": "tiny", "messages": USER})
    assert assert_openai_error(resp, 401)["code"] == "invalid_api_key"


def test_missing_key_sends_nothing_on_the_bus(cluster, fake):
    before = len(fake.admits)
    resp = httpx.post(cluster["base"] + "/v1/completions", json={"model": "tiny", "prompt": "hi"},
                      headers={"Authorization": "Bearer nope"})
    assert_openai_error(resp, 401)
    assert len(fake.admits) == before


# ---- chat ------------------------------------------------------------------------------------------
def test_chat_non_streaming(client, fake):
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=USER, extra_headers={"X-Session-ID": "sess-A"})
    rid = raw.headers["x-request-id"]
    resp = raw.parse()
    assert resp.object == "chat.completion" and resp.id == "chatcmpl-" + rid.removeprefix("req-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == "Hello world!"
    assert resp.choices[0].finish_reason == "stop"
    prompt_ids = TOK.chat_token_ids(USER)
    u = resp.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (len(prompt_ids), 3, len(prompt_ids) + 3)
    assert u.prompt_tokens_details.cached_tokens == 12
    assert u.model_extra["moorage"] == {"device": 4, "store": 8, "computed": len(prompt_ids) - 12}
    _, submit, _ = fake.submit_of(rid)
    assert submit.prompt_ids == prompt_ids and submit.session_id == "sess-A"
    assert submit.decode_instance == "decode-0"
    s = submit.sampling
    assert s.max_tokens == 512 and s.temperature == 1.0 and isinstance(s.seed, int)  # seed fixed
    assert s.stop == () and s.ignore_eos is False
    admit = next(a for a, _ in fake.admits if a.request_id == rid)
    assert (admit.prompt_tokens, admit.max_tokens) == (len(prompt_ids), 512)
    wait_for(lambda: fake.count("release", rid) == 1)
    time.sleep(0.1)
    assert fake.count("release", rid) == 1 and fake.count("cancel", rid) == 0


def test_chat_streaming_with_usage(client, fake):
    stream = client.chat.completions.create(model="tiny", messages=USER, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello world!"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_without_usage_ends_with_done(http):
    with http.stream("POST", "/v1/chat/completions",
                     json={"model": "tiny", "messages": USER, "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])


def test_chat_parameters_reach_the_prefill(client, fake):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "two"}]}]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_completion_tokens=2, temperature=0, top_p=0.5,
        stop=["END", "STOP"], extra_body={"ignore_eos": True, "some_future_field": {"x": 1}},
        extra_headers={"X-Correlation-ID": "corr-1"})
    resp = raw.parse()
    assert resp.choices[0].message.content == "Hello world" and resp.choices[0].finish_reason == "length"
    _, submit, _ = fake.submit_of(raw.headers["x-request-id"])
    flat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "part one, two"}]
    assert submit.prompt_ids == TOK.chat_token_ids(flat) and submit.session_id == "corr-1"
    assert submit.sampling == SamplingParams(max_tokens=2, temperature=0.0, top_p=0.5, seed=None,
                                             stop=("END", "STOP"), ignore_eos=True)
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=USER, max_tokens=7, seed=123,
                                                           stop="x", temperature=0.7)
    _, submit, _ = fake.submit_of(raw.headers["x-request-id"])
    assert submit.sampling.seed == 123 and submit.sampling.max_tokens == 7 and submit.sampling.stop == ("x",)


@pytest.mark.parametrize("extra_body, headers, want", [
    ({}, {}, (0, 0.0, 0)),
    ({"priority": -2}, {}, (2, 0.0, 0)),                                            # vLLM's: lower first
    ({"nvext": {"agent_hints": {"priority": 3, "latency_sensitivity": 1.5, "osl": 64}}}, {}, (3, 1.5, 64)),  # Dynamo's
    ({"priority": 5, "nvext": {"agent_hints": {"priority": 1}}}, {}, (1, 0.0, 0)),  # Dynamo's over vLLM's
    ({"nvext": {"agent_hints": {"priority": 1, "latency_sensitivity": 2.0, "osl": 9}}}, {"x-request-priority": "-4"},
     (-4, 2.0, 9)),
])
def test_agent_hints_reach_the_gate_and_the_prefill(client, fake, extra_body, headers, want):
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=USER, max_tokens=2,
                                                           extra_body=extra_body, extra_headers=headers)
    rid = raw.headers["x-request-id"]
    admit, (_, submit, _) = wait_for(lambda: fake.admit_of(rid)), fake.submit_of(rid)
    assert (admit.priority, admit.latency_s, admit.osl) == want and submit.priority == want[0]


def test_a_session_s_next_turn_prefers_the_decode_that_served_its_last(client, fake):
    """That decode keeps the session's prompt blocks (decode reuse): the gate is asked to prefer it."""
    rids = []
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=USER, max_tokens=2,
                                                               extra_headers={"X-Session-ID": "agent-9"})
        rids.append(raw.headers["x-request-id"])
    first, second = (wait_for(lambda r=r: fake.admit_of(r)) for r in rids)
    assert first.prefer_decode == "" and second.prefer_decode == "decode-0"
    # no header: the session is the conversation's (router/conversation.py), new here, so no decode yet
    fresh = [{"role": "user", "content": "a conversation no earlier test had"}]
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=fresh, max_tokens=2)
    assert wait_for(lambda: fake.admit_of(raw.headers["x-request-id"])).prefer_decode == ""


@pytest.mark.parametrize("extra_body, headers, param", [
    ({"nvext": {"agent_hints": {"priority": 11}}}, {}, "nvext.agent_hints.priority"),  # above max_priority 10
    ({"priority": -11}, {}, "priority"),                                               # 11, said vLLM's way
    ({}, {"x-request-priority": "11"}, "x-request-priority"),
    ({}, {"x-request-priority": "high"}, "x-request-priority"),
    ({"priority": "high"}, {}, "priority"),
    ({"nvext": {"agent_hints": {"latency_sensitivity": -1}}}, {}, "nvext.agent_hints.latency_sensitivity"),
    ({"nvext": {"agent_hints": {"latency_sensitivity": 21}}}, {}, "nvext.agent_hints.latency_sensitivity"),  # > 10 x 2 s
    ({"nvext": {"agent_hints": {"osl": 0}}}, {}, "nvext.agent_hints.osl"),
    ({"nvext": {"agent_hints": {"osl": "long"}}}, {}, "nvext.agent_hints.osl"),
])
def test_bad_or_disallowed_hints_are_a_400_naming_the_field(http, fake, extra_body, headers, param):
    before = (len(fake.admits), len(fake.submits))
    resp = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, **extra_body}, headers=headers)
    assert assert_openai_error(resp, 400)["param"] == param
    time.sleep(0.05)
    assert (len(fake.admits), len(fake.submits)) == before


def test_a_session_is_closed_by_delete_or_by_its_last_request(client, http, fake):
    r = http.delete("/v1/sessions/agent-7/sub-2")
    assert r.status_code == 200 and r.json() == {"id": "agent-7/sub-2", "object": "session", "closed": True}
    wait_for(lambda: any(m.session_id == "agent-7/sub-2" for m in fake.closes))
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=USER, max_tokens=2, extra_headers={"X-Session-ID": "sub-3"},
        extra_body={"nvext": {"session_control": {"action": "close"}}})
    assert raw.parse().choices[0].message.content
    close = wait_for(lambda: next((m for m in fake.closes if m.session_id == "sub-3"), None))
    assert close.tenant == ""
    n = len(fake.closes)
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, extra_headers={"X-Session-ID": "sub-4"},
                                   extra_body={"nvext": {"session_control": {"action": "open"}}})
    time.sleep(0.1)
    assert len(fake.closes) == n  # "open" closes nothing
    bad = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER,
                                                  "nvext": {"session_control": {"action": "delete"}}})
    assert assert_openai_error(bad, 400)["param"] == "nvext.session_control.action"


def test_each_answered_turn_says_whether_its_session_comes_back(client, fake):
    """A final answer: not expected back (its KV is the first to go everywhere); a tool call: expected back."""
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=3, extra_headers={"X-Session-ID": "turn-a"})
    turn = wait_for(lambda: next((m for m in fake.turns if m.session_id == "turn-a"), None))
    assert turn.expected_back is False and turn.tenant == ""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "[call] weather?"}],
                                       tools=[weather], max_tokens=64, extra_headers={"X-Session-ID": "turn-b"})
    assert r.choices[0].finish_reason == "tool_calls"
    assert wait_for(lambda: next((m for m in fake.turns if m.session_id == "turn-b"), None)).expected_back is True
    n = len(fake.turns)
    client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, extra_headers={"X-Session-ID": "turn-c"},
                                   extra_body={"nvext": {"session_control": {"action": "close"}}})
    wait_for(lambda: any(m.session_id == "turn-c" for m in fake.closes))
    assert len(fake.turns) == n  # closed, not paused


def test_same_session_sticks_to_one_prefill(client, fake):
    owners = set()
    for _ in range(6):
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=USER,
                                                               extra_headers={"X-Session-ID": "sticky-1"})
        owners.add(fake.submit_of(raw.headers["x-request-id"])[0])
    assert len(owners) == 1


def test_trace_context_rides_the_bus_and_the_span_says_what_happened(cluster, client, fake):
    client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=USER, max_tokens=9, extra_headers={
            "X-Session-ID": "traced", "traceparent": f"00-{client_trace}-00f067aa0ba902b7-01"})
    rid = raw.headers["x-request-id"]
    admit_headers = next(h for a, h in fake.admits if a.request_id == rid)
    _, _, submit_headers = fake.submit_of(rid)
    assert {h["traceparent"].split("-")[1] for h in (admit_headers, submit_headers)} == {client_trace}
    span = wait_for(lambda: next((s for s in read_spans(cluster["traces"]) if s["name"] == "router.request"
                                  and s["attributes"].get("request_id") == rid), None))
    assert span["trace_id"] == client_trace and span["kind"] == "SERVER"
    a = span["attributes"]
    prompt = len(TOK.chat_token_ids(USER))
    assert (a["session_id"], a["prompt_tokens"], a["max_tokens"], a["stream"]) == ("traced", prompt, 9, False)
    assert (a["status"], a["completion_tokens"], a["cached_tokens"]) == (200, 3, 12) and a["ttft_ms"] > 0


# ---- completions ---------------------------------------------------------------------------------
def test_completions_string_and_token_ids(client, fake):
    resp = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=5)
    assert resp.object == "text_completion" and resp.choices[0].text == "Hello world!"
    assert resp.usage.prompt_tokens == len(TOK.encode("def f(x):"))
    raw = client.completions.with_raw_response.create(model="tiny", prompt=[10, 20, 30], max_tokens=5)
    assert raw.parse().usage.prompt_tokens == 3
    assert fake.submit_of(raw.headers["x-request-id"])[1].prompt_ids == [10, 20, 30]


def test_completions_streaming(client):
    chunks = list(client.completions.create(model="tiny", prompt="abc", stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello world!"
    assert chunks[-1].usage.total_tokens == 3 + 3


# ---- bad requests: 4xx, OpenAI-shaped, and nothing on the bus --------------------------------------
CHAT, COMPL = "/v1/chat/completions", "/v1/completions"
BAD = [
    (CHAT, b"{not json", 400),
    (CHAT, b"[1, 2]", 400),
    (CHAT, b"", 400),
    (CHAT, {"model": "tiny"}, 400),
    (CHAT, {"model": "tiny", "messages": []}, 400),
    (CHAT, {"model": "tiny", "messages": "hi"}, 400),
    (CHAT, {"model": "tiny", "messages": [{"content": "no role"}]}, 400),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    (CHAT, {"model": "tiny", "messages": USER, "max_tokens": 0}, 400),
    (CHAT, {"model": "tiny", "messages": USER, "max_tokens": -5}, 400),
    (CHAT, {"model": "tiny", "messages": USER, "max_tokens": "5"}, 400),
    (CHAT, {"model": "tiny", "messages": USER, "max_completion_tokens": 0}, 400),
    (CHAT, {"model": "tiny", "messages": USER, "temperature": -0.1}, 400),
    (CHAT, {"model": "tiny", "messages": USER, "temperature": 2.5}, 400),
    (CHAT, {"model": "tiny", "messages": USER, "temperature": "hot"}, 400),
    (CHAT, {"model": "tiny", "messages": USER, "top_p": 0}, 400),
    (CHAT, {"model": "tiny", "messages": USER, "top_p": 1.5}, 400),
    (CHAT, {"model": "tiny", "messages": USER, "n": 2}, 400),
    (CHAT, {"model": "tiny", "messages": USER, "stop": ""}, 400),
    (CHAT, {"model": "tiny", "messages": USER, "stop": [1]}, 400),
    (CHAT, {"model": "tiny", "messages": USER, "stream": "yes"}, 400),
    (CHAT, {"model": "tiny", "messages": USER, "seed": 1.5}, 400),
    (CHAT, {"model": "tiny", "messages": USER, "stream_options": {"include_usage": "y"}}, 400),
    (CHAT, {"model": 7, "messages": USER}, 400),
    (CHAT, {"model": "gpt-4", "messages": USER}, 404),
    (CHAT, {"model": "tiny", "messages": USER, "max_tokens": 10_000}, 400),  # context length
    (COMPL, {"model": "tiny", "prompt": ""}, 400),
    (COMPL, {"model": "tiny", "prompt": []}, 400),
    (COMPL, {"model": "tiny", "prompt": [1, 99999]}, 400),
    (COMPL, {"model": "tiny", "prompt": ["a", "b"]}, 400),
    (COMPL, {"model": "tiny", "prompt": {"x": 1}}, 400),
    (COMPL, {"model": "tiny", "prompt": "x" * 4096}, 400),                   # context length
    (COMPL, {"model": "nope", "prompt": "x"}, 404),
]


@pytest.mark.parametrize("path,body,status", BAD,
                         ids=[f"{i}-{p.rsplit('/', 1)[1]}-{s}" for i, (p, _, s) in enumerate(BAD)])
def test_bad_requests_are_rejected_without_bus_traffic(http, fake, path, body, status):
    before = (len(fake.admits), len(fake.submits), len(fake.releases), len(fake.cancels))
    if isinstance(body, bytes):
        resp = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        resp = http.post(path, json=body)
    err = assert_openai_error(resp, status)
    if status == 404:
        assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
    time.sleep(0.05)
    assert (len(fake.admits), len(fake.submits), len(fake.releases), len(fake.cancels)) == before


# ---- degenerate sampling values (issue 10): a 400 naming the field, or served greedily ----------------
PROBE = {"model": "tiny", "prompt": "x", "max_tokens": 4}


def test_tiny_temperature_is_served_greedily(http, fake):
    """(temperature 0.5, top_p 1e-300 is served too: test_e2e runs it through the real sampler.)"""
    resp = http.post(COMPL, json={**PROBE, "temperature": 1e-300})
    assert resp.status_code == 200, resp.text
    _, submit, _ = fake.submit_of(resp.headers["x-request-id"])
    assert submit.sampling.greedy  # as prefill and decode read it


@pytest.mark.parametrize("field,literal", [("temperature", b"NaN"), ("temperature", b"Infinity"),
                                           ("top_p", b"NaN"), ("top_p", b"-Infinity")])
def test_non_finite_sampling_values_are_a_400_naming_the_field(http, fake, field, literal):
    before = len(fake.admits)
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 4, "%s": %s}' % (field.encode(), literal)
    err = assert_openai_error(http.post(COMPL, content=body, headers={"Content-Type": "application/json"}), 400)
    assert err["param"] == field and "finite" in err["message"]
    assert len(fake.admits) == before
    assert http.post(COMPL, json=PROBE).status_code == 200  # and the next request is served


def test_overlong_stop_sequence_is_a_400(http, fake):
    err = assert_openai_error(http.post(COMPL, json={**PROBE, "stop": ["ok", "x" * 1025]}), 400)
    assert err["param"] == "stop" and "1024 characters" in err["message"]
    assert http.post(COMPL, json={**PROBE, "stop": ["x" * 1024]}).status_code == 200


def test_context_length_message(client, fake):
    before = len(fake.admits)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "y" * 4000}],
                                       max_tokens=200)
    assert "context length" in e.value.message
    with pytest.raises(openai.BadRequestError, match="context length"):  # no room left even for 1 token
        client.completions.create(model="tiny", prompt="z" * 4096)
    assert len(fake.admits) == before


def test_unknown_route_and_method_are_openai_errors(http):
    assert_openai_error(http.get("/v1/nope"), 404)
    assert_openai_error(http.get("/v1/chat/completions"), 405)


# ---- admission ---------------------------------------------------------------------------------------
def test_gate_rejection_is_429_with_retry_after(client, http, fake):
    fake.gate_mode = "reject"
    resp = http.post(CHAT, json={"model": "tiny", "messages": USER, "stream": True})
    err = assert_openai_error(resp, 429)
    assert resp.headers["retry-after"] == "3" and "over budget" in err["message"]
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="tiny", messages=USER)
    assert int(e.value.response.headers["retry-after"]) >= 1
    assert not fake.submits or all(m.request_id != fake.admits[-1][0].request_id for _, m, _ in fake.submits)
    time.sleep(0.1)
    assert fake.count("release", fake.admits[-1][0].request_id) == 0  # nothing was reserved


def test_gate_without_decode_is_503_and_invalid_is_400(http, fake):
    fake.gate_mode = "nodecode"
    resp = http.post(COMPL, json={"model": "tiny", "prompt": "hi"})
    assert_openai_error(resp, 503)
    assert int(resp.headers["retry-after"]) >= 1
    fake.gate_mode = "invalid"
    err = assert_openai_error(http.post(COMPL, json={"model": "tiny", "prompt": "hi"}), 400)
    assert "context length" in err["message"]


def test_client_gone_while_queued_at_gate_releases(cluster, fake):
    fake.gate_mode = "hold"
    n = len(fake.admits)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster["base"] + COMPL, json={"model": "tiny", "prompt": "hi"}, timeout=0.5,
                   headers={"Authorization": f"Bearer {KEY}"})
    rid = wait_for(lambda: len(fake.admits) > n and fake.admits[n][0].request_id)
    wait_for(lambda: fake.count("release", rid) == 1)
    time.sleep(0.3)
    assert fake.count("release", rid) == 1 and fake.count("cancel", rid) == 0


# ---- failures after admission --------------------------------------------------------------------------
def test_error_before_first_token_is_an_http_error(http, fake):
    resp = http.post(CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "[err-first]"}],
                                 "stream": True})
    err = assert_openai_error(resp, 503)
    # a 503 from the engines (an instance on the path failed) before any token: retried once on the other
    # prefill under the attempt's own bus id, then a stable message (the engine's text stays in the log)
    assert err["code"] == "service_unavailable" and "decode lost" not in err["message"]
    (first, a, _), (second, b, _) = fake.submits[-2:]
    assert b.request_id == a.request_id + "-r1" and first != second
    for rid in (a.request_id, b.request_id):
        wait_for(lambda: fake.count("release", rid) == 1)
        assert fake.count("cancel", rid) == 0  # the final chunk came: nothing left to cancel


def test_error_mid_stream_is_one_error_event_then_done(http, fake):
    with http.stream("POST", CHAT, json={"model": "tiny", "stream": True,
                                         "messages": [{"role": "user", "content": "[err-mid]"}]}) as resp:
        assert resp.status_code == 200
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["error"]["message"] == "oops"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2]) == "Hello world"
    rid = resp.headers["x-request-id"]
    wait_for(lambda: fake.count("release", rid) == 1)


def test_error_mid_non_streaming_is_http_error(http):
    err = assert_openai_error(http.post(CHAT, json={"model": "tiny", "messages": [
        {"role": "user", "content": "[err-mid]"}]}), 500)
    assert err["type"] == "server_error"


def test_prefill_refusal_is_503_and_releases(http, fake):
    resp = http.post(COMPL, json={"model": "tiny", "prompt": "[nack]"})
    assert_openai_error(resp, 503)
    rid = fake.submits[-1][1].request_id
    wait_for(lambda: fake.count("release", rid) == 1)


def test_timeout_cancels_and_releases(http, fake):
    t0 = time.monotonic()
    resp = http.post(COMPL, json={"model": "tiny", "prompt": "[silent]"})
    assert_openai_error(resp, 504)
    assert REQUEST_TIMEOUT_S - 0.2 <= time.monotonic() - t0 < REQUEST_TIMEOUT_S + 2
    rid = fake.submits[-1][1].request_id
    wait_for(lambda: fake.count("release", rid) == 1 and fake.count("cancel", rid) == 1)


@pytest.mark.parametrize("stream_path", [CHAT, COMPL])
def test_client_disconnect_mid_stream_cancels_and_releases_once(cluster, fake, stream_path):
    body = {"model": "tiny", "stream": True}
    body.update({"messages": [{"role": "user", "content": "[slow]"}]} if stream_path == CHAT else {"prompt": "[slow]"})
    with httpx.Client(base_url=cluster["base"], headers={"Authorization": f"Bearer {KEY}"}) as c:
        with c.stream("POST", stream_path, json=body) as resp:
            assert resp.status_code == 200
            rid = resp.headers["x-request-id"]
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in got)
    wait_for(lambda: fake.count("cancel", rid) == 1 and fake.count("release", rid) == 1)
    time.sleep(0.5)
    assert fake.count("cancel", rid) == 1 and fake.count("release", rid) == 1


# ---- metrics -----------------------------------------------------------------------------------------
def test_metrics(cluster, client, http, fake):
    client.chat.completions.create(model="tiny", messages=USER)
    fake.gate_mode = "reject"
    http.post(COMPL, json={"model": "tiny", "prompt": "x"})
    text = httpx.get(cluster["base"] + "/metrics").text

    def value(name: str) -> float:
        return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
                    or line.startswith(name + "{") and line.split("} ")[0] + "}" == name)

    assert value('moorage_router_requests_total{endpoint="chat",status="200"}') >= 1
    assert value('moorage_router_requests_total{endpoint="completions",status="429"}') >= 1
    assert value('moorage_router_admission_rejections_total{reason="rejected"}') >= 1
    assert value('moorage_router_time_to_first_token_seconds_count{endpoint="chat"}') >= 1
    assert value('moorage_router_request_duration_seconds_count{endpoint="chat"}') >= 1
    assert value("moorage_router_prompt_tokens_total") > 0
    assert value("moorage_router_completion_tokens_total") >= 3
    assert value('moorage_router_cached_tokens_total{source="store"}') >= 8
    assert value("moorage_router_in_flight_requests") == 0


# ---- shutdown --------------------------------------------------------------------------------------------
def test_sigterm_ends_open_streams_with_cancel_and_release_then_exits_0(cluster, fake):
    port, log_path = free_port(), cluster["tmp"] / "router2.log"
    with open(log_path, "wb") as log:
        proc = _start_router(cluster["url"], cluster["prefix"], port, log, cluster["tmp"] / "spans2.jsonl",
                             "router.graceful_shutdown_s=0.3", "instance=router-1")
        try:
            base = f"http://127.0.0.1:{port}"
            wait_for(lambda: proc.poll() is None and _get_ok(f"{base}/health"), timeout=60, interval=0.1)
            with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}) as c:
                with c.stream("POST", COMPL, json={"model": "tiny", "prompt": "[slow]", "stream": True}) as resp:
                    rid = resp.headers["x-request-id"]
                    lines = resp.iter_lines()
                    next(lines)
                    proc.send_signal(signal.SIGTERM)
                    events = sse_events(lines)  # ended after graceful_shutdown_s with an error event
            assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]
            assert proc.wait(10) == 0, log_path.read_text()[-3000:]
        finally:
            _stop(proc)
    assert fake.count("cancel", rid) == 1 and fake.count("release", rid) == 1


def _get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.TransportError:
        return False


# ---- unsupported OpenAI features (issue 10): a 400 naming the field; neutral values accepted ----------
UNSUPPORTED = [  # tools, tool_choice and response_format are served since issue 27 (tests/test_tools.py)
    (CHAT, "functions", [{"name": "f"}]), (CHAT, "function_call", {"name": "f"}), (CHAT, "n", 2),
    (COMPL, "n", 3), (COMPL, "best_of", 2), (COMPL, "echo", True),
    (COMPL, "suffix", "}\n"),
]


@pytest.mark.parametrize("path,field,value", UNSUPPORTED,
                         ids=[f"{p.rsplit('/', 1)[1]}-{f}-{v!r:.20}" for p, f, v in UNSUPPORTED])
def test_unsupported_features_are_a_400_naming_the_field(http, fake, path, field, value):
    before = len(fake.admits)
    body = {"model": "tiny", "max_tokens": 4, **({"messages": USER} if path == CHAT else {"prompt": "x"}),
            field: value}
    err = assert_openai_error(http.post(path, json=body), 400)
    assert err["param"] == field and field in err["message"] and "not supported" in err["message"]
    assert err["type"] == "invalid_request_error"
    assert len(fake.admits) == before


def test_neutral_values_of_unsupported_features_are_served(http, fake):
    chat = {"model": "tiny", "messages": USER, "max_tokens": 4, "n": 1, "logprobs": False, "top_logprobs": None,
            "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "functions": None,
            "parallel_tool_calls": False}
    assert http.post(CHAT, json=chat).status_code == 200
    assert http.post(CHAT, json={**chat, "logprobs": None, "tool_choice": "auto"}).status_code == 200
    compl = {"model": "tiny", "prompt": "x", "max_tokens": 4, "n": 1, "logprobs": None, "echo": False,
             "best_of": 1, "suffix": None}
    assert http.post(COMPL, json=compl).status_code == 200
    assert http.post(COMPL, json={**compl, "logprobs": False, "suffix": ""}).status_code == 200


def test_logprobs_reach_the_prefill_and_come_back_shaped_per_api(client, fake):
    """Chat's logprobs + top_logprobs and completions' logprobs count travel as SamplingParams.logprobs; the
    numbers that come back with each token (the fake's) are shaped as OpenAI's: chat's content list (token, its
    bytes, top_logprobs), completions' four lists, streamed (spread over the chunks) and whole alike."""
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=USER, max_tokens=8,
                                                           logprobs=True, top_logprobs=2)
    r = raw.parse()
    assert fake.submit_of(raw.headers["x-request-id"])[1].sampling.logprobs == 2
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == "Hello world!"  # the fake's text; its tokens are ids 100, 101, 102
    assert [e.token for e in content] == ["d", "e", "f"]
    assert [e.logprob for e in content] == [-0.5, -0.6, -0.7]
    assert [bytes(e.bytes) for e in content] == [TOK.token_bytes(100 + i) for i in range(3)]
    assert [[(a.token, a.logprob) for a in e.top_logprobs] for e in content][0] == [
        (TOK.token_bytes(100).decode(), -0.5), (TOK.token_bytes(7).decode(), -3.0)]
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, logprobs=True,
                                                 top_logprobs=2, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob, [a.token for a in e.top_logprobs]) for e in streamed] == [
        (e.token, e.logprob, [a.token for a in e.top_logprobs]) for e in content]
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    call = [{"role": "user", "content": "[call] weather?"}]
    r = client.chat.completions.create(model="tiny", messages=call, tools=[weather], max_tokens=64, logprobs=True)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].logprobs.content) == 1
    chunks = list(client.chat.completions.create(model="tiny", messages=call, tools=[weather], max_tokens=64,
                                                 logprobs=True, stream=True))
    assert [e.token for ch in chunks if ch.choices and ch.choices[0].logprobs
            for e in ch.choices[0].logprobs.content] == ["d"]  # on the call's first delta (a parser holds text)
    assert any(ch.choices and ch.choices[0].delta.tool_calls for ch in chunks)
    no_top = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, logprobs=True)
    assert [e.top_logprobs for e in no_top.choices[0].logprobs.content] == [[], [], []]
    assert client.chat.completions.create(model="tiny", messages=USER, max_tokens=8).choices[0].logprobs is None

    raw = client.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=8, logprobs=3)
    r = raw.parse()
    assert fake.submit_of(raw.headers["x-request-id"])[1].sampling.logprobs == 3
    lp = r.choices[0].logprobs
    assert lp.tokens == [TOK.token_bytes(100 + i).decode() for i in range(3)]
    assert lp.token_logprobs == [-0.5, -0.6, -0.7]
    assert lp.top_logprobs[1] == {TOK.token_bytes(101).decode(): -0.6, TOK.token_bytes(7).decode(): -3.0,
                                  TOK.token_bytes(8).decode(): -4.0}
    assert lp.text_offset == [0, 1, 2]
    chunks = list(client.completions.create(model="tiny", prompt="x", max_tokens=8, logprobs=3, stream=True))
    parts = [ch.choices[0].logprobs for ch in chunks if ch.choices[0].logprobs]
    assert sum((p.tokens for p in parts), []) == lp.tokens and sum((p.text_offset for p in parts), []) == [0, 1, 2]

    # the Responses API: include names them (top_logprobs: how many alternatives); on output_text and its deltas
    raw = client.responses.with_raw_response.create(model="tiny", input="hello there", max_output_tokens=8,
                                                    include=["message.output_text.logprobs"], top_logprobs=1)
    r = raw.parse()
    assert fake.submit_of(raw.headers["x-request-id"])[1].sampling.logprobs == 1
    part = r.output[0].content[0]
    assert [(e.token, e.logprob, [a.token for a in e.top_logprobs]) for e in part.logprobs] == [
        ("d", -0.5, ["d"]), ("e", -0.6, ["e"]), ("f", -0.7, ["f"])]
    events = list(client.responses.create(model="tiny", input="hello there", max_output_tokens=8, top_logprobs=2,
                                          stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [x.token for e in deltas for x in e.logprobs] == ["d", "e", "f"]
    done = next(e for e in events if e.type == "response.completed").response.output[0].content[0]
    assert [x.logprob for x in done.logprobs] == [-0.5, -0.6, -0.7]
    plain = client.responses.create(model="tiny", input="hello there", max_output_tokens=8)
    assert not plain.output[0].content[0].logprobs
    r = client.responses.create(model="tiny", input="[call] weather?", tools=[{**weather["function"],
                                "type": "function"}], max_output_tokens=64, top_logprobs=1)
    assert [o.type for o in r.output] == ["function_call"]  # the call's tokens: no text to hold them


@pytest.mark.parametrize("path,extra,param", [
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),                       # needs logprobs: true
    (CHAT, {"logprobs": False, "top_logprobs": 1}, "top_logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),     # OpenAI's bound
    (CHAT, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (CHAT, {"logprobs": 1}, "logprobs"),                                # a bool
    (COMPL, {"logprobs": True}, "logprobs"),                            # completions: a count
    (COMPL, {"logprobs": 21}, "logprobs"),
    (COMPL, {"logprobs": -1}, "logprobs"),
    ("/v1/responses", {"top_logprobs": 21}, "top_logprobs"),
    ("/v1/responses", {"top_logprobs": True}, "top_logprobs"),
])
def test_bad_logprobs_are_a_400_naming_the_field(http, fake, path, extra, param):
    before = len(fake.admits)
    base = {CHAT: {"messages": USER, "max_tokens": 4}, COMPL: {"prompt": "x", "max_tokens": 4}}.get(
        path, {"input": "x", "max_output_tokens": 4})
    body = {"model": "tiny", **base, **extra}
    err = assert_openai_error(http.post(path, json=body), 400)
    assert err["param"] == param
    assert len(fake.admits) == before


def test_a_one_mib_stop_string_is_a_400(http, fake):
    before = len(fake.admits)
    err = assert_openai_error(http.post(COMPL, json={**PROBE, "stop": "x" * (1 << 20)}), 400)
    assert err["param"] == "stop"
    assert len(fake.admits) == before


def test_openapi_schema_describes_both_request_bodies(cluster):
    schema = httpx.get(cluster["base"] + "/openapi.json").json()
    components = schema["components"]["schemas"]
    for path, name, required in [(CHAT, "ChatCompletionRequest", {"model", "messages"}),
                                 (COMPL, "CompletionRequest", {"model", "prompt"})]:
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
        assert set(components[name]["required"]) == required
        assert {"max_tokens", "temperature", "stop", "stream"} <= set(components[name]["properties"])
        assert schema["paths"][path]["post"]["responses"]["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}
    assert schema["security"] == [{"bearer": []}]


# ---- tenants, /metrics behind the key, bus size (a router of its own) ------------------------------------
TENANT_KEYS = {"sk-acme-1": "acme", "sk-acme-2": "acme", "sk-blue": "blue"}
SMALL_BUS = 16384  # bytes: a prompt of more than ~3K token ids does not fit


@pytest.fixture(scope="module")
def tenant_router(cluster):
    port, log_path = free_port(), cluster["tmp"] / "router-tenants.log"
    with open(log_path, "wb") as log:
        proc = _start_router(cluster["url"], cluster["prefix"], port, log, cluster["tmp"] / "spans-tenants.jsonl",
                             "instance=router-tenants", "router.metrics_require_key=true",
                             f"router.api_key_tenants={json.dumps(TENANT_KEYS)}",
                             f"bus.max_message_bytes={SMALL_BUS}")
        try:
            base = f"http://127.0.0.1:{port}"
            wait_for(lambda: proc.poll() is None and _get_ok(f"{base}/health"), timeout=60, interval=0.1)
            yield base
        finally:
            _stop(proc)


def _post(base: str, key: str, body: dict, path: str = COMPL) -> httpx.Response:
    return httpx.post(base + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=10)


def test_each_key_submits_its_tenant_never_the_key(tenant_router, fake):
    for key, tenant in [*TENANT_KEYS.items(), (KEY, "")]:
        resp = _post(tenant_router, key, PROBE)
        assert resp.status_code == 200, resp.text
        _, submit, headers = fake.submit_of(resp.headers["x-request-id"])
        assert submit.tenant == tenant
        assert key not in submit.encode().decode("latin-1") and key not in json.dumps(headers)
    assert_openai_error(_post(tenant_router, "sk-acme-3", PROBE), 401)


def test_metrics_need_the_key_when_configured(tenant_router, cluster):
    assert_openai_error(httpx.get(tenant_router + "/metrics"), 401)
    assert_openai_error(httpx.get(tenant_router + "/metrics", headers={"Authorization": "Bearer nope"}), 401)
    for key in ("sk-blue", KEY):
        resp = httpx.get(tenant_router + "/metrics", headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 200 and "moorage_router_requests_total" in resp.text
    assert httpx.get(cluster["base"] + "/metrics").status_code == 200  # the default: open


def test_a_prompt_too_large_for_the_bus_is_a_413_before_admission(tenant_router, fake):
    before = len(fake.admits)
    err = assert_openai_error(_post(tenant_router, KEY, {**PROBE, "prompt": [65] * 4000}), 413)
    assert err["param"] == "prompt" and err["code"] == "request_too_large"
    assert f"at most {SMALL_BUS} bytes" in err["message"]
    err = assert_openai_error(_post(tenant_router, KEY, {"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": "y" * 4000}]}, CHAT), 413)
    assert err["param"] == "messages"
    assert len(fake.admits) == before
    ok = _post(tenant_router, KEY, {**PROBE, "prompt": [65] * 2000})  # 8 KB of ids: fits
    assert ok.status_code == 200, ok.text
    assert len(fake.submit_of(ok.headers["x-request-id"])[1].prompt_ids) == 2000
