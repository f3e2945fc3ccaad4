"""Prefill instance: computes prompts (reusing its device prefix cache, in chunks of max batched
tokens), samples each request's first token, then hands the KV to the decode instance the router
chose. Read `serve` first: config -> engine -> transfer -> subscriptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from services.prefill.direct import DirectSender
from services.prefill.disk_loads import DiskLoader
from services.prefill.events import KVEventPublisher
from services.prefill.handoff import HandoffFailed, HandoffSender
from shared.engine.engine import Engine, StepOutput
from shared.engine.loop import EngineLoop, EngineLoopDead
from shared.engine.models import load_model
from shared.engine.sampling import SamplingParams
from shared.engine.sequence import Sequence
from shared.kv_tenant import MAX_TENANT_CHARS
from shared.holdings import ORPHAN_REASON, Served, exit_holdings, orphans
from shared.hashing import chunk_hashes
from shared.messages import (Ack, Cancel, DecodeAssign, DiskDrop, DiskSpill, HandoffDone, Holdings, InstanceExited,
                             LoadReport, SessionClose, PrefillSubmit, SessionTurn, TokenChunk, error_info, make_usage)
from shared.service import ServiceContext
from services.prefill.prefetch import Prefetcher
from shared.sessions import SessionIndex, SessionKV
from shared.tracing import get_tracer

tracer = get_tracer("moorage.prefill")


@dataclass
class Pending:
    submit: PrefillSubmit
    trace_ctx: object
    seq: Sequence | None = None          # None while its history is being restored from the pool
    handoff: asyncio.Task | None = None
    handoff_started: bool = False        # a task cancelled before it first runs never enters its finally
    cancelled: bool = False
    decode: str = ""                     # where the KV goes: the submit's decode instance, or a DecodeAssign's
    assigned: asyncio.Event = field(default_factory=asyncio.Event)  # set once `decode` is known
    finishing: bool = False              # the engine runs (or ran) the step that completes its prompt
    grant: object | None = None          # decode's pages or first slots, asked for early (the senders' pre_grant)
    grant_by: object | None = None       # the sender that asked: its send() takes the grant, or its release()
    grant_asked_ns: int = 0              # when (time.time_ns, the engine's clock): see kv.handoff grant_lead_ms
    block_hashes: list = field(default_factory=list)  # the prompt's full blocks' (its tenant's namespace): decode reuse
    since: float = field(default_factory=time.monotonic)  # when it was submitted (its router's Holdings)

    def __post_init__(self) -> None:
        self.assign(getattr(self.submit, "decode_instance", ""))

    def assign(self, decode: str) -> bool:
        """Take the decode instance (once); False if it was known already or `decode` is empty."""
        if self.decode or not decode:
            return False
        self.decode = decode
        self.assigned.set()
        return True


class PrefillService:
    def __init__(self, ctx: ServiceContext, engine: Engine, sender: HandoffSender, assign_timeout_s: float = 45.0,
                 holdings_grace_s: float = 5.0, direct: DirectSender | None = None):
        self.ctx, self.bus, self.engine, self.sender = ctx, ctx.bus, engine, sender
        self.direct = direct  # the direct handoff, tried first; the staged `sender` when a decode cannot take it
        # transfer.decode_reuse: each handoff, direct or staged, names the prompt's blocks (decode may hold some)
        self.send_hashes = (direct is not None and direct.reuse) or bool(getattr(sender, "reuse", False))
        self.assign_timeout_s = assign_timeout_s  # a submit without a decode waits this long for its DecodeAssign
        self.holdings_grace_s = holdings_grace_s  # a request its router's Holdings omit is ended once this old
        self.loop = EngineLoop(engine, self.on_outputs, on_failed=self.on_failed,
                               on_prefill_ending=self.on_prefill_ending)
        self.pending: dict[str, Pending] = {}
        self.handoff_totals = {"handoff_bytes": 0, "handoff_writes": 0, "handoffs_done": 0,  # since start (metrics)
                               "handoff_reused_blocks": 0}  # blocks decode held already (decode reuse): not sent
        self.prompt_tokens = {"device": 0, "store": 0, "computed": 0}  # prompt tokens by source, since start
        self.pool = None  # PoolConnector when the shared pool is enabled
        self.prefetch = None  # Prefetcher: sessions paused for a tool get their history back from the pool
        self.sessions = SessionIndex()  # the KV each session alone uses: freed when it is closed
        self.session_totals = {"sessions_closed": 0, "session_blocks_dropped": 0, "session_objects_removed": 0,
                               "sessions_ended": 0, "session_blocks_demoted": 0}
        self.events = None  # KVEventPublisher: a "transferred" event after each handoff
        self.tasks: set[asyncio.Task] = set()
        self.log = ctx.log

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    # ---- bus handlers ------------------------------------------------------------------------------
    async def on_submit(self, msg: PrefillSubmit, raw) -> Ack:
        if msg.request_id in self.pending:
            return Ack(msg.request_id, False, "duplicate request id")
        try:
            params = msg.sampling  # checked by its type as the message was decoded
            self.engine.check_request(msg.prompt_ids, params)
            if len(msg.tenant) > MAX_TENANT_CHARS:
                raise ValueError(f"tenant names are at most {MAX_TENANT_CHARS} characters")
        except (ValueError, TypeError) as e:
            return Ack(msg.request_id, False, str(e))
        p = self.pending[msg.request_id] = Pending(msg, self.bus.trace_context(raw))
        self._spawn(self._admit(p, params))  # ack now: a restore may take longer than the router waits
        reuse = self.send_hashes
        if msg.session_id or reuse:  # an 8K prompt hashes in 0.6 ms
            ns = self.engine.kv_namespace(msg.tenant)
            blocks = self.engine.block_manager.block_hashes(msg.prompt_ids, ns.seed if msg.tenant else None)
            p.block_hashes = blocks if reuse else []
            if msg.session_id:
                self._record_session(msg, blocks, ns.seed)
                if self.prefetch is not None:
                    self.prefetch.submitted((msg.tenant, msg.session_id), msg.prompt_ids)
        return Ack(msg.request_id, True)

    def _record_session(self, msg: PrefillSubmit, blocks: list[bytes], seed: bytes) -> None:
        """The session's latest prompt, as block hashes and chunk digests (its namespace's `seed`)."""
        chunks = chunk_hashes(msg.prompt_ids, seed, self.engine.layout.chunk_tokens) if self.pool else ()
        self.sessions.record((msg.tenant, msg.session_id), SessionKV(tuple(blocks), tuple(chunks)))

    async def on_session_close(self, msg: SessionClose, raw) -> None:
        """Free what only this session used: its blocks in the device prefix cache that no request holds, and
        its chunks' pool objects (shared/sessions.py says what "only" means)."""
        closed = self.sessions.close((msg.tenant, msg.session_id))
        if self.prefetch is not None:
            self.prefetch.forget((msg.tenant, msg.session_id))
        if not closed.known:
            return
        dropped = await self.loop.call_now(lambda: self.engine.block_manager.drop_cached(closed.blocks))
        removed = 0
        if self.pool is not None and closed.chunks:
            ns = self.engine.kv_namespace(msg.tenant)
            keys = [k for d in closed.chunks for k in self.pool.keys(d, ns)]
            try:
                removed = sum(rc == 0 for rc in await asyncio.to_thread(self.pool.client.remove, keys, True))
            except Exception as e:  # the pool's LRU takes them in time: nothing is wrong, only kept longer
                self.log.warning("session close: pool objects not removed", session_id=msg.session_id, error=str(e))
            if self.pool.disk is not None:  # and the stores' disk copies (advisory: a store's LRU takes them else)
                with contextlib.suppress(Exception):
                    await self.bus.publish(self.bus.subjects.disk_drop, DiskDrop(keys))
        t = self.session_totals
        t["sessions_closed"] += 1
        t["session_blocks_dropped"] += dropped
        t["session_objects_removed"] += removed
        self.log.info("session closed", session_id=msg.session_id, blocks_dropped=dropped, objects_removed=removed,
                      exclusive_blocks=len(closed.blocks), exclusive_chunks=len(closed.chunks))

    async def on_session_turn(self, msg: SessionTurn, raw) -> None:
        """A session's turn was answered: a save waiting for it pins or not (pool_save.py); a session whose
        answer ended its task has the device blocks only it holds evicted first (once that save let go of them)."""
        waited = self.pool is not None and self.pool.saver.turn_ended(msg)
        if msg.expected_back and self.prefetch is not None:
            self.prefetch.expect((msg.tenant, msg.session_id), msg.expect_in_s, msg.pin_s)
        if not msg.expected_back and not waited:
            await self._demote_ended((msg.tenant, msg.session_id))

    async def _demote_ended(self, key: tuple[str, str]) -> None:
        alone = self.sessions.alone(key)
        if alone:
            moved = await self.loop.call_now(lambda: self.engine.block_manager.demote(alone))
            self.session_totals["sessions_ended"] += 1
            self.session_totals["session_blocks_demoted"] += moved

    async def _admit(self, p: Pending, params: SamplingParams) -> None:
        rid, prompt = p.submit.request_id, p.submit.prompt_ids
        restored = None
        if self.pool is not None:
            try:
                restored = await self.pool.restore(rid, prompt, p.trace_ctx, p.submit.tenant)
            except Exception as e:  # the pool is an optimisation: compute instead
                self.log.warning("restore failed, computing instead", request_id=rid, error=str(e))
        pinned = restored.pinned if restored else []
        if p.cancelled:
            self._end(rid)
            await self.loop.call_now(lambda: self.engine.block_manager.release(reversed(pinned)))
            return

        def add() -> None:  # p.seq is set in the same breath as the engine takes it: no step in between
            p.seq = self.engine.add_request(rid, prompt, params, prefill_only=True, retain_kv=True,
                                            pinned_blocks=pinned,
                                            restored_range=restored.token_range if restored else (0, 0),
                                            tenant=p.submit.tenant, priority=p.submit.priority)
        try:
            await self.loop.call_now(add)  # queued at once, even while a long step computes
        except ValueError as e:
            self._end(rid)
            await self._fail(rid, 400, str(e))
            return
        except EngineLoopDead as e:
            self._end(rid)
            await self._fail(rid, 503, f"prefill engine unavailable: {e}")
            return
        if p.cancelled and rid in self.pending:  # cancelled while it was being added
            await self.loop.call(lambda: self.engine.abort(rid))
            self._end(rid)

    async def on_assign(self, msg: DecodeAssign, raw) -> None:
        """The gate admitted a request that was submitted before its answer: its KV goes to this decode.
        (A refused one gets a Cancel instead.)"""
        p = self.pending.get(msg.request_id)
        if p is None:  # finished at prefill (max_tokens reached), cancelled, or failed already
            return
        if not p.assign(msg.decode_instance):
            self.log.warning("decode assignment ignored", request_id=msg.request_id,
                             decode_instance=msg.decode_instance, assigned=p.decode)
        elif p.finishing:
            self._pre_grant(p)

    def on_prefill_ending(self, request_ids: list[str]) -> None:
        """The engine starts the step that completes these prompts: ask their decodes for pages now, so
        the grant's round trip overlaps the forward pass (a request whose decode is not known yet asks when
        its DecodeAssign comes)."""
        for rid in request_ids:
            p = self.pending.get(rid)
            if p is not None and not p.cancelled:
                p.finishing = True
                self._pre_grant(p)

    def _pre_grant(self, p: Pending) -> None:
        """The direct handoff's grant when this prefill writes into decode's pages, else the staged handoff's
        first slots."""
        if (not p.decode or p.grant is not None or p.handoff_started or p.seq is None
                or p.seq.params.max_tokens <= 1):  # the last: it ends here, no handoff
            return
        by = self.direct if self.direct is not None and self.direct.enabled else self.sender
        if by is None:
            return
        p.grant = by.pre_grant(p.decode, p.submit.request_id, len(p.submit.prompt_ids), p.trace_ctx, p.block_hashes)
        p.grant_by = by if p.grant is not None else None
        p.grant_asked_ns = time.time_ns() if p.grant is not None else 0

    def _give_back(self, p: Pending, grant) -> None:
        """An early grant no send() took goes back to its decode."""
        self._spawn(p.grant_by.release(p.decode, p.submit.request_id, grant))

    def handing_off(self) -> bool:
        """Whether a request's KV is on its way to a decode (it leaves `pending` before the handoff's release
        of its blocks pulses the engine loop, so a save waiting on that pulse sees it gone)."""
        return any(p.handoff is not None for p in self.pending.values())

    def _end(self, rid: str) -> Pending | None:
        """Forget a request; an early grant its handoff never took goes back to its decode."""
        p = self.pending.pop(rid, None)
        if p is not None and p.grant is not None:
            grant, p.grant = p.grant, None
            self._give_back(p, grant)
        return p

    async def _decode_of(self, p: Pending) -> str:
        """The request's decode instance; when the router has not sent it yet (overlapped admission: the
        gate is still deciding), wait for its DecodeAssign, traced as `prefill.assign_wait`."""
        if p.decode:
            return p.decode
        with tracer.start_as_current_span("prefill.assign_wait", context=p.trace_ctx,
                                          attributes={"request_id": p.submit.request_id}) as span:
            try:
                await asyncio.wait_for(p.assigned.wait(), self.assign_timeout_s)
            except asyncio.TimeoutError:
                span.set_status(Status(StatusCode.ERROR, "no decode instance assigned"))
                raise HandoffFailed(f"no decode instance was assigned within {self.assign_timeout_s:g} s") from None
            span.set_attribute("decode_instance", p.decode)
        return p.decode

    async def on_exited(self, msg: InstanceExited, raw) -> None:
        """A router's process ended (its supervisor said so): everything it sent here is orphaned now."""
        if msg.role == "router":
            await self.on_holdings(exit_holdings(msg), raw, grace_s=0.0)

    async def on_holdings(self, msg: Holdings, raw, grace_s: float | None = None) -> None:
        """End what the router no longer holds (shared/holdings.py), here and, by a Cancel on the bus, at
        its decode instance: e.g. a request submitted before the gate answered, whose router was killed."""
        served = [Served(rid, p.submit.router, p.since) for rid, p in self.pending.items()]
        for rid in orphans(served, msg, time.monotonic(), self.holdings_grace_s if grace_s is None else grace_s):
            self.log.warning("orphaned request ended", request_id=rid, router=msg.router)
            cancel = Cancel(rid, ORPHAN_REASON)
            await self.on_cancel(cancel, None)
            with contextlib.suppress(Exception):
                await self.bus.publish(self.bus.subjects.cancel(rid), cancel)

    async def on_cancel(self, msg: Cancel, raw) -> None:
        """Cancel stops whatever stage the request is in. It stays pending until the stage has let go:
        a step that finishes it first reaches on_outputs, which must still find it to free its KV."""
        p = self.pending.get(msg.request_id)
        if p is None:
            return
        p.cancelled = True
        if p.handoff is not None:
            if p.handoff_started:
                p.handoff.cancel()  # its finally releases the blocks
            # else it has not run yet: it sees `cancelled` first and lets go (cancelling it now would skip
            # its finally, leaking the blocks and the pending entry: found by bench/faults.py, kill -9 decode)
        elif p.seq is not None:
            await self.loop.call(lambda: self.engine.abort(msg.request_id))
            self._end(msg.request_id)
        # else still restoring or being added: _admit sees `cancelled` and lets go
        self.log.info("cancelled", request_id=msg.request_id, reason=msg.reason)

    # ---- engine outputs ----------------------------------------------------------------------------
    async def on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            p = self.pending.get(out.request_id)
            if p is None or p.seq is None:
                continue
            # A finished request's blocks are ours (retain_kv): whoever ends it releases them, after
            # the save took its own reference. The handoff releases them when it ends.
            if p.cancelled:  # finished before the abort applied
                if out.finished:
                    self.engine.block_manager.release(reversed(p.seq.block_table))
                self._end(out.request_id)
                continue
            self._trace_compute(p)
            sources = self._sources(p.seq)
            for source, n in sources.items():
                self.prompt_tokens[source] += n
            finished_here = out.finished and out.finish_reason != "prefilled"
            usage = make_usage(len(p.seq.prompt_ids), len(p.seq.output_ids), sources) if finished_here else None
            await self.bus.publish(self.bus.subjects.request_out(out.request_id), TokenChunk(
                out.request_id, out.new_token_ids, out.text_delta, finished_here,
                out.finish_reason if finished_here else None, usage, logprobs=out.logprobs))
            if self.pool is not None and self.pool.settings.save and out.finished:
                self._start_save(p)
            if finished_here:
                self._end(out.request_id)
                self.engine.block_manager.release(reversed(p.seq.block_table))
            elif out.finish_reason == "prefilled":
                p.handoff = self._spawn(self._handoff(p, sources))

    async def on_failed(self, request_ids: list[str], message: str) -> None:
        """The engine ended these requests on an error and already released their KV (retained
        blocks included): forget them and tell their clients."""
        for rid in request_ids:
            if self._end(rid) is not None:
                self.log.warning("request failed in the engine", request_id=rid, error=message)
                await self._fail(rid, 503 if self.engine.ranks_lost else 500, message)  # 503: it restarts

    def _start_save(self, p: Pending) -> None:
        """Runs between steps, while the finished sequence's retained blocks are still ours."""
        try:
            blocks = self.pool.hold_for_save(p.seq.prompt_ids, p.seq.block_table)
        except ValueError:  # a block already went back to the plain free pool: nothing to save
            return
        if blocks:
            self._spawn(self.pool.save(p.seq.request_id, p.seq.prompt_ids, blocks, p.trace_ctx, p.submit.tenant,
                                       p.submit.session_id if p.submit.retain else None))

    def _sources(self, seq: Sequence) -> dict:
        store = seq.num_store_tokens
        device = seq.num_device_cached - store
        return {"device": device, "store": store, "computed": len(seq.prompt_ids) - device - store}

    def _trace_compute(self, p: Pending) -> None:
        seq = p.seq
        queue = tracer.start_span("prefill.queue", context=p.trace_ctx, start_time=seq.arrival_ns)
        queue.set_attribute("request_id", seq.request_id)
        queue.end(end_time=seq.first_scheduled_ns or seq.first_token_ns)
        compute = tracer.start_span("prefill.compute", context=p.trace_ctx, start_time=seq.first_scheduled_ns)
        compute.set_attributes({"request_id": seq.request_id, "prompt_tokens": len(seq.prompt_ids),
                                "tokens_reused": seq.num_device_cached, "tokens_from_store": seq.num_store_tokens,
                                "tokens_computed": len(seq.prompt_ids) - seq.num_device_cached})
        compute.end(end_time=seq.first_token_ns)

    async def _handoff(self, p: Pending, sources: dict) -> None:
        p.handoff_started = True
        seq, rid = p.seq, p.seq.request_id
        early, p.grant = p.grant, None  # this handoff's now: its sender's send uses it, or the finally gives it back
        table = list(seq.block_table)
        done = HandoffDone(rid, seq.prompt_ids, seq.output_ids, seq.output_text, seq.params, sources,
                           router=p.submit.router, priority=p.submit.priority, tenant=p.submit.tenant,
                           session_id=p.submit.session_id or "")
        span = None  # kv.handoff: from when the decode instance is known
        transferred = None  # the decode the KV went to, once the handoff succeeded
        try:
            if p.cancelled:  # before it ever ran
                raise asyncio.CancelledError
            decode = await self._decode_of(p)
            span = tracer.start_span("kv.handoff", context=p.trace_ctx, attributes={
                "request_id": rid, "tokens": len(seq.prompt_ids), "decode_instance": decode})
            with trace.use_span(span, end_on_exit=False):  # decode.generate: under router.request (done_context)
                grant, early = early, None  # send owns it, however it ends
                staged = grant if p.grant_by is self.sender else None
                stats = None if self.direct is None or staged is not None else await self.direct.send(
                    decode, rid, table, len(seq.prompt_ids), done, done_context=p.trace_ctx, early=grant,
                    block_hashes=p.block_hashes)
                if stats is None:  # this prefill's pages or that decode take no direct writes
                    stats = await self.sender.send(decode, rid, table, len(seq.prompt_ids), done,
                                                  done_context=p.trace_ctx, block_hashes=p.block_hashes, early=staged)
            span.set_attributes({"bytes": stats.bytes, "writes": stats.writes, "rounds": stats.rounds,
                                 "mode": stats.mode, "early_grant": stats.early_grant, "gather_ms": stats.gather_ms,
                                 "write_ms": stats.write_ms, "scatter_ms": stats.scatter_ms, "crc_ms": stats.crc_ms,
                                 "crc_reused": stats.crc_reused, "verify_ms": stats.verify_ms,
                                 "verified_early": stats.verified_early, "grant_ms": stats.grant_ms,
                                 "done_ms": stats.done_ms, "entry_bytes": stats.entry_bytes,
                                 "reused_blocks": stats.reused_blocks, "naive_writes": self._naive_writes(seq, stats)})
            if stats.early_grant:  # > 0: asked that long before the prompt's last step ended (same clock)
                span.set_attribute("grant_lead_ms", (seq.first_token_ns - p.grant_asked_ns) / 1e6)
            self.handoff_totals["handoff_bytes"] += stats.bytes
            self.handoff_totals["handoff_writes"] += stats.writes
            self.handoff_totals["handoffs_done"] += 1
            self.handoff_totals["handoff_reused_blocks"] += stats.reused_blocks
            transferred = decode
        except asyncio.CancelledError:
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, "cancelled"))
        except Exception as e:  # decode gone, timeout, transfer error, no decode assigned: fail this request only
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, str(e)))
            self.log.warning("handoff failed", request_id=rid, error=str(e))
            await self._fail(rid, 503, f"KV handoff to decode failed: {e}")
        finally:
            if span is not None:
                span.end()
            if early is not None:  # never reached send
                self._give_back(p, early)
            self._end(rid)
            with contextlib.suppress(EngineLoopDead):  # a dead engine's blocks matter no more
                await self.loop.call_now(lambda: self.engine.block_manager.release(reversed(table)))
            if transferred is not None and self.events is not None:  # bookkeeping: after the span, the blocks let go
                self.events.emit_transferred(self.engine.block_manager.block_hashes(seq.prompt_ids, seq.hash_seed),
                                             transferred)

    def _naive_writes(self, seq: Sequence, stats) -> int:
        """What copying the KV sent as it lies would take: a write per (token, layer) (the seed's 163,840 writes of
        576 B for one 8K chunk of a 20-layer stage), beside the handoff's own count."""
        layout = self.engine.layout
        return (len(seq.prompt_ids) - stats.reused_blocks * layout.block_size) * layout.num_layers

    async def on_ranks_lost(self, reason: str) -> None:
        """A pipeline rank died: every request here fails now, with the reason, then the instance stops and exits
        non-zero so that its supervisor restarts it with all its ranks (shared/engine/pipeline.py)."""
        for rid in list(self.pending):
            await self._fail(rid, 503, f"prefill instance {self.ctx.instance} lost a pipeline rank and restarts: "
                                       f"{reason}")
        self.ctx.fail(reason)

    async def _fail(self, rid: str, status: int, message: str) -> None:
        with contextlib.suppress(Exception):
            await self.bus.publish(self.bus.subjects.cancel(rid), Cancel(rid, message))  # frees decode's landing
            await self.bus.publish(self.bus.subjects.request_out(rid), TokenChunk(
                rid, [], "", True, "error", None, error_info(status, message)))

    def load_report(self) -> LoadReport:
        e = self.engine
        queued = sum(s.num_uncomputed for s in list(e.scheduler.waiting) + e.scheduler.running)
        unhealthy = self.loop.unhealthy_reason
        return LoadReport(self.ctx.instance, "prefill", unhealthy is None, e.kv_capacity_tokens,
                          e.block_manager.num_free_blocks * e.layout.block_size, len(e.scheduler.running),
                          len(e.scheduler.waiting), queued, self.sender.transport.endpoint,
                          {"handoffs": sum(p.handoff is not None for p in self.pending.values()), **self.handoff_totals,
                           "prompt_tokens": dict(self.prompt_tokens),
                           "kv_namespace": e.namespace, "block_size": e.layout.block_size,
                           "pool": {**self.pool.counters, **(self.prefetch.counters if self.prefetch else {}),
                                    **(self.pool.disk.counters if self.pool.disk else {})}
                           if self.pool else None,
                           "pool_dtype": str(self.pool.pool_dtype).removeprefix("torch.") if self.pool else None,
                           "sessions": {"recorded": len(self.sessions.sessions), **self.session_totals},
                           "failed_steps": self.loop.failed_steps, "unhealthy": unhealthy,
                           **({"ranks": e.pipeline.ranks(), "pipeline": e.pipeline.stats.as_dict()}
                              if e.pipeline is not None else {})})

    async def stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.loop.stop()


