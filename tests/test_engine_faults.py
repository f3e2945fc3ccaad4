"""One failing step must fail only its requests: the engine loop goes on, every block comes back, and
a loop that does die (or hangs in a step) says so in the service's load report (issue 10).

A real tiny engine driven by EngineLoop; failures are injected into the runner, the stop check or the
scheduler, the places where a bad request or a bug raised inside `Engine.step`.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

import shared.engine.engine as engine_module
from services.decode.landing import LandingZone
from services.decode.main import DecodeService
from services.prefill.main import Pending, PrefillService
from shared.engine.engine import Engine, EngineConfig, StepFailed, StepOutput
from shared.engine.loop import EngineLoop, EngineLoopDead
from shared.engine.sampling import SamplingParams
from shared.handoff_check import checksum
from shared.logging import get_logger
from shared.messages import HandoffDone, SlotRequest, SlotsFilled, TokenChunk
from shared.transfer import LandingSlots

NUM_BLOCKS = 32
WAIT_S = 30.0
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SAMPLER_ERROR = "probability tensor contains either `inf`, `nan` or element < 0"


class Recorder:
    """on_outputs / on_failed for a bare EngineLoop; wakes waiters instead of being polled."""

    def __init__(self):
        self.outputs: list[StepOutput] = []
        self.failed: list[tuple[list[str], str]] = []
        self.changed = asyncio.Condition()

    async def on_outputs(self, outputs: list[StepOutput]) -> None:
        async with self.changed:
            self.outputs += outputs
            self.changed.notify_all()

    async def on_failed(self, request_ids: list[str], message: str) -> None:
        async with self.changed:
            self.failed.append((request_ids, message))
            self.changed.notify_all()

    async def until(self, predicate) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(predicate), WAIT_S)

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs if o.request_id == rid for t in o.new_token_ids]

    def finished(self, rid: str) -> bool:
        return any(o.finished for o in self.outputs if o.request_id == rid)


def fail_once(monkeypatch, target, name: str, error: Exception, after_calls: int = 0) -> None:
    """Make target.name raise `error` on call number after_calls + 1, then behave again."""
    real, calls = getattr(target, name), [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after_calls + 1:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, flaky)


def _ctx(role: str):
    subjects = SimpleNamespace(request_out=lambda rid: f"out.{rid}", cancel=lambda rid: f"cancel.{rid}")
    bus = SimpleNamespace(trace_context=lambda raw: None, published=[], subjects=subjects)

    async def publish(subject, msg):
        bus.published.append((subject, msg))

    bus.publish = publish
    return SimpleNamespace(bus=bus, log=get_logger(role), instance=f"{role}-0", report_soon=asyncio.Event())


def error_chunks(ctx) -> dict[str, TokenChunk]:
    return {m.request_id: m for _, m in ctx.bus.published if isinstance(m, TokenChunk) and m.error}


def reference_tokens(tiny, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    [seq] = Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS)).generate([prompt], params)
    return seq.output_ids


@pytest.fixture
def engine(tiny):
    return Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))


@pytest.fixture
async def driven(engine):
    rec = Recorder()
    loop = EngineLoop(engine, rec.on_outputs, on_failed=rec.on_failed)
    loop.start()
    yield loop, rec
    await loop.stop()


def all_free(engine: Engine) -> bool:
    engine.block_manager.check_integrity()
    return engine.block_manager.num_free_blocks == NUM_BLOCKS


# ---- Engine.step ------------------------------------------------------------------------------------
def test_step_failure_aborts_the_batch_and_names_its_requests(engine, tiny, monkeypatch):
    prompts = [tiny.tokenizer.encode(f"request number {i} " * 3) for i in range(2)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    fail_once(monkeypatch, engine.runner, "run", RuntimeError(SAMPLER_ERROR))
    with pytest.raises(StepFailed) as e:
        engine.step()
    assert sorted(e.value.request_ids) == ["r0", "r1"] and SAMPLER_ERROR in str(e.value)
    assert not engine.sequences and not engine.has_unfinished() and all_free(engine)
    [seq] = engine.generate([prompts[0]], GREEDY)  # the same engine serves the next request exactly
    assert seq.output_ids == reference_tokens(tiny, prompts[0])


def test_retained_kv_of_a_request_the_failed_step_already_finished_is_released(engine, tiny, monkeypatch):
    """Prefill-only requests keep their blocks for the caller on "prefilled"; if the step fails after
    finishing one of them, the caller never hears of it, so the engine must release those blocks."""
    for i in range(2):
        engine.add_request(f"p{i}", tiny.tokenizer.encode(f"hand me off {i} " * 4), GREEDY,
                           prefill_only=True, retain_kv=True)
    fail_once(monkeypatch, engine_module, "check_stop", ValueError("bad stop"), after_calls=1)
    with pytest.raises(StepFailed) as e:
        engine.step()
    assert sorted(e.value.request_ids) == ["p0", "p1"]
    assert all_free(engine)


# ---- EngineLoop ---------------------------------------------------------------------------------------
async def test_loop_fails_the_batch_then_serves_the_next_request_exactly(driven, engine, tiny, monkeypatch):
    loop, rec = driven
    prompts = [tiny.tokenizer.encode(f"first batch {i} " * 3) for i in range(2)]
    fail_once(monkeypatch, engine.runner, "run", RuntimeError(SAMPLER_ERROR))

    def add_both() -> None:  # one call: both join the same (failing) step
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, GREEDY)

    await loop.call(add_both)
    await rec.until(lambda: rec.failed)
    [(ids, message)] = rec.failed
    assert sorted(ids) == ["r0", "r1"] and SAMPLER_ERROR in message
    assert await loop.call(lambda: all_free(engine)) and loop.healthy and loop.failed_steps == 1

    after = tiny.tokenizer.encode("the request after the failure")
    await loop.call(lambda: engine.add_request("next", after, GREEDY))
    await rec.until(lambda: rec.finished("next"))
    assert rec.tokens("next") == reference_tokens(tiny, after)
    assert loop.healthy and await loop.call(lambda: all_free(engine))


async def test_a_failed_decode_step_fails_only_the_running_requests(driven, engine, tiny, monkeypatch):
    loop, rec = driven
    prompt = tiny.tokenizer.encode("decode then fail")
    await loop.call(lambda: engine.add_request("d", prompt, SamplingParams(max_tokens=200, ignore_eos=True)))
    await rec.until(lambda: len(rec.tokens("d")) >= 2)
    fail_once(monkeypatch, engine_module, "sample", RuntimeError(SAMPLER_ERROR))
    await rec.until(lambda: rec.failed)
    assert rec.failed[0][0] == ["d"] and not rec.finished("d")
    assert await loop.call(lambda: all_free(engine)) and loop.healthy


async def test_any_other_error_marks_the_loop_dead_and_fails_its_requests(driven, engine, tiny, monkeypatch):
    loop, rec = driven
    fail_once(monkeypatch, engine.scheduler, "schedule", AssertionError("scheduler invariant broken"))
    await loop.call(lambda: engine.add_request("r", tiny.tokenizer.encode("doomed"), GREEDY))
    await rec.until(lambda: rec.failed)
    assert rec.failed == [(["r"], "engine failed: AssertionError: scheduler invariant broken")]
    assert not loop.healthy and "scheduler invariant broken" in loop.unhealthy_reason
    with pytest.raises(EngineLoopDead):
        await loop.call(lambda: None)


# ---- services ----------------------------------------------------------------------------------------
def signal_failures(svc) -> asyncio.Event:
    """Set once the service's on_failed has run (it still runs as before)."""
    called, real = asyncio.Event(), svc.on_failed

    async def on_failed(ids, message):
        await real(ids, message)
        called.set()

    svc.loop.on_failed = on_failed
    return called


