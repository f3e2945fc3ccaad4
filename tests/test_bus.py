"""shared/bus.py on a real nats-server: typed publish/request, the payload cap, trace context in headers,
error replies, and the subject layout. Each test gets its own subject prefix."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from opentelemetry import trace

from shared.engine.sampling import SamplingParams
from shared import tracing
from shared.bus import DEFAULT_MAX_MESSAGE_BYTES, Bus, BusConfig, PayloadTooLarge, Subjects
from shared.messages import Ack, AdmitReply, AdmitRequest, Cancel, LoadReport, MessageError, PrefillSubmit, Release


@pytest.fixture
async def make_bus(nats_url):
    """Connects buses on one fresh prefix; all are closed at the end of the test."""
    prefix = "t" + uuid.uuid4().hex[:10]
    opened: list[Bus] = []

    async def make(**overrides) -> Bus:
        bus = await Bus.connect(BusConfig(url=nats_url, prefix=prefix, request_timeout_s=2.0, **overrides),
                                f"test-{len(opened)}")
        opened.append(bus)
        return bus

    yield make
    for b in opened:
        await b.close()


@pytest.fixture
async def bus(make_bus):
    return await make_bus()


@pytest.fixture
async def other(make_bus):
    return await make_bus()


async def subscribed(b: Bus) -> None:
    """Returns once the server has this connection's subscriptions. One flush is not enough with nats-py
    2.16: `flush()` writes its PING straight to the socket, ahead of SUBs still in the pending buffer, so the
    PONG can come back before the server saw them. By the first PONG the flusher task has written the SUBs,
    so the second PING queues behind them."""
    await b.nc.flush()
    await b.nc.flush()


def admit(rid: str = "r1") -> AdmitRequest:
    return AdmitRequest(rid, prompt_tokens=100, max_tokens=20)


def ok_reply(msg: AdmitRequest) -> AdmitReply:
    return AdmitReply(msg.request_id, "admitted", decode_instance="decode-0")


async def test_request_reply_round_trip(bus, other):
    seen = []

    async def handler(msg, raw):
        seen.append((msg, raw.subject))
        return ok_reply(msg)

    await other.subscribe(other.subjects.gate_admit, AdmitRequest, handler)
    await subscribed(other)
    reply = await bus.request(bus.subjects.gate_admit, admit("r7"), AdmitReply)
    assert reply == AdmitReply("r7", "admitted", decode_instance="decode-0")
    assert seen == [(admit("r7"), bus.subjects.gate_admit)]


@pytest.mark.parametrize("concurrent", [False, True])
async def test_concurrent_handlers_do_not_wait_for_each_other(bus, other, concurrent):
    """One handler waits on an event that only the second message sets: in order, the second waits
    behind the first (both time out); concurrent, both are answered."""
    release = asyncio.Event()

    async def handler(msg, raw):
        if msg.request_id == "slow":
            await asyncio.wait_for(release.wait(), 1.0)
        else:
            release.set()
        return ok_reply(msg)

    await other.subscribe(other.subjects.gate_admit, AdmitRequest, handler, concurrent=concurrent)
    await subscribed(other)
    slow = asyncio.create_task(bus.request(bus.subjects.gate_admit, admit("slow"), AdmitReply, timeout=0.6))
    await asyncio.sleep(0.05)
    fast = await asyncio.gather(bus.request(bus.subjects.gate_admit, admit("fast"), AdmitReply, timeout=0.6),
                                return_exceptions=True)
    if concurrent:
        assert fast[0].request_id == "fast" and (await slow).request_id == "slow"
    else:
        assert isinstance(fast[0], Exception)  # queued behind the waiting handler
        assert isinstance((await asyncio.gather(slow, return_exceptions=True))[0], Exception)


async def test_publish_subscribe(bus, other):
    got: asyncio.Queue = asyncio.Queue()

    async def handler(msg, raw):
        await got.put(msg)  # returns None: no reply (and publishes have no reply subject anyway)

    await other.subscribe(other.subjects.load("decode", "*"), LoadReport, handler)
    await subscribed(other)
    report = LoadReport("decode-3", "decode", True, capacity_tokens=10, free_tokens=4, detail={"a": 1})
    await bus.publish(bus.subjects.load("decode", "decode-3"), report)
    await bus.publish(bus.subjects.load("prefill", "prefill-0"), report)  # another role: not subscribed
    assert await asyncio.wait_for(got.get(), 2) == report
    await asyncio.sleep(0.05)
    assert got.empty()


async def test_queue_group_delivers_once(bus, other):
    count = []

    async def handler(msg, raw):
        count.append(msg.request_id)

    for _ in range(3):
        await other.subscribe(other.subjects.gate_release, Release, handler, queue="gates")
    await subscribed(other)
    for i in range(5):
        await bus.publish(bus.subjects.gate_release, Release(f"r{i}"))
    await bus.nc.flush()
    for _ in range(100):
        if len(count) == 5:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert sorted(count) == [f"r{i}" for i in range(5)]


def big_submit(n: int = 2_100_000) -> PrefillSubmit:
    # ids travel packed, 4 bytes each: 2.1M of them are ~8.4 MB, over the default cap (8 MiB - 64 KiB)
    return PrefillSubmit("big", [256 + i % 30000 for i in range(n)], SamplingParams(max_tokens=1), "decode-0")


async def test_payload_too_large_is_never_sent(bus, other):
    assert bus.config.max_message_bytes == DEFAULT_MAX_MESSAGE_BYTES
    received = []

    async def handler(msg, raw):
        received.append(msg)
        return Ack(msg.request_id, True)

    subject = other.subjects.prefill_submit("prefill-0")
    await other.subscribe(subject, PrefillSubmit, handler)
    await subscribed(other)
    msg = big_submit()
    with pytest.raises(PayloadTooLarge, match=f"prefill_submit message of .* {DEFAULT_MAX_MESSAGE_BYTES}"):
        await bus.publish(subject, msg)
    with pytest.raises(PayloadTooLarge):
        await bus.request(subject, msg, Ack, timeout=0.5)
    await bus.nc.flush()
    await asyncio.sleep(0.1)
    assert received == []
    # a message just under the cap goes through
    small = big_submit(2_000_000)  # 8 MB: the embedded server's max_payload (8 MiB) takes it
    assert len(small.encode()) < DEFAULT_MAX_MESSAGE_BYTES
    assert (await bus.request(subject, small, Ack)).ok
    assert [m.request_id for m in received] == ["big"]


async def test_tiny_cap(make_bus, other):
    bus = await make_bus(max_message_bytes=64)
    received = []

    async def handler(msg, raw):
        received.append(msg)

    await other.subscribe(other.subjects.cancel_all, Cancel, handler)
    await subscribed(other)
    fits = Cancel("r1")
    assert len(fits.encode()) <= 64
    await bus.publish(bus.subjects.cancel("r1"), fits)
    too_big = Cancel("r2", reason="x" * 100)
    with pytest.raises(PayloadTooLarge, match="cancel message of .* exceeds the bus cap of 64"):
        await bus.publish(bus.subjects.cancel("r2"), too_big)
    await bus.nc.flush()
    await asyncio.sleep(0.1)
    assert received == [fits]


async def test_reply_over_cap_is_not_sent(make_bus, bus):
    """The cap also guards replies: the responder refuses (and the requester times out rather than receive it)."""
    small = await make_bus(max_message_bytes=200)
    errors = []

    async def handler(msg, raw):
        try:
            await small.respond(raw, AdmitReply(msg.request_id, "rejected", reason="x" * 500))
        except PayloadTooLarge as e:
            errors.append(e)
        return None

    await small.subscribe(small.subjects.gate_admit, AdmitRequest, handler)
    await subscribed(small)
    with pytest.raises(asyncio.TimeoutError):
        await bus.request(bus.subjects.gate_admit, admit(), AdmitReply, timeout=0.3)
    assert len(errors) == 1


@pytest.fixture
def traced():
    tracing.setup_tracing("test-bus", "t-0", tracing.TracingConfig(exporter="none"))
    yield tracing.get_tracer("test-bus")
    tracing.shutdown_tracing()


async def test_trace_context_propagates(bus, other, traced):
    seen = {}

    async def handler(msg, raw):
        ctx = Bus.trace_context(raw)
        seen["remote"] = trace.get_current_span(ctx).get_span_context()
        with traced.start_as_current_span("handle", context=ctx) as span:
            seen["child"] = span.get_span_context()
            seen["child_parent"] = span.parent
        return ok_reply(msg)

    await other.subscribe(other.subjects.gate_admit, AdmitRequest, handler)
    await subscribed(other)
    with traced.start_as_current_span("send") as span:
        sent = span.get_span_context()
        await bus.request(bus.subjects.gate_admit, admit(), AdmitReply)
    assert sent.is_valid
    assert seen["remote"].is_remote and seen["remote"].trace_id == sent.trace_id
    assert seen["remote"].span_id == sent.span_id
    assert seen["child"].trace_id == sent.trace_id and seen["child_parent"].span_id == sent.span_id

    # a publish outside any span carries no context: the handler's span would be a root
    seen.clear()
    got: asyncio.Queue = asyncio.Queue()

    async def on_release(msg, raw):
        await got.put(trace.get_current_span(Bus.trace_context(raw)).get_span_context())

    await other.subscribe(other.subjects.gate_release, Release, on_release)
    await subscribed(other)
    await bus.publish(bus.subjects.gate_release, Release("r1"))
    assert not (await asyncio.wait_for(got.get(), 2)).is_valid


async def test_publish_carries_trace_context(bus, other, traced):
    got: asyncio.Queue = asyncio.Queue()

    async def handler(msg, raw):
        await got.put(trace.get_current_span(Bus.trace_context(raw)).get_span_context().trace_id)

    await other.subscribe(other.subjects.cancel_all, Cancel, handler)
    await subscribed(other)
    with traced.start_as_current_span("cancel") as span:
        await bus.publish(bus.subjects.cancel("r1"), Cancel("r1"))
        trace_id = span.get_span_context().trace_id
    assert await asyncio.wait_for(got.get(), 2) == trace_id


async def test_handler_exception_gets_on_error_reply(bus, other):
    errors = []

    async def handler(msg, raw):
        raise RuntimeError("boom")

    def on_error(exc, raw):
        errors.append(exc)
        return AdmitReply("?", "invalid", reason=str(exc))

    await other.subscribe(other.subjects.gate_admit, AdmitRequest, handler, on_error=on_error)
    await subscribed(other)
    reply = await bus.request(bus.subjects.gate_admit, admit(), AdmitReply, timeout=1.0)
    assert reply.status == "invalid" and reply.reason == "boom"
    assert [type(e) for e in errors] == [RuntimeError]


async def test_handler_exception_without_on_error_times_out(bus, other):
    async def handler(msg, raw):
        raise RuntimeError("boom")

    await other.subscribe(other.subjects.gate_admit, AdmitRequest, handler)
    await subscribed(other)
    with pytest.raises(asyncio.TimeoutError):
        await bus.request(bus.subjects.gate_admit, admit(), AdmitReply, timeout=0.3)
    # the subscription survives a failing handler
    assert not other.nc.is_closed


@pytest.mark.parametrize("payload", [b"\xc1garbage", Release("r1").encode(),
                                     AdmitRequest("r1", prompt_tokens="x", max_tokens=1).encode()],
                         ids=["garbage", "wrong-kind", "wrong-type"])
async def test_malformed_payload_reaches_on_error_not_handler(bus, other, payload):
    handled, errors = [], []

    async def handler(msg, raw):
        handled.append(msg)
        return ok_reply(msg)

    def on_error(exc, raw):
        errors.append(exc)
        return AdmitReply("", "invalid", reason=str(exc))

    await other.subscribe(other.subjects.gate_admit, AdmitRequest, handler, on_error=on_error)
    await subscribed(other)
    resp = await bus.nc.request(bus.subjects.gate_admit, payload, timeout=1.0)
    reply = AdmitReply.decode(resp.data)
    assert reply.status == "invalid" and reply.reason
    assert handled == []
    assert len(errors) == 1 and isinstance(errors[0], MessageError)


async def test_wrong_reply_type_raises_message_error(bus, other):
    async def handler(msg, raw):
        return Ack(msg.request_id, True)

    await other.subscribe(other.subjects.gate_admit, AdmitRequest, handler)
    await subscribed(other)
    with pytest.raises(MessageError, match="'admit_reply'.*'ack'"):
        await bus.request(bus.subjects.gate_admit, admit(), AdmitReply)


# ---- subjects ---------------------------------------------------------------------------------------
def nats_match(pattern: str, subject: str) -> bool:
    """NATS wildcard matching: `*` one token, `>` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def test_nats_match_helper():
    assert nats_match("a.>", "a.b.c") and not nats_match("a.>", "a")
    assert nats_match("a.*.c", "a.b.c") and not nats_match("a.*", "a.b.c")


