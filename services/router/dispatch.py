"""One attempt at a request on the bus, as docs/protocol.md lays it out: pick a prefill, admit at the
gate, subscribe to the request's token subject, submit to the prefill, relay TokenChunks, and end it with
exactly one Release (and a Cancel when it ends before its final chunk), however it ends.

While it runs, the attempt watches its prefill (until decode has taken the request over: its second
chunk) and its decode through the router's LivenessMonitor. When one of them goes (not ready, silent,
or the router's bus lost), the attempt ends at once with `InstanceLost` (503), wherever it is waiting.
A request makes at most two attempts (generate.py); the retry runs under a bus id of its own,
`<request id>-r1`, so the first attempt's Cancel, Release and late chunks can never touch it (decode
remembers cancelled ids, and the gate treats a repeated admit of a live id as the same request).

Every bus call runs with the request's `router.request` span current, so its trace context rides in the
NATS headers and the gate / prefill / decode spans join the same trace.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import nats.errors
from opentelemetry import trace

from services.router.config import RouterSettings
from services.router.guided import Guidance
from services.router.liveness import Gone, LivenessMonitor, Watch
from services.router.metrics import RouterMetrics
from services.router.pauses import PauseTracker
from services.router.pool_turnover import PoolTurnover
from services.router.routing import LoadTable, PrefillPicker, Sticky
from services.router.schemas import OpenAIError
from services.router.tool_calls import ToolFormat, format_for
from shared.bus import Bus, PayloadTooLarge
from shared.engine.sampling import SamplingParams
from shared.engine.tokenizer import Tokenizer
from shared.messages import (Ack, AdmitReply, AdmitRequest, Cancel, DecodeAssign, MessageError, PrefillSubmit, Release,
                             SessionClose, SessionTurn, TokenChunk)

_BUS_ERRORS = (asyncio.TimeoutError, nats.errors.Error)
_ADMIT_SETTLE_S = 1.0  # a failed overlapped submit waits this long at most for its admit's answer (a gate
#                        with room answers in about a millisecond; a queued admit is then cancelled by the Release)


async def _get_within(queue: asyncio.Queue, timeout: float):
    """queue.get() within timeout s (asyncio.TimeoutError), without wait_for's extra task where asyncio.timeout
    exists (Python 3.11+)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout):
            return await queue.get()
    return await asyncio.wait_for(queue.get(), timeout)


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
    holding: set[str] = field(default_factory=set)  # bus ids the gate may hold budget for: sent as Holdings
    boot: str = field(default_factory=lambda: uuid.uuid4().hex)  # this process (load reports, admits): a restarted
    #                                                               router's gate reservations are freed by it
    instance: str = ""  # this router's name on the bus: engines match its Holdings to what it sent them
    recompute_knee_tokens: float = math.inf  # the model's (shared/engine/model_config.py): weighs a session's pin
    decode_sessions: Sticky = field(init=False)         # session -> its last decode (which holds its prompt's blocks)
    pauses: PauseTracker = field(init=False)            # tool pauses seen: they size a returning session's pool pin
    turnover: PoolTurnover = field(init=False)          # how long the pool keeps what nobody pins: what a pin must beat
    monitor: LivenessMonitor = field(init=False)        # watches the instances of in-flight requests
    guidance: Guidance = field(init=False)              # grammars for required calls and JSON answers
    tool_format: ToolFormat = field(init=False)         # how this model writes a tool call

    def __post_init__(self) -> None:
        self.guidance = Guidance(self.tokenizer)
        self.tool_format = format_for(getattr(self.tokenizer, "chat_template", ""))  # (tests build it without one)
        self.decode_sessions = Sticky(self.settings.session_idle_s)
        self.pauses = PauseTracker(self.settings.session_pin_min_s, self.settings.session_pin_max_s,
                                   knee_tokens=self.recompute_knee_tokens, clock=self.clock)
        self.turnover = PoolTurnover(clock=self.clock)
        self.monitor = LivenessMonitor(self.settings.liveness_timeout_s, self.clock, self.bus)
        self.loads.listeners.append(self.monitor.on_report)
        self.loads.exit_listeners.append(self.monitor.on_exit)

    @property
    def context_limit(self) -> int:
        cap = self.settings.max_request_tokens
        return min(cap, self.max_context) if cap else self.max_context

    async def session_turn(self, session_id: str, tenant: str, expected_back: bool, tokens: int = 0) -> None:
        """Every prefill and decode learns whether the session's last answer ended its task (its KV goes first)
        or called a tool (its new pool objects are pinned for as long as catching its return is worth the
        space: services/router/pauses.py). `tokens`: its history now, prompt and answer."""
        self.pauses.ended((tenant, session_id), expected_back, tokens)
        pin = self.pauses.pin_s(self.turnover.turnover_s(), tokens) if expected_back else 0.0
        await self.bus.publish(self.bus.subjects.session_turn,
                               SessionTurn(session_id, tenant, expected_back, pin,
                                           self.pauses.expected_s() if expected_back else 0.0))

    async def close_session(self, session_id: str, tenant: str) -> None:
        """Every prefill frees the KV only this session used; its turns no longer stick to one prefill."""
        if self.picker.sticky is not None:
            self.picker.sticky.sessions.pop(session_id, None)
        self.decode_sessions.sessions.pop(session_id, None)
        await self.bus.publish(self.bus.subjects.session_close, SessionClose(session_id, tenant))

    def others(self, role: str, instance: str | None = None) -> list[str]:
        """Ready instances of `role` that reported recently, except `instance`."""
        return [v.instance for v in self.loads.fresh(role, self.clock()) if v.instance != instance]

    def retry_after(self, role: str, instance: str | None = None) -> dict[str, str]:
        """Retry-After for a 503 the router decides itself (no gate figure): 1 s when another ready
        `role` instance is there to take a retry, else the instance timeout: the time within which a
        started or restarted instance is seen (and a silent one forgotten)."""
        wait = 1 if self.others(role, instance) else max(1, math.ceil(self.settings.instance_timeout_s))
        return {"Retry-After": str(wait)}