def prefill_service(engine: Engine) -> PrefillService:
    sender = SimpleNamespace(transport=SimpleNamespace(endpoint="local"))
    return PrefillService(_ctx("prefill"), engine, sender=sender)


async def test_prefill_fails_the_requests_of_a_failed_step_and_stays_ready(engine, tiny, monkeypatch):
    svc = prefill_service(engine)
    prompts = {f"r{i}": tiny.tokenizer.encode(f"prefill me {i} " * 3) for i in range(2)}
    for rid, prompt in prompts.items():
        seq = engine.add_request(rid, prompt, GREEDY, prefill_only=True, retain_kv=True)
        svc.pending[rid] = Pending(SimpleNamespace(request_id=rid, prompt_ids=prompt), None, seq)
    fail_once(monkeypatch, engine.runner, "run", RuntimeError(SAMPLER_ERROR))
    failed = signal_failures(svc)
    svc.loop.start()
    try:
        await asyncio.wait_for(failed.wait(), WAIT_S)
        errors = error_chunks(svc.ctx)
        assert set(errors) == set(prompts) and not svc.pending
        assert all(c.finished and c.finish_reason == "error" and c.error["status"] == 500 for c in errors.values())
        assert SAMPLER_ERROR in errors["r0"].error["message"]
        assert await svc.loop.call(lambda: all_free(engine))
        report = svc.load_report()
        assert report.ready and report.detail["unhealthy"] is None and report.detail["failed_steps"] == 1
    finally:
        await svc.loop.stop()