def all_subjects(s: Subjects) -> dict[str, str]:
    return {"gate_admit": s.gate_admit, "gate_release": s.gate_release, "prefill_submit": s.prefill_submit("p0"),
            "decode_slots": s.decode_slots("d0"), "decode_filled": s.decode_filled("d0"),
            "decode_landed": s.decode_landed("d0"), "request_out": s.request_out("r1"), "cancel": s.cancel("r1"),
            "cancel_all": s.cancel_all, "load": s.load("decode", "d0"), "load_all": s.load_all,
            "kv_events": s.kv_events("p0")}


@pytest.mark.parametrize("prefix", ["moorage", "t1.x"])
def test_subjects_are_under_the_prefix(prefix):
    s = Subjects(prefix)
    subjects = all_subjects(s)
    for name, subject in subjects.items():
        assert subject.startswith(prefix + "."), name
        assert " " not in subject and ".." not in subject, name
    assert len(set(subjects.values())) == len(subjects)
    assert Subjects() == Subjects("moorage")
    assert Bus.__dataclass_fields__["subjects"].init is False


def test_request_subjects_never_overlap_load_all():
    s = Subjects("moorage")
    request_reply = ["gate_admit", "gate_release", "prefill_submit", "decode_slots", "decode_filled",
                     "decode_landed", "request_out", "cancel", "kv_events"]
    subjects = all_subjects(s)
    for name in request_reply:
        assert not nats_match(s.load_all, subjects[name]), name
        assert not nats_match(s.cancel_all, subjects[name]) or name == "cancel", name
    # instance names that look like other subjects' tokens still stay out
    for inst in ("load", ">", "*"):
        for subject in (s.prefill_submit(inst), s.decode_slots(inst), s.kv_events(inst)):
            assert not nats_match(s.load_all, subject)
    assert nats_match(s.load_all, s.load("prefill", "p1"))
    assert not nats_match(Subjects("other").load_all, s.load("decode", "d0"))  # prefixes isolate


