"""The gate as a real process on a real nats-server. The "decode" is this test publishing load reports:
the thing under test is the gate. Each test gets its own gate and its own subject prefix."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgpack
import pytest

from shared import tracing
from shared.bus import Bus, BusConfig
from shared.messages import AdmitReply, AdmitRequest, Cancel, Holdings, LoadReport, Release, TokenChunk
from shared.tracing import TracingConfig

REPO = Path(__file__).resolve().parents[1]


class GateProcess:
    def __init__(self, url: str, tmp: Path, *overrides: str):
        self.prefix = "t" + uuid.uuid4().hex[:10]
        self.log_path = tmp / "gate.log"
        self.trace_path = tmp / "gate-traces.jsonl"
        args = [sys.executable, "-m", "services.gate", "--set", f"bus.url={url}", "--set", f"bus.prefix={self.prefix}",
                "--set", "gate.admission_wait_s=1", "--set", "load_interval_s=0.1",
                "--set", "tracing.exporter=none", *[a for o in overrides for a in ("--set", o)]]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 20
        while b'"ready"' not in self.log_path.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gate did not start:\n{self.tail()}")
            time.sleep(0.02)

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        print(self.tail())  # shown by pytest when the test failed


@pytest.fixture
def start_gate(nats_url, tmp_path):
    started: list[GateProcess] = []

    def start(*overrides: str) -> GateProcess:
        g = GateProcess(nats_url, tmp_path, *overrides)
        started.append(g)
        return g

    yield start
    for g in started:
        g.stop()


class Client:
    """The test's side of the bus: router (admit, release) and fake decode (load reports)."""

    def __init__(self, bus: Bus):
        self.bus, self.s = bus, bus.subjects
        self.gate_reports: asyncio.Queue[LoadReport] = asyncio.Queue()

    @classmethod
    async def connect(cls, url: str, prefix: str) -> "Client":
        c = cls(await Bus.connect(BusConfig(url=url, prefix=prefix), "test"))

        async def on_gate(msg: LoadReport, raw) -> None:
            c.gate_reports.put_nowait(msg)

        await c.bus.subscribe(c.s.load("gate", "*"), LoadReport, on_gate)
        return c

    async def admit(self, rid: str, prompt: int, out: int, timeout: float = 5.0, priority: int = 0) -> AdmitReply:
        return await self.bus.request(self.s.gate_admit, AdmitRequest(rid, prompt, out, priority=priority),
                                      AdmitReply, timeout=timeout)

    async def release(self, rid: str) -> None:
        await self.bus.publish(self.s.gate_release, Release(rid))

    async def decode(self, name: str, capacity: int, free: int, ready: bool = True) -> None:
        await self.bus.publish(self.s.load("decode", name),
                               LoadReport(instance=name, role="decode", ready=ready, capacity_tokens=capacity,
                                          free_tokens=free))

    async def gate_state(self, pred, timeout: float = 20.0) -> LoadReport:
        """The first gate load report (after now) whose detail satisfies pred."""
        deadline = time.monotonic() + timeout
        while True:
            report = await asyncio.wait_for(self.gate_reports.get(), max(0.01, deadline - time.monotonic()))
            if pred(report.detail):
                return report


@pytest.fixture
async def connect(nats_url):
    clients: list[Client] = []

    async def make(gate: GateProcess) -> Client:
        c = await Client.connect(nats_url, gate.prefix)
        clients.append(c)
        # the gate reports only once it has subscribed: before that a fake decode's report is lost
        await c.gate_state(lambda d: True, timeout=60.0)
        return c

    yield make
    for c in clients:
        await c.bus.close()