async def test_prefill_reports_not_ready_once_its_loop_is_dead(engine, tiny, monkeypatch):
    svc = prefill_service(engine)
    prompt = tiny.tokenizer.encode("the last request")
    seq = engine.add_request("r", prompt, GREEDY, prefill_only=True, retain_kv=True)
    svc.pending["r"] = Pending(SimpleNamespace(request_id="r", prompt_ids=prompt), None, seq)
    fail_once(monkeypatch, engine.scheduler, "schedule", KeyError("lost block"))
    assert svc.load_report().ready
    died = signal_failures(svc)
    svc.loop.start()
    try:
        await asyncio.wait_for(died.wait(), WAIT_S)
        report = svc.load_report()
        assert not report.ready and "lost block" in report.detail["unhealthy"]
        assert set(error_chunks(svc.ctx)) == {"r"} and not svc.pending
        later = svc.pending["later"] = Pending(SimpleNamespace(request_id="later", prompt_ids=prompt), None)
        await asyncio.wait_for(svc._admit(later, GREEDY), WAIT_S)  # refused at once, never left hanging
        assert error_chunks(svc.ctx)["later"].error["status"] == 503 and not svc.pending
    finally:
        await svc.loop.stop()


async def test_a_step_running_too_long_makes_the_service_not_ready_while_it_lasts(engine, tiny, monkeypatch):
    svc = prefill_service(engine)
    svc.loop.stall_after_s = 0.0
    entered, release = threading.Event(), threading.Event()
    real_run = engine.runner.run

    def slow_run(batch):
        entered.set()
        release.wait(WAIT_S)
        return real_run(batch)

    monkeypatch.setattr(engine.runner, "run", slow_run)
    prompt = tiny.tokenizer.encode("a slow step")
    seq = engine.add_request("r", prompt, SamplingParams(max_tokens=1), prefill_only=True, retain_kv=True)
    svc.pending["r"] = Pending(SimpleNamespace(request_id="r", prompt_ids=prompt), None, seq)
    svc.loop.start()
    try:
        assert await asyncio.to_thread(entered.wait, WAIT_S)
        report = svc.load_report()
        assert not report.ready and "running for" in report.detail["unhealthy"]
        release.set()
        await svc.loop.call(lambda: None)  # runs once the step and its outputs are done
        assert svc.load_report().ready and not svc.pending and all_free(engine)
    finally:
        release.set()
        await svc.loop.stop()


async def test_decode_fails_the_adopted_request_and_reports_when_dead(engine, tiny, monkeypatch):
    slots = LandingSlots(4, 1 << 20)
    svc = DecodeService(_ctx("decode"), engine, lambda loop: LandingZone(engine, loop, slots, "local"))
    svc.loop.start()
    try:
        zone, prompt = svc.zone, tiny.tokenizer.encode("adopt me, then fail")
        reply = await zone.grant(SlotRequest("r1", "prefill-0", len(prompt) * zone.token_bytes, len(prompt),
                                             max_slots=2))
        slot_id, n = reply.slots[0][0], len(prompt) * zone.token_bytes
        assert (await zone.filled(SlotsFilled("r1", [[slot_id, 0, n]], [checksum(zone.slots.view(slot_id, n))]))).ok
        fail_once(monkeypatch, engine.runner, "run", RuntimeError(SAMPLER_ERROR))
        failed = signal_failures(svc)
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        ack = await svc.on_landed(HandoffDone("r1", prompt, [5], "", params,
                                              {"device": 0, "store": 0, "computed": len(prompt)}), None)
        assert ack.ok
        await asyncio.wait_for(failed.wait(), WAIT_S)
        assert set(error_chunks(svc.ctx)) == {"r1"} and not svc.active
        assert await svc.loop.call(lambda: all_free(engine))
        assert svc.load_report().ready
        svc.loop.dead_reason = "RuntimeError: boom"  # what _run records when the loop dies
        report = svc.load_report()
        assert not report.ready and "boom" in report.detail["unhealthy"]
    finally:
        await svc.loop.stop()
        assert slots.num_free == 4
