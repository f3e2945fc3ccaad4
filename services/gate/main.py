"""The gate service: `Admission` (admission.py) wired to the bus.

- `moorage.gate.admit` (queue group "gate"): AdmitRequest -> AdmitReply, answered in the handler when the
  request fits now: the reply goes first; the `gate.admit` span (started when the admit arrived, with a
  `replied` event) and the decision's log line follow. A request that has to wait keeps its NATS message
  here and is answered later by the tick loop, so the subscription never blocks.
- `moorage.gate.release`: Release. `moorage.load.decode.*`: decode LoadReports (capacity, free KV).
- `moorage.router.holdings`: a router's Holdings; what it no longer lists is dropped (Admission.reconcile).
- `moorage.exited.>`: InstanceExited. A decode leaves the choice; a router's reservations and waiting
  admits are dropped and its requests cancelled at once (Admission.instance_exited / router_exited).
- Every TICK_S (or at once after a release or a load report) the loop drains the queue and expires
  what waited too long. The gate's own LoadReport carries the admission counters in `detail`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from nats.aio.msg import Msg
from opentelemetry import trace

from services.gate.admission import Admission, Admitted, Invalid, Rejected, Reservation, Wait
from shared.bus import Bus
from shared.messages import (AdmitReply, AdmitRequest, Cancel, Holdings, InstanceExited, LoadReport, MessageError,
                             Release, TokenChunk, error_info, request_id_of)
from shared.service import ServiceContext
from shared.tracing import get_tracer

TICK_S = 0.05
tracer = get_tracer("services.gate")


@dataclass
class _Pending:
    raw: Msg
    span: trace.Span | None  # set once the reply is sent (or the admit queued)
    started: float


class Gate:
    def __init__(self, ctx: ServiceContext):
        self.ctx, self.bus, self.log = ctx, ctx.bus, ctx.log
        self.admission = Admission(ctx.config.gate)
        self.pending: dict[str, list[_Pending]] = {}  # waiting request id -> its admit messages
        self.wake = asyncio.Event()
        self.malformed = 0
        self.stopping = False

    async def start(self) -> None:
        s = self.bus.subjects
        await self.bus.subscribe(s.gate_admit, AdmitRequest, self.on_admit, queue="gate",
                                 on_error=self.on_malformed_admit)
        await self.bus.subscribe(s.gate_release, Release, self.on_release, on_error=self.on_malformed)
        await self.bus.subscribe(s.holdings, Holdings, self.on_holdings, on_error=self.on_malformed)
        await self.bus.subscribe(s.load("decode", "*"), LoadReport, self.on_load, on_error=self.on_malformed)
        await self.bus.subscribe(s.load("router", "*"), LoadReport, self.on_router, on_error=self.on_malformed)
        await self.bus.subscribe(s.exited_all, InstanceExited, self.on_exited, on_error=self.on_malformed)
        self.ctx.load_report = self.load_report
        loop_task = asyncio.create_task(self.loop())

        async def stop() -> None:
            self.stopping = True  # admits still delivered while the bus drains are refused at once
            loop_task.cancel()
            for rid in list(self.pending):
                await self.answer(Rejected(rid, "gate shutting down", 0.0, self.admission.settings.retry_after_s,
                                           unavailable=True))

        self.ctx.on_stop.append(stop)

    # ---- handlers ----------------------------------------------------------------------------
    async def on_admit(self, msg: AdmitRequest, raw: Msg) -> AdmitReply | None:
        now, now_ns = time.monotonic(), time.time_ns()
        p, error = _Pending(raw, None, now), None
        try:
            if self.stopping:
                raise RuntimeError("shutting down")
            outcome = self.admission.admit(msg.request_id, msg.prompt_tokens, msg.max_tokens, now,
                                           msg.decode_instance, msg.router_boot, msg.priority, msg.latency_s,
                                           msg.osl, msg.prefer_decode)
        except Exception as e:  # a bug must cost one request, not the service
            self.log.exception("admit failed", request_id=msg.request_id)
            outcome, error = Rejected(msg.request_id, f"gate internal error: {e}", 0.0,
                                      self.admission.settings.retry_after_s, unavailable=True), e
        if isinstance(outcome, Wait):
            p.span = self._span(msg, raw, now_ns)
            self.pending.setdefault(msg.request_id, []).append(p)
            with trace.use_span(p.span):
                self.log.info("admission waiting", request_id=msg.request_id, waiting=len(self.admission.queue))
            self.wake.set()
            return None
        reply = self.decide(p, outcome)
        with contextlib.suppress(Exception):
            await self.bus.respond(raw, reply)
        replied_ns = time.time_ns()
        # The span (started when the admit arrived), its attributes and the log line come after the reply:
        # the bus's flusher sends the reply first, so they are off the admit's path.
        await asyncio.sleep(0)
        p.span = self._span(msg, raw, now_ns)
        p.span.add_event("replied", timestamp=replied_ns)  # stage mark (bench/overhead.py)
        if error is not None:
            p.span.record_exception(error)
        self.record(p, reply)
        return None

    @staticmethod
    def _span(msg: AdmitRequest, raw: Msg, start_ns: int) -> trace.Span:
        return tracer.start_span("gate.admit", context=Bus.trace_context(raw), kind=trace.SpanKind.SERVER,
                                 start_time=start_ns, attributes={"request_id": msg.request_id,
                                                                  "prompt_tokens": msg.prompt_tokens,
                                                                  "max_tokens": msg.max_tokens,
                                                                  "priority": msg.priority})

    async def on_release(self, msg: Release, raw: Msg) -> None:
        how = self.admission.release(msg.request_id, time.monotonic())
        # the usual outcome at debug: two info lines for every request were a sixth of the gate's CPU
        (self.log.debug if how == "released" else self.log.info)("release", request_id=msg.request_id, result=how,
                                                                   reason=msg.reason)
        if how == "cancelled":
            await self.answer(Rejected(msg.request_id, "released while waiting", 0.0,
                                       self.admission.settings.retry_after_s))
        self.wake.set()

    async def on_holdings(self, msg: Holdings, raw: Msg) -> None:
        """Drop what the router process no longer lists: its Release was lost (see Admission.reconcile)."""
        if not all(isinstance(rid, str) for rid in msg.request_ids):  # never drop on a list we cannot read
            self.on_malformed(MessageError("holdings: request_ids must be strings"), raw)
            return
        dropped, waiting = self.admission.reconcile(msg.boot, set(msg.request_ids), time.monotonic())
        if not (dropped or waiting):
            return
        for r in dropped:
            self.log.warning("reservation dropped: its router no longer holds it (release lost)",
                             request_id=r.request_id, router=msg.router, decode_instance=r.instance, tokens=r.tokens)
        for rid in waiting:
            await self.answer(Rejected(rid, "the router no longer waits for it", 0.0,
                                       self.admission.settings.retry_after_s, unavailable=True))
        self.wake.set()

    async def on_load(self, msg: LoadReport, raw: Msg) -> None:
        if msg.role == "decode":
            self.admission.report(msg.instance, msg.capacity_tokens, msg.free_tokens, msg.ready, time.monotonic(),
                                  msg.boot)
            self.wake.set()

    async def on_exited(self, msg: InstanceExited, raw: Msg) -> None:
        """A supervisor saw a process end: a decode leaves the choice at once, a router's holdings go."""
        if msg.role == "decode" and self.admission.instance_exited(msg.instance, msg.boot):
            self.log.warning("decode exited: not chosen until it reports again", decode_instance=msg.instance,
                             how=msg.how, source=msg.source)
            self.wake.set()  # waiting admits go to another decode, or wait for this one's restart (admission_wait_s)
        elif msg.role == "router":
            dropped, waiting = self.admission.router_exited(msg.instance, msg.boot, time.monotonic())
            if dropped or waiting:
                await self.router_gone(dropped, waiting, f"exited ({msg.how})" if msg.how else "exited",
                                       router=msg.instance)

    async def on_router(self, msg: LoadReport, raw: Msg) -> None:
        """A restarted router's first report frees what its previous process held (see Admission.router_report)."""
        boot = (msg.detail or {}).get("boot")
        dropped, waiting = self.admission.router_report(msg.instance, boot if isinstance(boot, str) else "",
                                                        time.monotonic())
        if dropped or waiting:
            await self.router_gone(dropped, waiting, "restarted", router=msg.instance)

    async def router_gone(self, dropped: list[Reservation], waiting: list[str], how: str, **where) -> None:
        """A router process is gone (`how`: restarted, exited, or silent past router_timeout_s): its reservations were
        dropped and its waiting admits dequeued. Nobody reads those requests' tokens any more, so each gets
        a Cancel on the bus (prefill and decode stop it and free its KV) and a final error chunk (a router
        that was only frozen, and wakes, ends it with a 503 instead of waiting for tokens that never come);
        each waiting admit is answered."""
        self.log.warning(f"router {how}: dropped what its process held", reservations=len(dropped),
                         tokens=sum(r.tokens for r in dropped), waiting=len(waiting), **where)
        for r in dropped:
            reason, rid = f"its router was {how}", r.request_id
            with contextlib.suppress(Exception):
                await self.bus.publish(self.bus.subjects.cancel(rid), Cancel(rid, reason))
                await self.bus.publish(self.bus.subjects.request_out(rid), TokenChunk(
                    rid, [], "", True, "error", None, error_info(503, f"request ended: {reason}")))
        for rid in waiting:
            await self.answer(Rejected(rid, f"the router that asked was {how}", 0.0,
                                       self.admission.settings.retry_after_s, unavailable=True))
        self.wake.set()

    def on_malformed_admit(self, err: Exception, raw: Msg) -> AdmitReply:
        self.malformed += 1
        self.log.warning("malformed admit", error=str(err), subject=raw.subject)
        return AdmitReply(request_id=request_id_of(raw.data), status="invalid", reason=str(err))

    def on_malformed(self, err: Exception, raw: Msg) -> None:
        self.malformed += 1
        self.log.warning("malformed message", error=str(err), subject=raw.subject)

    # ---- answers -----------------------------------------------------------------------------
    def reply(self, p: _Pending, outcome: Admitted | Invalid | Rejected) -> AdmitReply:
        """The AdmitReply for one admit message; ends its span and logs the decision."""
        reply = self.decide(p, outcome)
        self.record(p, reply)
        return reply

    def decide(self, p: _Pending, outcome: Admitted | Invalid | Rejected) -> AdmitReply:
        """The AdmitReply for one admit message."""
        waited_ms = (time.monotonic() - p.started) * 1000.0
        rid = outcome.request_id
        if isinstance(outcome, Admitted):
            reply = AdmitReply(rid, "admitted", decode_instance=outcome.instance, waited_ms=waited_ms)
        elif isinstance(outcome, Invalid):
            reply = AdmitReply(rid, "invalid", reason=outcome.reason, waited_ms=waited_ms)
        else:
            reply = AdmitReply(rid, "unavailable" if outcome.unavailable else "rejected", reason=outcome.reason,
                               retry_after_s=outcome.retry_after_s, waited_ms=waited_ms)
        return reply

    def record(self, p: _Pending, reply: AdmitReply) -> None:
        """End the admit's span and log the decision."""
        rid, waited_ms = reply.request_id, reply.waited_ms
        p.span.set_attributes({"decision": reply.status, "decode_instance": reply.decode_instance or "",
                               "wait_ms": waited_ms})
        with trace.use_span(p.span, end_on_exit=True):  # an admission without a wait at debug (see on_release)
            (self.log.debug if reply.status == "admitted" and waited_ms < 1.0 else self.log.info)(
                f"admission {reply.status}", request_id=rid, decode_instance=reply.decode_instance,
                reason=reply.reason or None, waited_ms=round(waited_ms, 1))

    async def answer(self, outcome: Admitted | Invalid | Rejected) -> None:
        for p in self.pending.pop(outcome.request_id, []):
            with contextlib.suppress(Exception):
                await self.bus.respond(p.raw, self.reply(p, outcome))

    async def tick(self) -> None:
        now = time.monotonic()
        for admitted in self.admission.drain(now):
            await self.answer(admitted)
        expiry = self.admission.expire(now, self.bus.heard_since(now))
        if expiry.gone or expiry.gone_waiting:
            await self.router_gone(expiry.gone, expiry.gone_waiting, "silent",
                                   silent_s=self.admission.settings.router_timeout_s)
        for rejected in expiry.rejected:
            await self.answer(rejected)
        for r in expiry.reservations:
            self.log.warning("reservation expired unreleased", request_id=r.request_id, decode_instance=r.instance,
                             tokens=r.tokens, age_s=round(now - r.admitted_at, 1))

    async def loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), TICK_S)
            self.wake.clear()
            try:
                await self.tick()
            except Exception:
                self.log.exception("gate tick failed")

    def load_report(self) -> LoadReport:
        now, a = time.monotonic(), self.admission
        live = [i for i in a.instances.values() if a.live(i, now)]
        return LoadReport(instance=self.ctx.instance, role="gate", ready=True,
                          capacity_tokens=sum(i.budget for i in live),
                          free_tokens=sum(max(0, i.budget - i.committed) for i in live),
                          running=len(a.reservations), waiting=len(a.queue),
                          detail={**a.stats(now), "malformed": self.malformed})


async def serve(ctx: ServiceContext) -> None:
    await Gate(ctx).start()
