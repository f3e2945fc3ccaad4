"""One request on the bus, as docs/protocol.md lays it out: pick a prefill, admit at the gate, subscribe
to the request's token subject, submit to the prefill, relay TokenChunks, and end it with exactly one
Release (and a Cancel when it ends before its final chunk), however it ends.

Every bus call runs with the request's `router.request` span current, so its trace context rides in the
NATS headers and the gate / prefill / decode spans join the same trace.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import nats.errors
from opentelemetry import trace

from services.router.config import RouterSettings
from services.router.metrics import RouterMetrics
from services.router.routing import LoadTable, PrefillPicker
from services.router.schemas import OpenAIError
from shared.bus import Bus
from shared.engine.tokenizer import Tokenizer
from shared.messages import Ack, AdmitReply, AdmitRequest, Cancel, MessageError, PrefillSubmit, Release, TokenChunk

_BUS_ERRORS = (asyncio.TimeoutError, nats.errors.Error)


@dataclass
class RouterState:
    """Everything a request needs: built once by main.serve (or a test)."""
    settings: RouterSettings
    bus: Bus
    tokenizer: Tokenizer
    max_context: int
    loads: LoadTable
    picker: PrefillPicker
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    clock: Callable[[], float] = time.monotonic
    live: set["Dispatch"] = field(default_factory=set)  # subscribed, not yet closed (shutdown aborts them)

    @property
    def context_limit(self) -> int:
        cap = self.settings.max_request_tokens
        return min(cap, self.max_context) if cap else self.max_context


@dataclass
class Job:
    request_id: str
    session_id: str | None
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict


class Dispatch:
    def __init__(self, state: RouterState, job: Job, span: trace.Span, log, deadline: float):
        self.state, self.job, self.span, self.log, self.deadline = state, job, span, log, deadline
        self.bus = state.bus
        self.prefill: str | None = None
        self.decode: str | None = None
        self._sub = None
        self._chunks: asyncio.Queue = asyncio.Queue()  # raw token messages, or an OpenAIError (abort)
        self._must_release = False  # the gate may hold (or be waiting on) a reservation for us
        self._submitted = False     # prefill / decode may be working on it
        self.finished = False       # the final chunk arrived
        self._closed = False

    async def start(self) -> None:
        """Admit and submit; raises OpenAIError (the caller still calls close())."""
        s, job, subjects = self.state.settings, self.job, self.bus.subjects
        self.prefill = self.state.picker.pick(job.session_id, self.state.clock(), len(job.prompt_ids),
                                              job.prompt_ids)
        if self.prefill is None:
            raise OpenAIError(503, "no prefill instance available", code="service_unavailable",
                              headers={"Retry-After": "1"})
        self.span.set_attribute("prefill_instance", self.prefill)
        decision = self.state.picker.last
        if decision is not None and decision.instance == self.prefill:
            self.state.metrics.observe_route(decision)
            self.span.set_attribute("routing_reason", decision.reason)
            if decision.resident_tokens is not None:
                self.span.set_attribute("resident_prefix_tokens", decision.resident_tokens)
        self._must_release = True  # from here on the gate may reserve for us, even if its reply is lost
        with trace.use_span(self.span, end_on_exit=False):
            try:
                reply = await self.bus.request(subjects.gate_admit, AdmitRequest(
                    job.request_id, len(job.prompt_ids), job.max_tokens), AdmitReply, timeout=s.admission_timeout_s)
            except (*_BUS_ERRORS, MessageError) as e:
                self.state.metrics.admission_rejections.labels("timeout").inc()
                raise OpenAIError(503, f"admission gate unavailable ({type(e).__name__})",
                                  code="service_unavailable", headers={"Retry-After": "1"}) from None
        self.span.set_attribute("admission_waited_ms", reply.waited_ms)
        if reply.status != "admitted":
            self._must_release = False  # nothing held: an invalid or rejected request holds no budget
            raise self._refusal(reply)
        self.decode = reply.decode_instance
        if not self.decode:
            raise OpenAIError(503, "the gate admitted the request without a decode instance")
        self.span.set_attribute("decode_instance", self.decode)

        async def on_chunk(raw) -> None:
            self._chunks.put_nowait(raw)

        self._sub = await self.bus.nc.subscribe(subjects.request_out(job.request_id), cb=on_chunk)  # before submit
        self.state.live.add(self)
        self._submitted = True  # a lost Ack may still mean the prefill took it: cancel on failure
        with trace.use_span(self.span, end_on_exit=False):
            try:
                ack = await self.bus.request(subjects.prefill_submit(self.prefill), PrefillSubmit(
                    job.request_id, job.prompt_ids, job.sampling, self.decode, job.session_id), Ack,
                    timeout=s.submit_timeout_s)
            except (*_BUS_ERRORS, MessageError) as e:
                raise OpenAIError(503, f"prefill {self.prefill} unavailable ({type(e).__name__})",
                                  code="service_unavailable", headers={"Retry-After": "1"}) from None
        if not ack.ok:
            raise OpenAIError(503, f"prefill {self.prefill} refused the request: {ack.error}",
                              code="service_unavailable", headers={"Retry-After": "1"})

    def _refusal(self, reply: AdmitReply) -> OpenAIError:
        metrics = self.state.metrics
        if reply.status == "invalid":
            metrics.admission_rejections.labels("invalid").inc()
            return OpenAIError(400, reply.reason or "the request can never be admitted")
        retry = {"Retry-After": str(max(1, math.ceil(reply.retry_after_s or 1)))}
        if reply.status == "unavailable":
            metrics.admission_rejections.labels("no_decode").inc()
            return OpenAIError(503, reply.reason, code="service_unavailable", headers=retry)
        if reply.status == "rejected":
            metrics.admission_rejections.labels("rejected").inc()
            return OpenAIError(429, reply.reason or "server busy: try again later", code="rate_limit_exceeded",
                               headers=retry)
        return OpenAIError(503, f"unexpected admission status {reply.status!r}")

    async def next_chunk(self) -> TokenChunk:
        """The next TokenChunk; OpenAIError(504) when the request's deadline passes first."""
        while True:
            left = self.deadline - self.state.clock()
            if left <= 0:
                raise OpenAIError(504, "the request timed out", code="timeout")
            try:
                raw = await asyncio.wait_for(self._chunks.get(), timeout=left)
            except asyncio.TimeoutError:
                continue  # loop re-checks the deadline
            if isinstance(raw, OpenAIError):
                raise raw
            try:
                chunk = TokenChunk.decode(raw.data)
            except MessageError as e:
                self.log.warning("malformed token chunk", error=str(e))
                continue
            if chunk.finished:
                self.finished = True
            return chunk

    def abort(self, error: OpenAIError) -> None:
        """End the wait for tokens with `error` (shutdown): the request then closes as usual."""
        self._chunks.put_nowait(error)

    async def close(self, reason: str) -> None:
        """Idempotent. Unsubscribe; Cancel if work may still be running; Release if admitted."""
        if self._closed:
            return
        self._closed = True
        self.state.live.discard(self)
        with trace.use_span(self.span, end_on_exit=False):
            if self._sub is not None:
                try:
                    await self._sub.unsubscribe()
                except Exception:
                    pass
            rid = self.job.request_id
            if self._submitted and not self.finished:
                await self._publish(self.bus.subjects.cancel(rid), Cancel(rid, reason))
            if self._must_release:
                await self._publish(self.bus.subjects.gate_release, Release(rid, reason))

    async def _publish(self, subject: str, msg) -> None:
        try:
            await self.bus.publish(subject, msg)
        except Exception as e:  # the bus is down: the gate's reservation TTL cleans up
            self.log.warning("publish failed", subject=subject, kind=msg.KIND, error=str(e))
