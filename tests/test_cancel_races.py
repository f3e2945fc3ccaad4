"""A Cancel that overtakes the other messages of its request must not leak KV.

NATS runs each subscription's handler as its own task, so a Cancel can arrive while decode is
allocating a landing, scattering into it or adopting it, or while prefill's engine is finishing the
very step that hands the request off. Each test below pins one such interleaving (the engine loop's
order is: step -> on_outputs -> calls queued meanwhile) with a real tiny engine and checks that every
block comes back. These are the leaks a client disconnect used to leave behind.
"""

from __future__ import annotations

import asyncio
import pytest

from services.decode.landing import LandingZone
from services.prefill.main import Pending, PrefillService
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.handoff_check import checksum
from shared.messages import Cancel, HandoffDone, PrefillSubmit, SlotRequest, SlotsFilled
from tests.decode_zone import running_decode, service_ctx

NUM_BLOCKS = 32


@pytest.fixture
def engine(tiny):
    return Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))


@pytest.fixture
async def decode(engine):
    async with running_decode(engine) as svc:
        yield svc


def _slot_request(zone: LandingZone, rid: str, num_tokens: int) -> SlotRequest:
    return SlotRequest(rid, "prefill-0", num_tokens * zone.token_bytes, num_tokens, max_slots=2)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_cancel_during_grant_frees_the_new_landing(decode, engine):
    zone = decode.zone
    grant = asyncio.create_task(zone.grant(_slot_request(zone, "r1", 40)))
    await asyncio.sleep(0)  # the grant now waits for its blocks from the engine loop
    assert not await zone.drop("r1")  # nothing landed yet
    reply = await grant
    assert reply.error and "cancelled" in reply.error and not reply.slots
    assert "r1" not in zone.landings and engine.block_manager.num_free_blocks == NUM_BLOCKS
    late = await zone.grant(_slot_request(zone, "r1", 40))  # a retry after the cancel is refused too
    assert late.error and not late.slots and engine.block_manager.num_free_blocks == NUM_BLOCKS


async def test_blocks_stay_out_of_reach_while_a_scatter_writes_them(decode, engine):
    zone = decode.zone
    reply = await zone.grant(_slot_request(zone, "r1", 40))
    slot_id = reply.slots[0][0]
    blocks = list(zone.landings["r1"].blocks)
    n = 16 * zone.token_bytes
    filled = asyncio.create_task(zone.filled(SlotsFilled("r1", [[slot_id, 0, n]], [checksum(zone.slots.view(slot_id, n))])))
    await asyncio.sleep(0)  # the scatter is running in a worker thread
    assert zone.landings["r1"].scattering == 1
    assert await zone.drop("r1")
    free = set(engine.block_manager._plain_free) | set(engine.block_manager._cached_free)
    assert not free & set(blocks), "blocks freed while a scatter still writes into them"
    ack = await filled
    assert not ack.ok and "cancelled" in ack.error
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


async def test_cancel_during_adoption_aborts_the_adopted_request(decode, engine, tiny):
    zone = decode.zone
    prompt = tiny.tokenizer.encode("adopt me then cancel me")
    reply = await zone.grant(_slot_request(zone, "r1", len(prompt)))
    slot_id, n = reply.slots[0][0], len(prompt) * zone.token_bytes
    ack = await zone.filled(SlotsFilled("r1", [[slot_id, 0, n]], [checksum(zone.slots.view(slot_id, n))]))
    assert ack.ok
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    ack = await decode.on_landed(
        HandoffDone("r1", prompt, [5], "", params, {"device": 0, "store": 0, "computed": len(prompt)}), None)
    assert ack.ok  # the KV is decode's: the Ack goes out before the engine adopts the request
    (adoption,) = decode.adopting
    await asyncio.sleep(0)  # the engine loop has the adoption queued
    assert not adoption.done()
    await decode.on_cancel(Cancel("r1", "client closed"), None)
    await adoption
    await _settle()
    assert not decode.active and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


async def test_cancel_racing_the_prefill_step_frees_the_kept_kv(engine, tiny):
    svc = PrefillService(service_ctx("prefill"), engine, sender=None)
    prompt = tiny.tokenizer.encode("prefill me and hand me off " * 3)
    seq = engine.add_request("r1", prompt, SamplingParams(max_tokens=8), prefill_only=True)
    svc.pending["r1"] = Pending(PrefillSubmit("r1", prompt, SamplingParams(), "decode-0"), None, seq)
    cancel = asyncio.create_task(svc.on_cancel(Cancel("r1", "client closed"), None))
    await asyncio.sleep(0)  # the abort is queued behind the step below
    outputs = engine.step()  # the step already running when the cancel came: it finishes "prefilled"
    assert outputs[0].finish_reason == "prefilled" and engine.block_manager.num_free_blocks < NUM_BLOCKS
    await svc.on_outputs(outputs)
    svc.loop.start()  # applies the queued abort
    await cancel
    await svc.loop.stop()
    assert not svc.pending and not svc.tasks, "a cancelled request must not start a handoff"
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS
    engine.block_manager.check_integrity()


async def test_cancel_while_the_request_is_being_added_lets_nothing_run(engine, tiny):
    svc = PrefillService(service_ctx("prefill"), engine, sender=None)
    prompt = tiny.tokenizer.encode("cancel me before I run " * 3)
    svc.pending["r1"] = p = Pending(PrefillSubmit("r1", prompt, SamplingParams(), "decode-0"), None)
    svc.loop.start()
    admit = asyncio.create_task(svc._admit(p, SamplingParams(max_tokens=8)))
    await asyncio.sleep(0)  # the admission is under way (the add itself does not wait for a step)
    await svc.on_cancel(Cancel("r1", "client closed"), None)
    await admit
    await _settle()
    await svc.loop.stop()
    assert not svc.pending and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS


async def test_cancel_before_the_handoff_task_first_runs_frees_its_kv(engine, tiny):
    """Found by bench/faults.py (kill -9 decode-0, in CI): a retry's Cancel arrived between the step that
    spawned the handoff task and that task's first run. Cancelling a task that never ran skips its
    finally, so its blocks (176 tokens) and its pending entry stayed for good."""
    class NoSend:
        async def send(self, *args, **kwargs):
            raise AssertionError("a handoff cancelled before it ran must not send")

    svc = PrefillService(service_ctx("prefill"), engine, sender=NoSend())
    prompt = tiny.tokenizer.encode("hand me off, then forget me " * 3)
    seq = engine.add_request("r1", prompt, SamplingParams(max_tokens=8), prefill_only=True)
    svc.pending["r1"] = Pending(PrefillSubmit("r1", prompt, SamplingParams(), "decode-0"), None, seq)
    outputs = engine.step()
    assert outputs[0].finish_reason == "prefilled"
    await svc.on_outputs(outputs)  # spawns the handoff task; it has not run yet
    (task,) = svc.tasks
    await svc.on_cancel(Cancel("r1", "retry failed"), None)
    svc.loop.start()
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)
    await _settle()
    await svc.loop.stop()
    assert not svc.pending and not svc.tasks
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS
    engine.block_manager.check_integrity()
