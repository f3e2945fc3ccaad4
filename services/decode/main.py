"""Decode instance: lands handed-off KV, adopts each request into continuous batching, and streams
tokens to the router. Read `serve` first: config -> engine -> its pages and landing slots -> subscriptions.

Tracing: one `decode.generate` span per request, from HandoffDone to the last token (its parent is the
request's router.request span, carried in HandoffDone's headers), with the token count, first-token
time and inter-token gap stats as attributes: never a span per token. The handoff adds
`decode.page_grant` (the direct handoff, services/decode/direct.py: usually asked for during prefill's
compute, a child of router.request then) or the landing zone's `decode.slot_grant` / `decode.scatter`
spans (the staged one; its first slot grant is asked for during prefill's compute likewise). A handoff is
acked as soon as its KV is verified and ours; the engine adopts the request right after (`_adopt`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from opentelemetry.trace import Status, StatusCode

from services.decode.direct import DirectPages
from services.decode.landing import LandingZone
from shared.engine.engine import Engine, StepOutput
from shared.engine.loop import EngineLoop, EngineLoopDead
from shared.engine.models import load_model
from shared.engine.sampling import SamplingParams
from shared.handoff_check import LandingFaults
from shared.holdings import ORPHAN_REASON, Served, exit_holdings, orphans
from shared.messages import (Ack, Cancel, HandoffDone, Holdings, InstanceExited, LoadReport, PagesGrant, PagesLanded,
                             PagesReleased, PagesRequest, SessionClose, SessionTurn, SlotGrant, SlotRequest, SlotsFilled,
                             TokenChunk, error_info, make_usage)
from shared.service import ServiceContext
from shared.sessions import SessionIndex, SessionKV
from shared.tracing import get_tracer
from shared.transfer import KVTransport, LandingSlots

tracer = get_tracer("moorage.decode")


@dataclass
class Active:
    prompt_tokens: int
    sources: dict
    span: object
    adopted: float
    router: str = ""                                 # the router instance it came from (its Holdings)
    first_token_ms: float | None = None
    tokens: int = 0
    last: float = 0.0                                # monotonic time of the latest step's tokens
    gaps_ms: list[float] = field(default_factory=list)  # between successive steps' tokens (one float each)

    def on_tokens(self, n: int, now: float) -> None:
        self.tokens += n
        if self.first_token_ms is None:
            self.first_token_ms = (now - self.adopted) * 1e3
        else:
            self.gaps_ms.append((now - self.last) * 1e3)
        self.last = now

    def summary(self) -> dict:
        out = {"decode_tokens": self.tokens, "first_token_ms": self.first_token_ms or 0.0}
        if self.gaps_ms:
            g = np.asarray(self.gaps_ms)
            p50, p90, p99 = np.percentile(g, [50, 90, 99])
            out.update({"itl_mean_ms": float(g.mean()), "itl_p50_ms": float(p50), "itl_p90_ms": float(p90),
                        "itl_p99_ms": float(p99), "itl_max_ms": float(g.max())})
        return out


class DecodeService:
    def __init__(self, ctx: ServiceContext, engine: Engine, zone_factory, holdings_grace_s: float = 5.0,
                 transport: KVTransport | None = None, direct: bool = False, register_pages: bool = True):
        self.ctx, self.bus, self.engine = ctx, ctx.bus, engine
        self.holdings_grace_s = holdings_grace_s  # a request its router's Holdings omit is ended once this old
        self.loop = EngineLoop(engine, self.on_outputs, on_failed=self.on_failed)
        self.zone: LandingZone = zone_factory(self.loop)
        # the direct handoff: prefill writes into our pages (registered with `transport`) when `direct`
        self.direct = DirectPages(self.zone, transport, enabled=direct and transport is not None,
                                  register_pages=register_pages)
        self.active: dict[str, Active] = {}
        self.adopting: set[asyncio.Task] = set()  # acked handoffs the engine is taking
        self.sessions = SessionIndex()  # the prompt blocks each session alone has here (decode reuse): freed on close
        self.session_totals = {"sessions_closed": 0, "session_blocks_dropped": 0, "sessions_ended": 0,
                               "session_blocks_demoted": 0}
        self.log = ctx.log

    async def on_landed(self, msg: HandoffDone, raw) -> Ack:
        """The KV is in: verified and taken from the zone, it is ours, and the Ack says so at once; the
        engine adopts the request after (`_adopt`), so prefill's blocks go back without waiting for it."""
        rid, stats = msg.request_id, {}
        try:
            if msg.pages:  # written straight into our pages: verified here (services/decode/direct.py)
                landing, timing = await self.direct.land(msg)
                stats.update(timing)
            else:
                landing = await self.zone.take_when_landed(msg)  # prefill sends this with the last SlotsFilled
        except (KeyError, ValueError) as e:
            await self.zone.drop(rid)
            return Ack(rid, False, f"cannot adopt: {e}")
        try:
            params = msg.sampling  # checked by its type as the message was decoded
            self.engine.check_request(msg.prompt_ids, params)
        except (ValueError, TypeError) as e:
            await self.loop.call(lambda: self.engine.block_manager.release(landing.blocks))
            return Ack(rid, False, str(e))
        span = tracer.start_span("decode.generate", context=self.bus.trace_context(raw))
        span.set_attributes({"request_id": rid, "prompt_tokens": len(msg.prompt_ids)})
        task = asyncio.create_task(self._adopt(msg, params, landing.blocks, span))
        self.adopting.add(task)
        task.add_done_callback(self.adopting.discard)
        return Ack(rid, True, stats=stats)

    async def _adopt(self, msg: HandoffDone, params: SamplingParams, blocks: list[int], span) -> None:
        """The engine takes the request (between two steps). What fails here fails the request from decode:
        prefill has already let go of it."""
        rid = msg.request_id
        try:
            await self.loop.call(lambda: self.engine.adopt_prefilled(
                rid, msg.prompt_ids, msg.output_ids, params, blocks, msg.shown_text, msg.priority, msg.tenant))
        except (ValueError, TypeError, EngineLoopDead) as e:
            if not isinstance(e, EngineLoopDead):
                await self.loop.call(lambda: self.engine.block_manager.release(blocks))
            span.set_status(Status(StatusCode.ERROR, str(e)))
            span.end()
            self.log.warning("adoption failed", request_id=rid, error=str(e))
            with contextlib.suppress(Exception):
                await self.bus.publish(self.bus.subjects.request_out(rid), TokenChunk(
                    rid, [], "", True, "error", None, error_info(500, f"decode could not adopt the request: {e}")))
            return
        if self.zone.is_cancelled(rid):  # the cancel came while the engine was adopting it
            await self.loop.call(lambda: self.engine.abort(rid))
            span.set_attribute("cancelled", True)
            span.end()
            return
        self.active[rid] = Active(len(msg.prompt_ids), msg.token_sources, span, time.monotonic(), msg.router)
        if msg.session_id and self.zone.reuse:  # its prompt's blocks stay here after it ends: a close frees them
            seed = self.engine.kv_namespace(msg.tenant).seed if msg.tenant else None
            blocks = self.engine.block_manager.block_hashes(msg.prompt_ids, seed)
            self.sessions.record((msg.tenant, msg.session_id), SessionKV(tuple(blocks)))

    async def on_session_close(self, msg: SessionClose, raw) -> None:
        """Free the prompt blocks this session alone kept here that no request holds (shared/sessions.py)."""
        closed = self.sessions.close((msg.tenant, msg.session_id))
        if not closed.known:
            return
        with contextlib.suppress(EngineLoopDead):
            dropped = await self.loop.call_now(lambda: self.engine.block_manager.drop_cached(closed.blocks))
            self.session_totals["sessions_closed"] += 1
            self.session_totals["session_blocks_dropped"] += dropped
            self.log.info("session closed", session_id=msg.session_id, blocks_dropped=dropped)

    async def on_session_turn(self, msg: SessionTurn, raw) -> None:
        """A session whose answer ended its task: the prompt blocks only it kept here go first (before the
        blocks of sessions that called a tool and are expected back)."""
        alone = None if msg.expected_back else self.sessions.alone((msg.tenant, msg.session_id))
        if alone:
            with contextlib.suppress(EngineLoopDead):
                moved = await self.loop.call_now(lambda: self.engine.block_manager.demote(alone))
                self.session_totals["sessions_ended"] += 1
                self.session_totals["session_blocks_demoted"] += moved

    async def on_cancel(self, msg: Cancel, raw) -> None:
        dropped = await self.zone.drop(msg.request_id)
        a = self.active.pop(msg.request_id, None)
        if a is not None:
            await self.loop.call(lambda: self.engine.abort(msg.request_id))
            self.ctx.report_soon.set()
            a.span.set_attributes({"cancelled": True, **a.summary()})
            a.span.end()
        if dropped or a is not None:
            self.log.info("cancelled", request_id=msg.request_id, reason=msg.reason)

    async def on_exited(self, msg: InstanceExited, raw) -> None:
        """A process ended (its supervisor said so): everything a router sent here is orphaned now, and the
        blocks a prefill was writing into are its no more."""
        if msg.role == "router":
            await self.on_holdings(exit_holdings(msg), raw, grace_s=0.0)
        elif msg.role == "prefill":
            ended = await self.zone.writer_exited(msg.instance)
            if ended:
                self.log.info("writer exited: its grants end", prefill_instance=msg.instance, requests=len(ended))

    async def on_holdings(self, msg: Holdings, raw, grace_s: float | None = None) -> None:
        """Stop generating what the router no longer holds (shared/holdings.py): its router was restarted."""
        served = [Served(rid, a.router, a.adopted) for rid, a in self.active.items()]
        for rid in orphans(served, msg, time.monotonic(), self.holdings_grace_s if grace_s is None else grace_s):
            self.log.warning("orphaned request ended", request_id=rid, router=msg.router)
            await self.on_cancel(Cancel(rid, ORPHAN_REASON), None)

    async def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            a = self.active.get(out.request_id)
            if a is None:
                continue
            a.on_tokens(len(out.new_token_ids), time.monotonic())
            usage = None
            if out.finished:
                self.active.pop(out.request_id, None)
                self.ctx.report_soon.set()  # its KV is free: the gate counts our reported free KV
                completion = a.tokens + 1  # plus the first token, sampled by prefill
                usage = make_usage(a.prompt_tokens, completion, a.sources)
                a.span.set_attributes({"completion_tokens": completion, "finish_reason": out.finish_reason or "",
                                       **a.summary()})
                a.span.end()
            await self.bus.publish(self.bus.subjects.request_out(out.request_id), TokenChunk(
                out.request_id, out.new_token_ids, out.text_delta, out.finished, out.finish_reason, usage,
                logprobs=out.logprobs))

    async def on_failed(self, request_ids: list[str], message: str) -> None:
        """The engine ended these requests on an error and already released their KV."""
        for rid in request_ids:
            a = self.active.pop(rid, None)
            if a is None:
                continue
            self.log.warning("request failed in the engine", request_id=rid, error=message)
            a.span.set_attributes({"error": message, **a.summary()})
            a.span.set_status(Status(StatusCode.ERROR, message))
            a.span.end()
            with contextlib.suppress(Exception):
                await self.bus.publish(self.bus.subjects.request_out(rid), TokenChunk(  # 503: it restarts
                    rid, [], "", True, "error", None, error_info(503 if self.engine.ranks_lost else 500, message)))

    async def on_ranks_lost(self, reason: str) -> None:
        """A context-parallel rank died: every request decoding here fails now, with the reason, then the instance
        stops and exits non-zero so that its supervisor restarts it with all its ranks."""
        await self.on_failed(list(self.active), f"decode instance {self.ctx.instance} lost a context-parallel rank "
                                                f"and restarts: {reason}")
        self.ctx.fail(reason)

    async def expire_landings(self) -> None:
        timeout = self.ctx.config.transfer.timeout_s
        while not self.ctx.stop.is_set():
            for rid in await self.zone.expire(timeout):
                self.log.warning("handoff abandoned: KV freed", request_id=rid)
                with contextlib.suppress(Exception):
                    await self.bus.publish(self.bus.subjects.request_out(rid), TokenChunk(
                        rid, [], "", True, "error", None, error_info(503, "KV handoff timed out")))
            wait = max(0.01, self.zone.next_expiry(timeout) - time.monotonic())  # a deadline, not a tick
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ctx.stop.wait(), timeout=wait)

    def load_report(self) -> LoadReport:
        e = self.engine
        free = e.block_manager.num_free_blocks * e.layout.block_size
        unhealthy = self.loop.unhealthy_reason
        return LoadReport(self.ctx.instance, "decode", unhealthy is None, e.kv_capacity_tokens, free,
                          len(e.scheduler.running), len(e.scheduler.waiting), 0, self.zone.endpoint,
                          {"landing": len(self.zone.landings), "free_slots": self.zone.slots.num_free,
                           "quarantined": len(self.zone.quarantine),
                           "preemptions": e.stats.preemptions, "failed_steps": self.loop.failed_steps,
                           "unhealthy": unhealthy, "retained_blocks": e.block_manager.num_cached_blocks,
                           "sessions": {"recorded": len(self.sessions.sessions), **self.session_totals},
                           **self.zone.reuse_counters, **self.zone.checks.detail(),
                           **({"decode_graphs": asdict(e.runner.graphs.stats)} if e.runner.graphs else {}),
                           **({"ranks": e.context.ranks()} if e.context is not None else {})})

    async def stop(self) -> None:
        await asyncio.gather(*self.adopting, return_exceptions=True)
        await self.loop.stop()
        for a in self.active.values():
            a.span.end()