async def test_admit_picks_the_decode_with_room(start_gate, connect):
    c = await connect(start_gate())
    await c.decode("d0", 1000, 1000)
    await c.decode("d1", 1000, 100)  # decode itself reports 900 in use
    await c.gate_state(lambda d: d["live_instances"] == 2)
    r = await c.admit("a", 100, 50)
    assert (r.request_id, r.status, r.decode_instance) == ("a", "admitted", "d0")
    report = await c.gate_state(lambda d: d["reservations"] == 1)
    assert report.detail["reserved_tokens"] == {"d0": 150, "d1": 0} and report.detail["admitted"] == 1
    big = await c.admit("b", 900, 1)  # the largest budget is 900 (capacity x 0.9)
    assert big.status == "invalid" and "context length" in big.reason


async def test_burst_beyond_budget_waits_then_is_rejected(start_gate, connect):
    c = await connect(start_gate("gate.retry_after_s=2.5", "gate.retry_after_max_s=7.5"))
    await c.decode("d0", 1000, 1000)
    await c.gate_state(lambda d: d["live_instances"] == 1)
    t0 = time.monotonic()
    replies = await asyncio.gather(*[c.admit(f"r{i}", 300, 100) for i in range(4)])  # budget 900: two fit
    assert sorted(r.status for r in replies) == ["admitted", "admitted", "rejected", "rejected"]
    for r in replies:
        if r.status == "rejected":  # nothing was released meanwhile: the queue is stuck, so the most
            assert r.retry_after_s == 7.5 and r.waited_ms >= 900 and "budget" in r.reason, r
    assert 0.9 < time.monotonic() - t0 < 3.0
    report = await c.gate_state(lambda d: d["rejected"] == 2)
    assert report.detail["waiting"] == 0 and report.detail["reserved_tokens"] == {"d0": 800}


async def test_release_lets_a_waiting_request_in(start_gate, connect):
    c = await connect(start_gate("gate.admission_wait_s=5"))
    await c.decode("d0", 1000, 1000)
    await c.gate_state(lambda d: d["live_instances"] == 1)
    assert (await c.admit("a", 700, 100)).status == "admitted"
    waiting = asyncio.create_task(c.admit("b", 400, 100))
    await c.gate_state(lambda d: d["waiting"] == 1)
    assert not waiting.done()
    await c.release("a")
    r = await asyncio.wait_for(waiting, 10.0)
    assert (r.status, r.decode_instance) == ("admitted", "d0") and r.waited_ms > 50
    await c.release("a")  # duplicate: counted, nothing else
    report = await c.gate_state(lambda d: d["release_duplicate"] == 1)
    assert report.detail["reserved_tokens"] == {"d0": 500} and report.detail["released"] == 1


async def test_a_higher_priority_on_the_wire_is_admitted_first(start_gate, connect):
    """AdmitRequest.priority (an agent hint from the router) reorders the gate's queue: of two requests
    waiting for the same budget, the later one with priority 2 (4 s of head start) goes first."""
    c = await connect(start_gate("gate.admission_wait_s=20"))
    await c.decode("d0", 1000, 1000)
    await c.gate_state(lambda d: d["live_instances"] == 1)
    assert (await c.admit("a", 800, 100)).status == "admitted"
    low = asyncio.create_task(c.admit("low", 400, 100, timeout=30))
    await c.gate_state(lambda d: d["waiting"] == 1)
    high = asyncio.create_task(c.admit("high", 400, 100, timeout=30, priority=2))
    await c.gate_state(lambda d: d["waiting"] == 2)
    await c.release("a")
    r = await asyncio.wait_for(high, 10.0)
    assert r.status == "admitted" and not low.done()  # 500 + 500 > 900: only one fits
    await c.release("high")
    assert (await asyncio.wait_for(low, 10.0)).status == "admitted"