async def test_load_all_subscriber_sees_no_requests(bus, other):
    loads, admits = [], []

    async def on_load(msg, raw):
        loads.append(raw.subject)

    async def on_admit(msg, raw):
        admits.append(msg)
        return ok_reply(msg)

    # a raw subscriber on load_all: anything at all arriving there is counted
    async def raw_cb(raw):
        loads.append(raw.subject)

    await other.nc.subscribe(other.subjects.load_all, cb=raw_cb)
    await other.subscribe(other.subjects.gate_admit, AdmitRequest, on_admit)
    await subscribed(other)
    await bus.request(bus.subjects.gate_admit, admit(), AdmitReply)
    await bus.publish(bus.subjects.gate_release, Release("r1"))
    await bus.publish(bus.subjects.load("gate", "g0"), LoadReport("g0", "gate", True))
    await bus.nc.flush()
    for _ in range(100):
        if loads:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert loads == [bus.subjects.load("gate", "g0")]
    assert len(admits) == 1


async def test_close_with_a_handler_still_running_is_bounded_and_leaves_nothing_unread(bus, other):
    """A service stopping while a handler still works (issue 33 saw it at every prefill stop): close() ends
    within the drain bound and leaves no failed future behind ("_GatheringFuture exception was never
    retrieved", logged when the garbage collector finds it)."""
    import gc
    import time as _time

    from shared.bus import DRAIN_TIMEOUT_S

    started = asyncio.Event()
    unread: list[dict] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: unread.append(context))

    async def slow(msg, raw):
        started.set()
        await asyncio.sleep(30)

    await other.subscribe(other.subjects.cancel_all, Cancel, slow)
    await subscribed(other)
    await bus.publish(bus.subjects.cancel("r1"), Cancel("r1"))
    await asyncio.wait_for(started.wait(), 5)
    t0 = _time.monotonic()
    await other.close()
    assert _time.monotonic() - t0 < DRAIN_TIMEOUT_S + 2
    assert other.nc.is_closed
    for _ in range(3):
        await asyncio.sleep(0.05)
        gc.collect()
    loop.set_exception_handler(None)
    assert [c.get("message") for c in unread] == []
