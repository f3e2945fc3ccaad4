"""One completion request, HTTP side: validate -> tokenize -> context check -> dispatch on the bus ->
answer as one JSON body or as an SSE stream.

Nothing reaches the bus until the request is known to be well formed, so a bad request leaves no trace
anywhere else. The response starts only after the first token arrived, so admission refusals and
errors before the first token get real HTTP statuses; later errors become one SSE error event, then
`data: [DONE]`. No plain-text 500 ever leaves: an unexpected error is an OpenAI error object too.

When an instance serving the request fails or goes away (InstanceLost: not ready, silent, no responders,
a 503 from the engines) before the client got any byte, the request is retried once on other instances
(a new Dispatch: its own bus id, reservation and Release; the failed attempt is cancelled and released
first). Afterwards, or when no other instance is there, it ends with a 503 (an SSE error event with code
`service_unavailable` mid-stream). A client that goes away (while queued at the gate, before the first
token, or mid-stream) ends the request: Dispatch.close sends Cancel and Release, exactly once per attempt.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.router.api import Api, Shaper
from services.router.api_openai import make_usage
from services.router.dispatch import Avoid, Dispatch, InstanceLost, Job, RouterState
from services.router.metrics import CLIENT_CLOSED
from services.router.prepare import prepare
from services.router.schemas import OpenAIError
from shared.logging import get_logger
from shared.messages import TokenChunk
from shared.tracing import extract_context, get_tracer

tracer = get_tracer("services.router")
_background: set[asyncio.Task] = set()  # cleanups that must finish even if their request task is cancelled
MAX_ATTEMPTS = 2
INTERNAL_ERROR = "internal error in the router"


class ClientGone(Exception):
    pass


def chunk_error(chunk: TokenChunk, dispatch: Dispatch) -> OpenAIError:
    """The client's error for an error chunk, by its status: 503 means an instance on the request's path
    failed (prefill's engine, the KV handoff to decode, a landing that timed out), so it is InstanceLost
    with a stable message; the engines' own text goes to the log only."""
    err = chunk.error or {}
    status = err.get("status")
    status = status if isinstance(status, int) and 400 <= status <= 599 else 500
    message = str(err.get("message") or "generation failed")
    if status == 503:
        dispatch.log.warning("instance failed the request", error=message)
        return InstanceLost(None, None, message, dispatch.state.retry_after("decode", dispatch.decode))
    return OpenAIError(status, message, type=err.get("type") or None)


@dataclass
class Outcome:
    """How the request ended, for _finish (set as it goes)."""
    status: int = 500
    usage: dict | None = None
    reason: str = "error"
    handed_off: bool = False  # a stream took over: it calls _finish itself


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Stream(StreamingResponse):
    """Finishes the request even when the body was never iterated (client gone before the first byte)."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # runs the generator's own finally if it is suspended
            finally:
                await self._on_close(CLIENT_CLOSED, None, "client_disconnect")  # no-op if already finished


class Generation:
    def __init__(self, state: RouterState, request: Request, api: Api):
        self.state, self.request, self.api = state, request, api
        self.endpoint = api.endpoint
        self.t0 = state.clock()
        self.request_id = f"req-{uuid.uuid4().hex}"
        h = request.headers
        self.session_id = h.get("x-session-id") or h.get("x-correlation-id") or None
        self.log = get_logger("router").bind(request_id=self.request_id, session_id=self.session_id)
        self.span = tracer.start_span(  # continues the client's trace when it sent a traceparent
            "router.request", context=extract_context(h), kind=SpanKind.SERVER, attributes={
                "request_id": self.request_id, "session_id": self.session_id or "", "endpoint": self.endpoint})
        self.dispatch: Dispatch | None = None
        self.completion_tokens = 0
        self._finished = False
        self.close_session: tuple[str, str] | None = None  # (tenant, session) to close once it ends
        self.turn: tuple[str, str, Shaper] | None = None  # (tenant, session, its shaper): SessionTurn once answered
        self._defer_finish = False  # respond() finishes the request after sending the response
        self.outcome = Outcome()

    async def respond(self, scope, receive, send) -> None:
        """Run the request and send its response (ASGI); the request is finished (Release, metrics, span,
        log) only once the client has its answer, so that work is not on the request's latency."""
        self._defer_finish = True
        try:
            response = await self.run()
            self.span.add_event("responding")  # stage mark (bench/overhead.py): the response goes out now
            await response(scope, receive, send)
        finally:
            out = self.outcome
            if not out.handed_off:
                await self._finish(out.status, out.usage, out.reason)

    async def run(self) -> Response:
        out = self.outcome = Outcome()
        try:
            job, prepared = await prepare(self.state, self.request, self.api, self.request_id, self.session_id)
            if job.session_id != self.session_id:  # named by the body or the conversation, not a header
                self.session_id = job.session_id
                self.log = self.log.bind(session_id=job.session_id)
                self.span.set_attribute("session_id", job.session_id or "")
            self.close_session = (job.tenant, job.session_id) if job.close_session and job.session_id else None
            self.span.add_event("prepared")
            self.span.set_attributes({"prompt_tokens": len(job.prompt_ids), "max_tokens": job.max_tokens,
                                      "stream": prepared.parsed.stream,
                                      "guided": bool(job.sampling.grammar)})
            self.state.metrics.open_requests.opened()
            shaper = self.api.shaper(prepared, self.request_id)
            if job.session_id and self.close_session is None and self.state.settings.retention == "session":
                self.turn = (job.tenant, job.session_id, shaper)
                pause = self.state.pauses.returned((job.tenant, job.session_id))
                if pause is not None:
                    self.span.set_attribute("tool_pause_s", round(pause, 3))
            return await self._attempts(job, prepared.parsed.stream, shaper)
        except OpenAIError as e:
            out.status, out.reason = e.status, ("timeout" if e.status == 504 else "error")
            if e.status >= 500:
                self.log.warning("request failed", status=e.status, error=e.message,
                                 **({"detail": e.detail} if isinstance(e, InstanceLost) else {}))
            e.headers.setdefault("X-Request-ID", self.request_id)
            return self.api.error_response(e)
        except ClientGone:
            out.status, out.reason = CLIENT_CLOSED, "client_disconnect"
            return Response(status_code=CLIENT_CLOSED)  # nobody reads it
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():  # this request was cancelled (server shutdown)
                out.status, out.reason = CLIENT_CLOSED, "cancelled"
                raise
            # a CancelledError that leaked out of a library: uvicorn would answer it with a plain-text 500
            self.log.warning("request interrupted")
            out.status = 503
            return self.api.error_response(OpenAIError(503, "the request was interrupted", code="service_unavailable",
                                                       headers={"Retry-After": "1", "X-Request-ID": self.request_id}))
        except Exception:
            self.log.exception("request failed")
            return self.api.error_response(OpenAIError(500, INTERNAL_ERROR, headers={"X-Request-ID": self.request_id}))
        finally:
            if not out.handed_off and not self._defer_finish:
                await self._finish(out.status, out.usage, out.reason)

    async def _attempts(self, job: Job, stream: bool, shaper: Shaper) -> Response:
        """At most MAX_ATTEMPTS dispatches: another one only after InstanceLost, while the client has
        received nothing."""
        deadline, avoid = self.t0 + self.state.settings.request_timeout_s, Avoid()
        for attempt in range(MAX_ATTEMPTS):
            self.dispatch = Dispatch(self.state, job, self.span, self.log, deadline, attempt, avoid)
            try:
                return await self._attempt(job, stream, shaper)
            except InstanceLost as lost:
                avoid = self._retry_plan(lost, attempt, deadline)
                if avoid is None:
                    raise
                self.log.warning("retrying on other instances", failed_role=lost.role,
                                 failed_instance=lost.instance, detail=lost.detail, avoid=vars(avoid))
                self.span.add_event("retry", {"failed_role": lost.role or "", "detail": lost.detail})
                self.state.metrics.retries.labels(lost.role or "unknown").inc()
                self.completion_tokens = 0
                await self.dispatch.close("retry")  # Cancel + Release of the failed attempt, once
        raise AssertionError("unreachable")

    def _retry_plan(self, lost: InstanceLost, attempt: int, deadline: float) -> Avoid | None:
        """What a retry avoids, or None when there is to be no retry (the last attempt, past the deadline,
        the router's bus lost, or no other ready instance of the role that failed)."""
        d, state = self.dispatch, self.state
        if attempt + 1 >= MAX_ATTEMPTS or state.clock() >= deadline or lost.role == "bus":
            return None
        if lost.role == "prefill":
            return Avoid(prefill=lost.instance) if state.others("prefill", lost.instance) else None
        if lost.role == "decode":
            return Avoid(decode=lost.instance) if state.others("decode", lost.instance) else None
        if lost.role == "gate":  # lost while waiting for admission: another gate may take it
            return Avoid() if state.others("gate", lost.instance) else None
        # an error chunk does not say which of the two failed: stay away from both where others are ready
        return Avoid(prefill=d.prefill if state.others("prefill", d.prefill) else None,
                     decode=d.decode if state.others("decode", d.decode) else None)

    async def _attempt(self, job: Job, stream: bool, shaper: Shaper) -> Response:
        """One dispatch up to the response: a stream once the first token is there, else the whole body."""
        out = self.outcome
        first, collected = await self._unless_gone(self._until_answer(stream))  # one disconnect watch
        headers = {"X-Request-ID": self.request_id}
        if stream:
            out.handed_off = True
            return _Stream(self._stream(first, shaper, job), self._finish, media_type="text/event-stream",
                           headers={**headers, "Cache-Control": "no-cache"})
        text, final, logprobs = collected
        shaper.add_logprobs(logprobs)
        out.usage = make_usage(final, len(job.prompt_ids), self.completion_tokens)
        out.status, out.reason = 200, "finished"
        return JSONResponse(shaper.full(text, final.finish_reason or "stop", out.usage), headers=headers)

    async def _until_answer(self, stream: bool) -> tuple[TokenChunk, tuple[str, TokenChunk, list] | None]:
        """Admit, submit and wait for the first token; without streaming also the rest (text, final chunk,
        the tokens' log-probabilities when asked)."""
        await self.dispatch.start()
        first = await self.dispatch.next_chunk()
        if first.error:
            raise chunk_error(first, self.dispatch)
        self.span.add_event("first_chunk")
        ttft = self.state.clock() - self.t0
        self.state.metrics.ttft.labels(self.endpoint).observe(ttft)
        self.span.set_attribute("ttft_ms", round(ttft * 1000, 2))
        return first, (None if stream else await self._collect(first))

    async def _unless_gone(self, coro):
        """Await coro, but give up (ClientGone) as soon as the client disconnects."""
        work = asyncio.ensure_future(coro)
        watch = asyncio.ensure_future(_wait_disconnect(self.request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if watch.done() and not watch.cancelled():
                watch.exception()  # retrieved: a failed receive counts as a disconnect
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            if watch.done() and not watch.cancelled():
                raise ClientGone()
            raise OpenAIError(503, "the request was interrupted", code="service_unavailable",
                              headers={"Retry-After": "1"})  # cancelled inside, not by the client
        return work.result()

    async def _collect(self, chunk: TokenChunk) -> tuple[str, TokenChunk, list]:
        parts, logprobs = [], []
        while True:
            if chunk.error:
                raise chunk_error(chunk, self.dispatch)
            parts.append(chunk.text)
            logprobs += _logprob_pairs(chunk)
            self.completion_tokens += len(chunk.token_ids)
            if chunk.finished:
                return "".join(parts), chunk, logprobs
            chunk = await self.dispatch.next_chunk()

    async def _stream(self, chunk: TokenChunk, shaper: Shaper, job: Job):
        status, usage, reason = CLIENT_CLOSED, None, "client_disconnect"
        try:
            if head := shaper.start():
                yield head
            while True:
                if chunk.error:
                    err = chunk_error(chunk, self.dispatch)
                    status, reason = err.status, "error"
                    yield shaper.error(err)
                    return
                self.completion_tokens += len(chunk.token_ids)
                if pairs := _logprob_pairs(chunk):
                    shaper.add_logprobs(pairs)
                if (chunk.text or pairs) and (part := shaper.delta(chunk.text)):
                    yield part
                if chunk.finished:
                    usage = make_usage(chunk, len(job.prompt_ids), self.completion_tokens)
                    status, reason = 200, "finished"
                    yield shaper.end(chunk.finish_reason or "stop", usage)
                    return
                try:
                    chunk = await self.dispatch.next_chunk()
                except OpenAIError as e:  # deadline (504), shutdown (503), an instance lost (503)
                    status, reason = e.status, ("timeout" if e.status == 504 else "error")
                    self.log.warning("stream failed", status=e.status, error=e.message,
                                     **({"detail": e.detail} if isinstance(e, InstanceLost) else {}))
                    yield shaper.error(e)
                    return
        except Exception:
            status, reason = 500, "error"
            self.log.exception("stream failed")
            yield shaper.error(OpenAIError(500, INTERNAL_ERROR))  # the client still gets an end it can parse
        finally:
            await self._finish(status, usage, reason)

    async def _finish(self, status: int, usage: dict | None, reason: str) -> None:
        """Exactly once per request; runs to completion even if the awaiting task is cancelled."""
        if self._finished:
            return
        self._finished = True
        task = asyncio.ensure_future(self._account(status, usage, reason))
        _background.add(task)
        task.add_done_callback(_background.discard)
        await asyncio.shield(task)

    async def _account(self, status: int, usage: dict | None, reason: str) -> None:
        m, elapsed = self.state.metrics, self.state.clock() - self.t0
        self.span.add_event("finishing")
        try:
            if self.dispatch is not None:
                await self.dispatch.close(reason)
        finally:
            if self.dispatch is not None:
                m.open_requests.closed()
            m.requests.labels(self.endpoint, str(status)).inc()
            attrs = {"status": status, "finish": reason, "completion_tokens": self.completion_tokens}
            if usage is not None:
                m.observe_usage(usage)
                attrs["cached_tokens"] = usage["prompt_tokens_details"]["cached_tokens"]
            if status == 200:
                m.e2e.labels(self.endpoint).observe(elapsed)
            else:
                self.span.set_status(Status(StatusCode.ERROR, reason))
            self.span.set_attributes(attrs)
            self.span.end()
            self.log.info("request done", status=status, finish=reason, duration_ms=round(elapsed * 1000, 1),
                          completion_tokens=self.completion_tokens, **({"usage": usage} if usage else {}))
            if self.close_session is not None:  # nvext.session_control close: after the request, whatever its end
                tenant, session = self.close_session
                try:
                    await self.state.close_session(session, tenant)
                except Exception as e:  # the bus is down: the KV stays until LRU takes it
                    self.log.warning("session close not sent", error=str(e))
            elif self.turn is not None and status == 200:  # answered: a tool call comes back, a final answer not
                tenant, session, shaper = self.turn
                try:
                    history = (usage["prompt_tokens"] + usage["completion_tokens"]) if usage else 0
                    await self.state.session_turn(session, tenant, shaper.called, history)
                except Exception as e:  # advisory: the KV stays in plain LRU order
                    self.log.warning("session turn not sent", error=str(e))


def _logprob_pairs(chunk: TokenChunk) -> list:
    """(token id, TokenLogprob) for each token of the chunk that came with its log-probabilities."""
    return list(zip(chunk.token_ids, chunk.logprobs)) if chunk.logprobs else []