_LOST_MESSAGES = {
    "prefill": "the prefill instance serving this request became unavailable",
    "decode": "the decode instance serving this request became unavailable",
    "bus": "the router lost its connection to the message bus",
    "gate": "the admission gate became unavailable",
    None: "an instance serving this request became unavailable",
}


class InstanceLost(OpenAIError):
    """An instance this attempt depends on failed or went away: 503 with a stable message (the detail
    goes to logs and the span). A fresh attempt elsewhere may succeed."""

    def __init__(self, role: str | None, instance: str | None, detail: str, headers: dict[str, str]):
        super().__init__(503, _LOST_MESSAGES.get(role, _LOST_MESSAGES[None]), code="service_unavailable",
                         headers=headers)
        self.role, self.instance, self.detail = role, instance, detail


@dataclass
class Job:
    request_id: str
    session_id: str | None
    prompt_ids: list[int]
    sampling: SamplingParams  # checked once here (services/router/prepare.py) and by its type wherever it lands
    tenant: str = ""  # the API key's tenant (router.api_key_tenants): salts the request's KV namespace
    priority: int = 0     # agent hints (services/router/hints.py), higher first
    latency_s: float = 0.0
    osl: int = 0          # expected output tokens (0: unknown): the gate's reservation
    close_session: bool = False  # nvext.session_control close: the session's KV is freed once this request ends

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens


@dataclass(frozen=True)
class Avoid:
    """What a retry stays away from: the prefill, or the decode, that failed the first attempt."""
    prefill: str | None = None
    decode: str | None = None


