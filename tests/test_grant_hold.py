"""A decode short of room holds a SlotRequest until slots or blocks come back (no prefill-side polling).

Real tiny engine and engine loop, in process; the landing zone is driven directly."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.decode import landing
from services.decode.landing import LandingZone
from shared.engine.engine import Engine, EngineConfig
from shared.messages import SlotRequest
from tests.decode_zone import running_decode

NUM_BLOCKS = 16  # 256 tokens


@pytest.fixture
async def decode(tiny, monkeypatch):
    monkeypatch.setattr(landing, "GRANT_HOLD_S", 2.0)
    async with running_decode(Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS)), num_slots=1) as svc:
        yield svc


def _req(zone: LandingZone, rid: str, tokens: int) -> SlotRequest:
    return SlotRequest(rid, "prefill-0", tokens * zone.token_bytes, tokens, max_slots=1)


async def test_grant_short_of_slots_is_answered_when_one_comes_back(decode):
    zone = decode.zone
    first = await zone.grant(_req(zone, "r1", 32))
    assert len(first.slots) == 1
    second = asyncio.create_task(zone.grant(_req(zone, "r2", 32)))
    await asyncio.sleep(0.2)
    assert not second.done()  # held: the only slot is r1's
    t = time.monotonic()
    assert await zone.drop("r1")  # r1's slot and blocks come back
    reply = await asyncio.wait_for(second, 1.0)
    assert len(reply.slots) == 1 and time.monotonic() - t < 1.0
    await zone.drop("r2")


async def test_grant_short_of_blocks_is_answered_when_the_engine_frees_them(decode):
    zone = decode.zone
    big = await zone.grant(_req(zone, "r1", 200))  # 13 of 16 blocks
    assert len(big.slots) == 1
    waiting = asyncio.create_task(zone.grant(_req(zone, "r2", 100)))  # needs 7
    await asyncio.sleep(0.2)
    assert not waiting.done() and "r2" not in zone.landings
    await zone.drop("r1")
    reply = await asyncio.wait_for(waiting, 1.5)
    assert "r2" in zone.landings and len(reply.slots) == 1
    await zone.drop("r2")


async def test_grant_gives_up_after_the_hold(decode, monkeypatch):
    monkeypatch.setattr(landing, "GRANT_HOLD_S", 0.3)
    zone = decode.zone
    assert (await zone.grant(_req(zone, "r1", 32))).slots
    t = time.monotonic()
    reply = await zone.grant(_req(zone, "r2", 32))
    assert not reply.slots and not reply.fatal and 0.25 < time.monotonic() - t < 2.0
    assert "r2" in zone.landings  # its blocks were reserved; the next ask only needs a slot
    await zone.drop("r1")
    assert (await zone.grant(_req(zone, "r2", 32))).slots
    await zone.drop("r2")


async def test_a_cancel_ends_a_held_grant(decode):
    zone = decode.zone
    assert (await zone.grant(_req(zone, "r1", 32))).slots
    held = asyncio.create_task(zone.grant(_req(zone, "r2", 32)))
    await asyncio.sleep(0.1)
    await zone.drop("r2")
    reply = await asyncio.wait_for(held, 1.0)
    assert reply.fatal and not reply.slots and "r2" not in zone.landings
    await zone.drop("r1")


async def test_an_ask_repeated_after_a_bus_timeout_gets_the_same_slots_not_more(tiny):
    """Prefill asks again when decode's answer came after the bus timeout: the same `ask` is answered with the
    slots that ask was lent (still held for it), so a busy host's late answers lend out no extra slots."""
    async with running_decode(Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS)), num_slots=4) as svc:
        zone = svc.zone
        ask = SlotRequest("r1", "prefill-0", 32 * zone.token_bytes, 32, max_slots=2, ask=1)
        first = await zone.grant(ask)
        again = await zone.grant(ask)
        assert len(first.slots) == 2 and again.slots == first.slots and zone.slots.num_free == 2
        second = await zone.grant(SlotRequest("r1", "prefill-0", 32 * zone.token_bytes, 32, max_slots=1, ask=2))
        assert len(second.slots) == 1 and second.slots[0] not in first.slots and zone.slots.num_free == 1
        old = await zone.grant(SlotRequest("r1", "prefill-0", 32 * zone.token_bytes, 32, max_slots=2))
        assert len(old.slots) == 1  # ask 0 (a sender that makes no such promise): lent anew, as before
        await zone.drop("r1")
        assert zone.slots.num_free == 4
