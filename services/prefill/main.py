"""Prefill instance: computes prompts (reusing its device prefix cache, in chunks of max batched
tokens), samples each request's first token, then hands the KV to the decode instance the router
chose. Read `serve` first: config -> engine -> transfer -> subscriptions.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from opentelemetry.trace import Status, StatusCode

from services.prefill.handoff import HandoffFailed, HandoffSender
from shared.engine.engine import Engine, StepOutput
from shared.engine.loop import EngineLoop
from shared.engine.models import load_model
from shared.engine.sampling import SamplingParams
from shared.engine.sequence import Sequence
from shared.messages import (Ack, Cancel, HandoffDone, LoadReport, PrefillSubmit, TokenChunk, error_info,
                             make_usage)
from shared.service import ServiceContext
from shared.tracing import get_tracer

tracer = get_tracer("moorage.prefill")


@dataclass
class Pending:
    submit: PrefillSubmit
    trace_ctx: object
    seq: Sequence
    handoff: asyncio.Task | None = None


class PrefillService:
    def __init__(self, ctx: ServiceContext, engine: Engine, sender: HandoffSender):
        self.ctx, self.bus, self.engine, self.sender = ctx, ctx.bus, engine, sender
        self.loop = EngineLoop(engine, self.on_outputs)
        self.pending: dict[str, Pending] = {}
        self.log = ctx.log

    # ---- bus handlers ------------------------------------------------------------------------------
    async def on_submit(self, msg: PrefillSubmit, raw) -> Ack:
        if msg.request_id in self.pending:
            return Ack(msg.request_id, False, "duplicate request id")
        try:
            params = SamplingParams.from_dict(msg.sampling)
            seq = await self.loop.call(lambda: self.engine.add_request(
                msg.request_id, msg.prompt_ids, params, prefill_only=True))
        except (ValueError, TypeError) as e:
            return Ack(msg.request_id, False, str(e))
        self.pending[msg.request_id] = Pending(msg, self.bus.trace_context(raw), seq)
        return Ack(msg.request_id, True)

    async def on_cancel(self, msg: Cancel, raw) -> None:
        p = self.pending.get(msg.request_id)
        if p is None:
            return
        if p.handoff is not None:
            p.handoff.cancel()  # its finally releases the blocks
        else:
            self.pending.pop(msg.request_id, None)
            await self.loop.call(lambda: self.engine.abort(msg.request_id))
        self.log.info("cancelled", request_id=msg.request_id, reason=msg.reason)

    # ---- engine outputs ----------------------------------------------------------------------------
    async def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            p = self.pending.get(out.request_id)
            if p is None:
                continue
            self._trace_compute(p)
            sources = self._sources(p.seq)
            finished_here = out.finished and out.finish_reason != "prefilled"
            usage = make_usage(len(p.seq.prompt_ids), len(p.seq.output_ids), sources) if finished_here else None
            await self.bus.publish(self.bus.subjects.request_out(out.request_id), TokenChunk(
                out.request_id, out.new_token_ids, out.text_delta, finished_here,
                out.finish_reason if finished_here else None, usage))
            if finished_here:
                self.pending.pop(out.request_id, None)
            elif out.finish_reason == "prefilled":
                p.handoff = asyncio.create_task(self._handoff(p, sources))

    def _sources(self, seq: Sequence) -> dict:
        device = seq.num_device_cached
        return {"device": device, "store": 0, "computed": len(seq.prompt_ids) - device}

    def _trace_compute(self, p: Pending) -> None:
        seq = p.seq
        queue = tracer.start_span("prefill.queue", context=p.trace_ctx, start_time=seq.arrival_ns)
        queue.set_attribute("request_id", seq.request_id)
        queue.end(end_time=seq.first_scheduled_ns or seq.first_token_ns)
        compute = tracer.start_span("prefill.compute", context=p.trace_ctx, start_time=seq.first_scheduled_ns)
        compute.set_attributes({"request_id": seq.request_id, "prompt_tokens": len(seq.prompt_ids),
                                "tokens_reused": seq.num_device_cached,
                                "tokens_computed": len(seq.prompt_ids) - seq.num_device_cached})
        compute.end(end_time=seq.first_token_ns)

    async def _handoff(self, p: Pending, sources: dict) -> None:
        seq, rid = p.seq, p.seq.request_id
        table = list(seq.block_table)
        done = HandoffDone(rid, seq.prompt_ids, seq.output_ids, seq.output_text, seq.params.to_dict(), sources)
        with tracer.start_as_current_span("kv.handoff", context=p.trace_ctx) as span:
            span.set_attributes({"request_id": rid, "decode_instance": p.submit.decode_instance,
                                 "tokens": len(seq.prompt_ids)})
            try:
                stats = await self.sender.send(p.submit.decode_instance, rid, table, len(seq.prompt_ids), done)
                span.set_attributes({"bytes": stats.bytes, "writes": stats.writes, "rounds": stats.rounds,
                                     "gather_ms": stats.gather_ms, "write_ms": stats.write_ms,
                                     "scatter_ms": stats.scatter_ms})
            except asyncio.CancelledError:
                span.set_status(Status(StatusCode.ERROR, "cancelled"))
            except Exception as e:  # decode gone, timeout, transfer error: fail this request only
                span.set_status(Status(StatusCode.ERROR, str(e)))
                self.log.warning("handoff failed", request_id=rid, error=str(e))
                await self._fail(rid, 503, f"KV handoff to decode failed: {e}")
            finally:
                self.pending.pop(rid, None)
                await self.loop.call(lambda: self.engine.block_manager.release(reversed(table)))

    async def _fail(self, rid: str, status: int, message: str) -> None:
        with contextlib.suppress(Exception):
            await self.bus.publish(self.bus.subjects.cancel(rid), Cancel(rid, message))  # frees decode's landing
            await self.bus.publish(self.bus.subjects.request_out(rid), TokenChunk(
                rid, [], "", True, "error", None, error_info(status, message)))

    def load_report(self) -> LoadReport:
        e = self.engine
        queued = sum(s.num_uncomputed for s in list(e.scheduler.waiting) + e.scheduler.running)
        return LoadReport(self.ctx.instance, "prefill", True, e.kv_capacity_tokens,
                          e.block_manager.num_free_blocks * e.layout.block_size, len(e.scheduler.running),
                          len(e.scheduler.waiting), queued, self.sender.transport.endpoint,
                          {"handoffs": sum(p.handoff is not None for p in self.pending.values())})

    async def stop(self) -> None:
        for p in list(self.pending.values()):
            if p.handoff:
                p.handoff.cancel()
        await self.loop.stop()


async def serve(ctx: ServiceContext) -> None:
    cfg = ctx.config
    loaded = await asyncio.to_thread(load_model, cfg.engine.model)
    engine = Engine(loaded, cfg.engine)
    transport = cfg.transfer.make_transport()
    sender = HandoffSender(ctx.bus, ctx.instance, engine.layout, engine.pages, transport, cfg.transfer)
    svc = PrefillService(ctx, engine, sender)
    svc.loop.start()
    s = ctx.bus.subjects
    on_bad = lambda e, raw: Ack("", False, str(e))  # noqa: E731
    await ctx.bus.subscribe(s.prefill_submit(ctx.instance), PrefillSubmit, svc.on_submit, on_error=on_bad)
    await ctx.bus.subscribe(s.cancel_all, Cancel, svc.on_cancel)
    ctx.load_report = svc.load_report
    ctx.on_stop.append(lambda: asyncio.to_thread(transport.close))  # hooks run last-added first
    ctx.on_stop.append(svc.stop)
