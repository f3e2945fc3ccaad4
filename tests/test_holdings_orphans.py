"""Engines end what a router no longer holds (shared/holdings.py).

Found by CI's `kill -9 router-0` fault (tests/test_faults.py): a request the killed router had submitted
before the gate answered (overlapped admission) waited at prefill for a DecodeAssign that nobody would
send, holding 272 tokens of KV past the fault test's 30 s quiet (assign_timeout_s is 45 s). The restarted
router's Holdings do not list it: prefill and decode now end such requests. Part 1 is the rule, part 2
prefill with a real tiny engine (the request waiting for its assignment, as in the fault), part 3 decode
with an adopted request generating for nobody.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from services.prefill.main import PrefillService
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.handoff_check import checksum
from shared.holdings import Served, orphans
from shared.messages import Cancel, HandoffDone, Holdings, PrefillSubmit, SlotRequest, SlotsFilled
from tests.decode_zone import running_decode, service_ctx
from tests.test_overlapped_admission import RecordingSender, SAMPLING

NUM_BLOCKS = 32


# ---- Part 1: the rule -------------------------------------------------------------------------------------
def test_an_orphan_is_unlisted_by_its_own_router_and_older_than_the_grace():
    served = [Served("old-unlisted", "router-0", 0.0), Served("listed", "router-0", 0.0),
              Served("young", "router-0", 9.0), Served("other-router", "router-1", 0.0),
              Served("no-router", "", 0.0)]
    msg = Holdings("router-0", "boot-b", ["listed"])
    assert orphans(served, msg, now=10.0, grace_s=5.0) == ["old-unlisted"]
    assert orphans(served, msg, now=14.0, grace_s=5.0) == ["old-unlisted", "young"]  # grace is inclusive
    assert orphans(served, Holdings("router-0", "boot-b", ["old-unlisted", "listed", "young"]), 99.0, 5.0) == []


def test_a_holdings_that_cannot_be_read_ends_nothing():
    served = [Served("r1", "router-0", 0.0)]
    assert orphans(served, Holdings("router-0", "b", ["x", 7]), 99.0, 5.0) == []  # type: ignore[list-item]
    assert orphans(served, Holdings("", "b", []), 99.0, 5.0) == []


def test_an_exited_router_orphans_everything_it_sent_without_grace():
    from shared.holdings import exit_holdings
    from shared.messages import InstanceExited

    served = [Served("just-now", "router-0", 10.0), Served("old", "router-0", 0.0), Served("other", "router-1", 0.0)]
    msg = exit_holdings(InstanceExited("router", "router-0", boot="b1", how="killed by SIGKILL"))
    assert orphans(served, msg, now=10.0, grace_s=0.0) == ["just-now", "old"]


# ---- Part 2: prefill --------------------------------------------------------------------------------------
@pytest.fixture
def engine(tiny):
    return Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))


async def _waiting_for_assignment(svc: PrefillService, rid: str, prompt: list[int], router: str) -> None:
    ack = await svc.on_submit(PrefillSubmit(rid, prompt, SAMPLING, "", router=router), None)
    assert ack.ok, ack.error
    deadline = time.monotonic() + 30
    while not svc.pending[rid].handoff_started:
        assert time.monotonic() < deadline, "the request never reached its handoff"
        await asyncio.sleep(0.01)


async def test_prefill_ends_a_request_its_restarted_router_does_not_list_and_frees_its_kv(engine, tiny):
    sender = RecordingSender()
    svc = PrefillService(service_ctx("prefill"), engine, sender, holdings_grace_s=0.2)
    svc.loop.start()
    prompt = tiny.tokenizer.encode("the router that sent me was killed " * 3)
    await _waiting_for_assignment(svc, "orphan", prompt, "router-0")
    await _waiting_for_assignment(svc, "theirs", prompt, "router-1")
    assert engine.block_manager.num_free_blocks < NUM_BLOCKS

    await svc.on_holdings(Holdings("router-0", "boot-new", []), None)  # within the grace: kept
    assert set(svc.pending) == {"orphan", "theirs"}
    await asyncio.sleep(0.25)
    await svc.on_holdings(Holdings("router-0", "boot-new", ["someone-else"]), None)
    deadline = time.monotonic() + 10
    while "orphan" in svc.pending:
        assert time.monotonic() < deadline, "the orphan was not ended"
        await asyncio.sleep(0.01)
    assert set(svc.pending) == {"theirs"}, "another router's request must not be touched"
    cancels = [(s, m) for s, m in svc.bus.published if isinstance(m, Cancel)]
    assert cancels == [(svc.bus.subjects.cancel("orphan"), cancels[0][1])], "decode must hear of it too"

    await svc.on_cancel(Cancel("theirs", "done with the test"), None)
    await asyncio.wait_for(asyncio.gather(*svc.tasks, return_exceptions=True), 10)
    await svc.loop.stop()
    assert not svc.pending and sender.sent == []
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS
    engine.block_manager.check_integrity()


# ---- Part 3: decode ---------------------------------------------------------------------------------------
async def test_decode_stops_generating_for_a_router_that_no_longer_holds_the_request(engine, tiny):
    async with running_decode(engine) as decode:
        decode.holdings_grace_s = 0.0
        zone = decode.zone
        prompt = tiny.tokenizer.encode("generate for nobody")
        reply = await zone.grant(SlotRequest("r1", "prefill-0", len(prompt) * zone.token_bytes, len(prompt),
                                             max_slots=2))
        slot_id, n = reply.slots[0][0], len(prompt) * zone.token_bytes
        assert (await zone.filled(SlotsFilled("r1", [[slot_id, 0, n]], [checksum(zone.slots.view(slot_id, n))]))).ok
        params = SamplingParams(max_tokens=200, ignore_eos=True)  # far from done when it ends
        ack = await decode.on_landed(HandoffDone("r1", prompt, [5], "", params, {"device": 0, "store": 0,
                                                                                 "computed": len(prompt)},
                                                 router="router-0"), None)
        await asyncio.gather(*decode.adopting)  # the engine takes it after the Ack
        assert ack.ok and "r1" in decode.active
        await decode.on_holdings(Holdings("router-1", "boot", []), None)  # another router's list
        await decode.on_holdings(Holdings("router-0", "boot", ["r1"]), None)  # still held
        assert "r1" in decode.active
        await decode.on_holdings(Holdings("router-0", "boot-after-restart", []), None)
        assert not decode.active
        for _ in range(5):
            await asyncio.sleep(0)
        assert not engine.scheduler.running and not engine.scheduler.waiting
        assert engine.block_manager.num_free_blocks == NUM_BLOCKS