async def test_a_routers_holdings_free_what_it_no_longer_holds(start_gate, connect):
    """A Release lost with the bus (found by bench/faults.py under kill -9 of nats-server): the router's next
    Holdings no longer lists the request, and the gate drops its reservation. Another router's, one still
    listed, and a malformed list drop nothing."""
    c = await connect(start_gate("gate.holdings_grace_s=0.2"))
    await c.decode("d0", 1000, 1000)
    await c.gate_state(lambda d: d["live_instances"] == 1)
    for rid, boot in (("lost", "boot-a"), ("kept", "boot-a"), ("theirs", "boot-b")):
        r = await c.bus.request(c.s.gate_admit, AdmitRequest(rid, 100, 50, router_boot=boot), AdmitReply, timeout=5)
        assert r.status == "admitted"
    await asyncio.sleep(0.3)  # older than the grace
    await c.bus.nc.publish(c.s.holdings, msgpack.packb({"v": 1, "kind": "holdings", "router": "router-0",
                                                             "boot": "boot-a", "request_ids": [1, 2]}))
    await c.gate_state(lambda d: d["malformed"] == 1)
    await c.bus.publish(c.s.holdings, Holdings("router-0", "boot-a", ["kept"]))
    report = await c.gate_state(lambda d: d["reconciled"] == 1)
    assert report.detail["reservations"] == 2 and report.detail["reserved_tokens"] == {"d0": 300}
    await c.release("lost")  # the lost Release after all: a duplicate
    report = await c.gate_state(lambda d: d["release_duplicate"] == 1)
    assert report.detail["reserved_tokens"] == {"d0": 300}



async def test_a_router_that_goes_silent_loses_its_budget_and_its_requests_are_cancelled(start_gate, connect):
    """A router killed for good sends no more load reports: after gate.router_timeout_s the gate drops what
    its process held and publishes a Cancel for each request (prefill and decode then stop it), instead of
    holding the budget for reservation_ttl_s. Another router that keeps reporting keeps its reservation."""
    c = await connect(start_gate("gate.router_timeout_s=1.5"))
    cancels: asyncio.Queue[Cancel] = asyncio.Queue()

    async def on_cancel(msg: Cancel, raw) -> None:
        cancels.put_nowait(msg)

    async def on_chunk(msg: TokenChunk, raw) -> None:
        chunks.append(msg)

    chunks: list[TokenChunk] = []
    await c.bus.subscribe(c.s.cancel_all, Cancel, on_cancel)
    await c.bus.subscribe(c.s.request_out("doomed"), TokenChunk, on_chunk)
    await c.decode("d0", 1000, 1000)
    await c.gate_state(lambda d: d["live_instances"] == 1)

    async def router_report(name: str, boot: str) -> None:
        await c.bus.publish(c.s.load("router", name), LoadReport(name, "router", True, detail={"boot": boot}))

    await router_report("router-0", "boot-gone")
    await router_report("router-1", "boot-alive")
    for rid, boot in (("doomed", "boot-gone"), ("alive", "boot-alive")):
        r = await c.bus.request(c.s.gate_admit, AdmitRequest(rid, 100, 50, router_boot=boot), AdmitReply, timeout=5)
        assert r.status == "admitted"
    deadline = time.monotonic() + 20
    while True:  # router-1 keeps reporting; router-0 is silent from now on
        await router_report("router-1", "boot-alive")
        with contextlib.suppress(asyncio.TimeoutError):
            got = await asyncio.wait_for(cancels.get(), 0.5)
            break
        assert time.monotonic() < deadline, "the silent router's request was never cancelled"
    assert got.request_id == "doomed" and "silent" in got.reason
    await router_report("router-1", "boot-alive")
    report = await c.gate_state(lambda d: d["router_gone"] == 1)
    assert report.detail["reservations"] == 1 and report.detail["reserved_tokens"] == {"d0": 150}
    assert cancels.empty()
    [chunk] = chunks  # a router that was only frozen ends the request with a 503 when it wakes
    assert chunk.finished and chunk.error["status"] == 503 and "silent" in chunk.error["message"]

async def test_no_decode_means_503_style_rejection(start_gate, connect):
    c = await connect(start_gate())
    r = await c.admit("a", 10, 10)
    assert r.status == "unavailable" and r.reason == "no decode instance available" and r.retry_after_s > 0