class Dispatch:
    def __init__(self, state: RouterState, job: Job, span: trace.Span, log, deadline: float, attempt: int = 0,
                 avoid: Avoid = Avoid()):
        self.state, self.job, self.span, self.deadline = state, job, span, deadline
        self.attempt, self.avoid = attempt, avoid
        self.request_id = job.request_id if attempt == 0 else f"{job.request_id}-r{attempt}"  # on the bus
        self.log = log.bind(attempt_id=self.request_id) if attempt else log
        self.bus = state.bus
        self.prefill: str | None = None
        self.decode: str | None = None
        self._sub = None
        self._chunks: asyncio.Queue = asyncio.Queue()  # raw token messages, or an OpenAIError (abort)
        self._aborted: asyncio.Future | None = None  # done once abort() was called: `_abort_error` says why
        self._abort_error: OpenAIError | None = None
        self._watch = Watch(self._on_gone)
        self._submitted = False     # prefill / decode may be working on it
        self.started_at = state.clock()
        self.chunks = 0             # token chunks received
        self.finished = False       # the final chunk arrived
        self._closed = False

    def _decode_preference(self) -> str:
        """The decode that served this session's last turn (it keeps that prompt's blocks: the handoff then sends
        only the rest): the gate takes it when it has room now, else another. None after a decode failed."""
        if self.avoid.decode is not None or not self.job.session_id:
            return ""
        return self.state.decode_sessions.owner(self.job.session_id, self.state.clock()) or ""

    def _decode_pin(self) -> str | None:
        """After a decode failed: ask the gate for another live one (the one with the most free KV)."""
        if self.avoid.decode is None:
            return None
        others = [v for v in self.state.loads.fresh("decode", self.state.clock()) if v.instance != self.avoid.decode]
        return max(others, key=lambda v: (v.free_tokens, v.instance)).instance if others else None

    async def start(self) -> None:
        """Admit and submit; raises OpenAIError (the caller still calls close()).

        Sequential: admit at the gate, then submit with the decode instance it chose. Overlapped (when the
        gate will most likely admit at once, `_overlap`): submit with no decode instance while the gate
        decides, then send the prefill a DecodeAssign; the admit round trip then runs beside the prefill's
        work instead of before it. A refusal cancels the submitted request (close() sends the Cancel)."""
        job = self.job
        if not self.state.others("decode"):  # the gate would say so too, or wait for one if it knows none
            self.state.metrics.admission_rejections.labels("no_decode").inc()
            raise OpenAIError(503, "no decode instance available", code="service_unavailable",
                              headers=self.state.retry_after("decode"))
        self.prefill = self.state.picker.pick(job.session_id, self.state.clock(), len(job.prompt_ids),
                                              job.prompt_ids, exclude={self.avoid.prefill} - {None},
                                              tenant=job.tenant)
        if self.prefill is None:
            raise OpenAIError(503, "no prefill instance available", code="service_unavailable",
                              headers=self.state.retry_after("prefill"))
        self.span.set_attribute("prefill_instance" if not self.attempt else "retry_prefill_instance", self.prefill)
        decision = self.state.picker.last
        if decision is not None and decision.instance == self.prefill:
            self.state.metrics.observe_route(decision)
            self.span.set_attribute("routing_reason", decision.reason)
            if decision.resident_tokens is not None:
                self.span.set_attribute("resident_prefix_tokens", decision.resident_tokens)
        self.span.add_event("routed")
        self.state.holding.add(self.request_id)  # from here on the gate may reserve for us, even if its reply is lost
        if self._overlap():
            await self._start_overlapped()
        else:
            self._accept(await self._admit())
            await self._subscribe()
            await self._submit(self.decode)

    @property
    def tokens(self) -> int:
        """KV tokens the gate reserves for this request."""
        return len(self.job.prompt_ids) + self.job.max_tokens

    def _overlap(self) -> bool:
        """Whether to submit before the gate answers: only when every gate said at its last report that no
        request waits and it has the budget free for this one and for every request this router started
        since. A wrong guess costs only prefill work on a request that is then cancelled."""
        if not self.state.settings.overlap_admission:
            return False
        gates = self.state.loads.fresh("gate", self.state.clock())
        if not gates or any(g.waiting for g in gates):
            return False
        seen = min(g.seen_at for g in gates)
        since = sum(d.tokens for d in self.state.live if d.started_at >= seen)
        return min(g.free_tokens for g in gates) - since >= self.tokens  # any gate may get the admit

    async def _start_overlapped(self) -> None:
        self.span.set_attribute("admission", "overlapped")
        await self._subscribe()
        submit = asyncio.ensure_future(self._submit(""))  # first: the prefill's work is the longer path
        admit = asyncio.ensure_future(self._admit())
        try:
            await asyncio.wait({admit, submit}, return_when=asyncio.FIRST_EXCEPTION)
            if submit.done() and submit.exception() is not None and not admit.done():
                # The gate handles admits and releases on two subscriptions, so a Release sent now could
                # reach it before this admit does (a gone prefill fails the submit at once): wait for the
                # gate's answer, so the Release finds the reservation it frees.
                await asyncio.wait({admit}, timeout=_ADMIT_SETTLE_S)
        finally:
            for task in (admit, submit):
                task.cancel()  # no-op when done
            await asyncio.gather(admit, submit, return_exceptions=True)
        for task in (admit, submit):  # the gate's refusal, if any, is the answer
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        reply = admit.result()
        self.state.metrics.overlapped.labels("admitted" if reply.status == "admitted" else "refused").inc()
        self._accept(reply)
        with trace.use_span(self.span, end_on_exit=False):
            try:
                await self.bus.publish(self.bus.subjects.prefill_assign(self.prefill),
                                       DecodeAssign(self.request_id, self.decode))
            except _BUS_ERRORS as e:
                raise InstanceLost("bus", None, f"decode assignment not sent: {type(e).__name__}",
                                   self.state.retry_after("prefill")) from None
        self.span.add_event("assigned")

    async def _admit(self) -> AdmitReply:
        s, job, rid = self.state.settings, self.job, self.request_id
        # A gate that dies (or a bus that goes) while it holds our admit never answers: the wait ends when
        # the liveness monitor says a gate is gone, not after admission_timeout_s.
        gates = [v.instance for v in self.state.loads.fresh("gate", self.state.clock())]
        for gate in gates:
            self.state.monitor.watch(self._watch, "gate", gate)
        with trace.use_span(self.span, end_on_exit=False):
            try:
                reply = await self._unless_aborted(self.bus.request(self.bus.subjects.gate_admit, AdmitRequest(
                    rid, len(job.prompt_ids), job.max_tokens, self._decode_pin(), router_boot=self.state.boot,
                    priority=job.priority, latency_s=job.latency_s, osl=job.osl, prefer_decode=self._decode_preference()),
                    AdmitReply, timeout=s.admission_timeout_s))
            except (*_BUS_ERRORS, MessageError) as e:
                self.state.metrics.admission_rejections.labels("timeout").inc()
                raise OpenAIError(503, f"admission gate unavailable ({type(e).__name__})",
                                  code="service_unavailable", headers=self.state.retry_after("gate")) from None
            finally:
                for gate in gates:
                    self.state.monitor.unwatch(self._watch, "gate", gate)
        self.span.add_event("admitted")  # stage marks: bench/overhead.py breaks latency down by them
        self.span.set_attribute("admission_waited_ms", reply.waited_ms)
        return reply

    def _accept(self, reply: AdmitReply) -> None:
        """Take the gate's answer: the decode instance, watched from now on; else the refusal, raised."""
        if reply.status != "admitted":
            self.state.holding.discard(self.request_id)  # nothing held: an invalid or rejected request holds no budget
            raise self._refusal(reply)
        self.decode = reply.decode_instance
        if not self.decode:
            raise OpenAIError(503, "the gate admitted the request without a decode instance")
        if self.job.session_id:
            self.state.decode_sessions.remember(self.job.session_id, self.decode, self.state.clock())
        self.span.set_attribute("decode_instance" if not self.attempt else "retry_decode_instance", self.decode)
        self.state.monitor.watch(self._watch, "decode", self.decode)  # fires at once if it is known gone
        if self._abort_error is not None:  # known gone already
            raise self._abort_error

    async def _subscribe(self) -> None:
        async def on_chunk(raw) -> None:
            self._chunks.put_nowait(raw)

        self._sub = await self.bus.nc.subscribe(self.bus.subjects.request_out(self.request_id), cb=on_chunk)
        self.span.add_event("subscribed")  # before submit: no chunk can be missed
        self.state.live.add(self)

    async def _submit(self, decode: str) -> None:
        """PrefillSubmit and its Ack; `decode` "" = a DecodeAssign follows (overlapped admission)."""
        s, job, rid = self.state.settings, self.job, self.request_id
        # session retention: a SessionTurn will say how this turn ended (its pool objects' pin waits for it)
        retain = bool(job.session_id) and s.retention == "session" and not job.close_session
        self.state.monitor.watch(self._watch, "prefill", self.prefill)  # fires at once if it is known gone
        if self._abort_error is not None:
            raise self._abort_error
        self._submitted = True  # a lost Ack may still mean the prefill took it: cancel on failure
        with trace.use_span(self.span, end_on_exit=False):
            try:
                ack = await self._unless_aborted(self.bus.request(self.bus.subjects.prefill_submit(self.prefill),
                    PrefillSubmit(rid, job.prompt_ids, job.sampling, decode, job.session_id, job.tenant,
                                  self.state.instance, job.priority, retain), Ack,
                    timeout=s.submit_timeout_s))
            except PayloadTooLarge as e:  # prepare() checks the size first: only a smaller server cap gets here
                raise OpenAIError(413, f"the request is too large for the message bus: {e}",
                                  code="request_too_large") from None
            except _BUS_ERRORS as e:  # no responders (it is gone) or no Ack in time
                raise InstanceLost("prefill", self.prefill, f"submit failed: {type(e).__name__}",
                                   self.state.retry_after("prefill", self.prefill)) from None
            except MessageError as e:
                raise OpenAIError(503, f"prefill {self.prefill} sent a malformed Ack",
                                  code="service_unavailable", headers=self.state.retry_after("prefill")) from e
        self.span.add_event("acked")
        if not ack.ok:
            raise OpenAIError(503, f"prefill {self.prefill} refused the request: {ack.error}",
                              code="service_unavailable", headers=self.state.retry_after("prefill"))

    def _refusal(self, reply: AdmitReply) -> OpenAIError:
        metrics = self.state.metrics
        if reply.status == "invalid":
            metrics.admission_rejections.labels("invalid").inc()
            return OpenAIError(400, reply.reason or "the request can never be admitted")
        retry = {"Retry-After": str(max(1, math.ceil(reply.retry_after_s or 1)))}  # the gate's estimate
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
                raw = self._chunks.get_nowait() if not self._chunks.empty() else await _get_within(self._chunks, left)
            except asyncio.TimeoutError:
                continue  # loop re-checks the deadline
            if isinstance(raw, OpenAIError):
                raise raw
            try:
                chunk = TokenChunk.decode(raw.data)
            except MessageError as e:
                self.log.warning("malformed token chunk", error=str(e))
                continue
            self.chunks += 1
            if chunk.finished:
                self.finished = True
            if (self.chunks >= 2 or chunk.finished) and self.prefill is not None:
                # prefill sends the first token, decode every later one: prefill's part is done
                self.state.monitor.unwatch(self._watch, "prefill", self.prefill)
            return chunk

    def abort(self, error: OpenAIError) -> None:
        """End this attempt with `error` wherever it waits (its Ack or its tokens; chunks that already
        arrived come first): the request then closes as usual. The first abort wins."""
        if self._abort_error is not None:
            return
        self._abort_error = error
        if self._aborted is not None and not self._aborted.done():
            self._aborted.set_result(None)
        self._chunks.put_nowait(error)

    def _on_gone(self, gone: Gone) -> None:
        """The liveness monitor says an instance of this attempt is gone (called once)."""
        self.log.warning("instance lost", lost_role=gone.role, lost_instance=gone.instance, reason=gone.reason)
        self.span.add_event("instance_lost", {"role": gone.role, "instance": gone.instance, "reason": gone.reason})
        role = gone.role if gone.role in ("prefill", "decode", "gate") else None
        headers = self.state.retry_after(role, gone.instance) if role else self.state.retry_after("decode")
        self.abort(InstanceLost(gone.role, gone.instance, gone.reason, headers))

    async def _unless_aborted(self, coro):
        """Await coro, unless abort() comes first: then raise its error."""
        if self._aborted is None:  # one future per attempt, shared by its waits (no waiter task per call)
            self._aborted = asyncio.get_running_loop().create_future()
            if self._abort_error is not None:
                self._aborted.set_result(None)
        work = asyncio.ensure_future(coro)
        try:
            await asyncio.wait({work, self._aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled() and self._abort_error is not None:
            raise self._abort_error
        return work.result()

    async def close(self, reason: str) -> None:
        """Idempotent. Unsubscribe; Cancel if work may still be running; Release if admitted."""
        if self._closed:
            return
        self._closed = True
        self.state.live.discard(self)
        self.state.monitor.unwatch(self._watch)
        with trace.use_span(self.span, end_on_exit=False):
            if self._sub is not None:
                try:
                    await self._sub.unsubscribe()
                except Exception:
                    pass
            rid = self.request_id
            if self._submitted and not self.finished:
                await self._publish(self.bus.subjects.cancel(rid), Cancel(rid, reason))
            if rid in self.state.holding:
                await self._publish(self.bus.subjects.gate_release, Release(rid, reason))
                self.state.holding.discard(rid)  # a Release lost with the bus: the next Holdings frees it

    async def _publish(self, subject: str, msg) -> None:
        try:
            await self.bus.publish(subject, msg)
        except Exception as e:  # the bus is down: the router's next Holdings frees the budget
            self.log.warning("publish failed", subject=subject, kind=msg.KIND, error=str(e))