async def serve(ctx: ServiceContext) -> None:
    cfg = ctx.config
    loaded = await asyncio.to_thread(load_model, cfg.engine.model)
    events = KVEventPublisher(ctx.bus, ctx.instance)
    engine = Engine(loaded, cfg.engine, on_kv_event=events.emit)  # prefill.pp > 1: its ranks are started here
    loaded.release_weights()  # the engine holds its own copy
    ctx.on_stop.append(lambda: asyncio.to_thread(engine.close))  # hooks run last-added first: this one last
    transport = cfg.transfer.make_transport()
    sender = HandoffSender(ctx.bus, ctx.instance, engine.layout, engine.pages, transport, cfg.transfer)
    direct = DirectSender(ctx.bus, ctx.instance, engine.layout, engine.pages, transport, cfg.transfer,
                          engine.block_manager.generation)
    svc = PrefillService(ctx, engine, sender, cfg.assign_timeout_s, cfg.holdings_grace_s, direct)
    if engine.pipeline is not None:  # a rank lost: this instance exits non-zero and is restarted, ranks and all
        engine.pipeline.call_on_loss(asyncio.get_running_loop(), svc.on_ranks_lost)
    svc.events = events
    if cfg.pool.enabled:
        from services.prefill.pool import PoolConnector
        from shared.pool import PoolClient

        client = await asyncio.to_thread(PoolClient, cfg.pool)

        async def saved(digests: list[bytes]) -> None:
            events.emit_store(digests, engine.layout.chunk_tokens)

        same_fabric = cfg.transfer.protocol == cfg.pool.protocol  # the stores are reached the transport's way
        svc.pool = PoolConnector(client, engine, svc.loop, cfg.pool, on_store_event=saved,
                                 copy_threads=cfg.transfer.copy_threads, transport=transport if same_fabric else None,
                                 register_pages=cfg.transfer.register_pages)
        svc.pool.saver.handing_off = svc.handing_off
        svc.pool.saver.after_ended = svc._demote_ended
        if cfg.pool.disk:
            disk = DiskLoader(ctx.bus, ctx.instance, cfg.pool.disk_load_timeout_s)
            await disk.start()
            svc.pool.disk = disk

            async def spill(keys: list[str], sizes: list[int]) -> None:
                await ctx.bus.publish(ctx.bus.subjects.disk_spill, DiskSpill(keys, sizes))

            svc.pool.saver.on_spill = spill
        if cfg.pool.prefetch:
            svc.prefetch = Prefetcher(svc.pool, svc._spawn, svc.sessions)
            ctx.on_stop.append(svc.prefetch.close)
        ctx.on_stop.append(lambda: asyncio.to_thread(client.close))
    svc.loop.start()
    events.start()
    s = ctx.bus.subjects
    on_bad = lambda e, raw: Ack("", False, str(e))  # noqa: E731
    await ctx.bus.subscribe(s.prefill_submit(ctx.instance), PrefillSubmit, svc.on_submit, on_error=on_bad)
    await ctx.bus.subscribe(s.prefill_assign(ctx.instance), DecodeAssign, svc.on_assign)
    await ctx.bus.subscribe(s.cancel_all, Cancel, svc.on_cancel)
    await ctx.bus.subscribe(s.session_close, SessionClose, svc.on_session_close)
    await ctx.bus.subscribe(s.session_turn, SessionTurn, svc.on_session_turn)
    await ctx.bus.subscribe(s.holdings, Holdings, svc.on_holdings)
    await ctx.bus.subscribe(s.exited_all, InstanceExited, svc.on_exited)
    ctx.load_report = svc.load_report
    ctx.on_stop.append(lambda: asyncio.to_thread(transport.close))  # hooks run last-added first
    ctx.on_stop.append(direct.close)
    ctx.on_stop.append(sender.close)
    ctx.on_stop.append(events.stop)
    ctx.on_stop.append(svc.stop)