async def serve(ctx: ServiceContext) -> None:
    cfg = ctx.config
    loaded = await asyncio.to_thread(load_model, cfg.engine.model)
    engine = Engine(loaded, cfg.engine)  # decode.dcp > 1: its ranks are started here
    loaded.release_weights()  # the engine holds its own copy
    ctx.on_stop.append(lambda: asyncio.to_thread(engine.close))  # hooks run last-added first: this one last
    transport = cfg.transfer.make_transport()
    slots = LandingSlots(cfg.transfer.slots, cfg.transfer.slot_bytes, transport, engine.pages[0].device)
    faults = LandingFaults.from_env()  # off unless a test sets MOORAGE_FAULT_CORRUPT_LANDING
    if faults.corrupt_pieces:
        ctx.log.warning("fault injection on: corrupting landed KV", pieces=faults.corrupt_pieces)
    svc = DecodeService(ctx, engine, lambda loop: LandingZone(engine, loop, slots, transport.endpoint, faults,
                                                                   cfg.transfer.copy_threads,
                                                                   cfg.transfer.register_pages,
                                                                   cfg.transfer.decode_reuse),
                        cfg.holdings_grace_s, transport, cfg.transfer.direct, cfg.transfer.register_pages)
    if engine.context is not None:  # a rank lost: this instance exits non-zero and is restarted, ranks and all
        engine.context.call_on_loss(asyncio.get_running_loop(), svc.on_ranks_lost)
    svc.loop.start()
    s = ctx.bus.subjects
    await ctx.bus.subscribe(s.decode_slots(ctx.instance), SlotRequest, svc.zone.grant,  # a grant may wait for room
                            on_error=lambda e, raw: SlotGrant("", error=str(e), fatal=True), concurrent=True)
    await ctx.bus.subscribe(s.decode_pages(ctx.instance), PagesRequest, svc.direct.grant,  # may wait for room too
                            on_error=lambda e, raw: PagesGrant("", error=str(e), fatal=True), concurrent=True)
    await ctx.bus.subscribe(s.decode_pages_released(ctx.instance), PagesReleased, svc.direct.released)
    await ctx.bus.subscribe(s.decode_pages_landed(ctx.instance), PagesLanded, svc.direct.landed)
    await ctx.bus.subscribe(s.decode_filled(ctx.instance), SlotsFilled, svc.zone.filled,
                            on_error=lambda e, raw: Ack("", False, str(e)))
    await ctx.bus.subscribe(s.decode_landed(ctx.instance), HandoffDone, svc.on_landed,
                            on_error=lambda e, raw: Ack("", False, str(e)))
    await ctx.bus.subscribe(s.cancel_all, Cancel, svc.on_cancel)
    await ctx.bus.subscribe(s.holdings, Holdings, svc.on_holdings)
    await ctx.bus.subscribe(s.session_close, SessionClose, svc.on_session_close)
    await ctx.bus.subscribe(s.session_turn, SessionTurn, svc.on_session_turn)
    await ctx.bus.subscribe(s.exited_all, InstanceExited, svc.on_exited)
    expiry = asyncio.create_task(svc.expire_landings())
    ctx.load_report = svc.load_report

    async def close() -> None:
        expiry.cancel()
        await svc.stop()
        slots.close()
        await asyncio.to_thread(transport.close)

    ctx.on_stop.append(close)