async def test_malformed_messages_get_invalid_and_the_gate_survives(start_gate, connect):
    c = await connect(start_gate())
    nc, subject = c.bus.nc, c.s.gate_admit
    r = AdmitReply.decode((await nc.request(subject, b"\xc1 not msgpack", timeout=5)).data)
    assert r.status == "invalid" and "msgpack" in r.reason
    partial = msgpack.packb({"v": 1, "kind": "admit", "request_id": "m1", "prompt_tokens": 5})
    r = AdmitReply.decode((await nc.request(subject, partial, timeout=5)).data)
    assert (r.request_id, r.status) == ("m1", "invalid") and "max_tokens" in r.reason
    wrong = msgpack.packb({"v": 1, "kind": "admit", "request_id": "m2", "prompt_tokens": "many", "max_tokens": 1})
    assert AdmitReply.decode((await nc.request(subject, wrong, timeout=5)).data).status == "invalid"
    await nc.publish(c.s.gate_release, b"junk")
    await nc.publish(c.s.load("decode", "d0"), b"junk")
    await c.decode("d0", 1000, 1000)
    assert (await c.admit("ok", 10, 10)).status == "admitted"
    report = await c.gate_state(lambda d: d["malformed"] == 5)
    assert report.detail["admitted"] == 1


async def test_sigterm_answers_waiters_exports_the_span_and_exits_0(start_gate, connect, tmp_path):
    gate = start_gate("gate.admission_wait_s=30", "tracing.exporter=jsonl", f"tracing.path={tmp_path / 'gate.jsonl'}")
    c = await connect(gate)
    await c.decode("d0", 1000, 1000)
    await c.gate_state(lambda d: d["live_instances"] == 1)
    tracing.setup_tracing("router", "test", TracingConfig(exporter="none"))
    try:
        with tracing.get_tracer("test").start_as_current_span("router.request") as parent:
            assert (await c.admit("a", 800, 0)).status == "admitted"
        parent_ids = (format(parent.get_span_context().trace_id, "032x"), format(parent.get_span_context().span_id, "016x"))
    finally:
        tracing.shutdown_tracing()
    waiting = asyncio.create_task(c.admit("b", 800, 0))
    await c.gate_state(lambda d: d["waiting"] == 1)
    t0 = time.monotonic()
    gate.proc.send_signal(signal.SIGTERM)
    r = await asyncio.wait_for(waiting, 5)
    assert r.status == "unavailable" and "shutting down" in r.reason
    assert await asyncio.to_thread(gate.proc.wait, 5) == 0
    assert time.monotonic() - t0 < 5
    goodbye = await c.gate_state(lambda d: True, timeout=1)
    while goodbye.ready:  # periodic reports queued before the final one
        goodbye = await c.gate_state(lambda d: True, timeout=1)
    spans = [s for s in tracing.read_spans(tmp_path / "gate.jsonl") if s["name"] == "gate.admit"]
    by_id = {s["attributes"]["request_id"]: s for s in spans}
    a = by_id["a"]
    assert (a["trace_id"], a["parent_span_id"]) == parent_ids
    assert a["attributes"]["decision"] == "admitted" and a["attributes"]["decode_instance"] == "d0"
    assert a["attributes"]["prompt_tokens"] == 800 and a["attributes"]["max_tokens"] == 0
    assert by_id["b"]["attributes"]["decision"] == "unavailable" and by_id["b"]["attributes"]["wait_ms"] > 0


def test_repeated_sigterm_during_shutdown_still_exits_0(start_gate):
    """Supervisors and test harnesses often signal twice (terminate, then terminate-and-wait). Each
    signal after the first must be ignored, including after the event loop has closed and while the
    interpreter tears down; before, that window ended the process with -15."""
    gate = start_gate()
    deadline = time.monotonic() + 10
    while gate.proc.poll() is None and time.monotonic() < deadline:
        gate.proc.send_signal(signal.SIGTERM)
        time.sleep(0.002)
    assert gate.proc.wait(5) == 0, gate.tail()
