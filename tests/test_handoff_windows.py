"""Handoff windows of exactly one landing slot (issue 11, item 5): a handoff is ceil(bytes / slot_bytes)
writes however the slot size falls on token and block boundaries, and what decode adopts is exactly the
prefill's KV, so greedy output equals a from-scratch computation token for token.

In process: real Transfer Engines over loopback, a real nats-server, the tiny model on both sides.
Slot sizes: a whole number of blocks (no cut token), one byte short of a block, a few tokens and some
bytes, and less than one token (a token spread over three pieces, some pieces inside one token).
Also: decode refuses a piece that overlaps one already landed, and HandoffDone sent together with the
last SlotsFilled (as prefill does) is adopted only once every byte has landed.
With `transfer.register_pages` false on both sides ("foreign") every gather and scatter runs through a scratch
buffer, as from a GPU's pages (shared/device_staging.py): the same bytes land.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from kernels.reference import gather_for_ranks
from services.decode.landing import LandingZone
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.handoff_check import checksum
from shared.messages import HandoffDone, SlotRequest, SlotsFilled
from shared.transfer import TransferConfig
from tests.decode_zone import collect_chunks, handoff_pair, running_decode

NUM_BLOCKS = 32


def _snapshot_on_take(zone: LandingZone, num_tokens: int) -> list[torch.Tensor]:
    """Wraps zone.take: the KV rows of the landing's blocks at the moment they are handed to the engine."""
    taken, take = [], zone.take

    def take_and_read(rid: str):
        landing = take(rid)
        engine = zone.engine
        taken.append(gather_for_ranks(engine.pages, landing.blocks, num_tokens, 1, engine.layout)[0])
        return landing

    zone.take = take_and_read
    return taken


def _slot_sizes(token_bytes: int, block: int) -> dict[str, int]:
    return {"whole blocks": 2 * block * token_bytes, "block minus a byte": block * token_bytes - 1,
            "tokens and bytes": 5 * token_bytes + 123, "under a token": token_bytes // 3 + 5}


@pytest.mark.parametrize("case,register_pages", [
    *(pytest.param(c, True, id=c) for c in ("whole blocks", "block minus a byte", "tokens and bytes", "under a token")),
    pytest.param("tokens and bytes", False, id="tokens and bytes, foreign")])
async def test_slot_sized_windows_land_exactly(tiny, case, register_pages):
    from tests.natsbus import nats_url

    prompt = tiny.tokenizer.encode("windows cut anywhere: " * 4)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    [want] = Engine(tiny, EngineConfig(num_blocks=64, enable_prefix_cache=False)).generate([prompt], params)
    p_engine, d_engine = Engine(tiny, EngineConfig(num_blocks=64)), Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))
    layout = p_engine.layout
    slot_bytes = _slot_sizes(layout.bytes_per_token, layout.block_size)[case]
    total = len(prompt) * layout.bytes_per_token
    cfg = TransferConfig(slot_bytes=slot_bytes, slots=6, max_slots_per_round=3, timeout_s=30,
                         register_pages=register_pages)
    with nats_url() as url:
        async with handoff_pair(url, p_engine, d_engine, cfg) as h:
            p_bus, decode, slots, sender = h.p_bus, h.decode, h.slots, h.sender
            assert sender.copies.foreign == decode.zone.copies.foreign == (not register_pages)
            chunks, finished = await collect_chunks(p_bus, "r1")
            seq = p_engine.add_request("r1", prompt, params, prefill_only=True, retain_kv=True)
            while not p_engine.step():
                pass
            table = list(seq.block_table)
            expected_kv = gather_for_ranks(p_engine.pages, table, len(prompt), 1, layout)[0]
            done = HandoffDone("r1", seq.prompt_ids, seq.output_ids, seq.output_text, params,
                               {"device": 0, "store": 0, "computed": len(prompt)})
            adopted = _snapshot_on_take(decode.zone, len(prompt))
            stats = await sender.send("decode-0", "r1", table, len(prompt), done)
            assert stats.writes == -(-total // slot_bytes) and stats.bytes == total
            assert torch.equal(adopted[0], expected_kv)  # the blocks adopted hold exactly prefill's KV
            p_engine.block_manager.release(reversed(table))
            await asyncio.wait_for(finished.wait(), 30)
            got_ids = done.output_ids + [t for c in chunks for t in c.token_ids]
            assert got_ids == want.output_ids and not any(c.error for c in chunks)
            assert decode.zone.checks.verified == stats.writes and decode.zone.checks.failures == 0
            assert not decode.zone.landings and slots.num_free == cfg.slots


async def test_a_decode_that_answers_late_is_waited_for_or_asked_again(tiny):
    """A busy host: decode answers the first SlotRequest after the bus timeout. Prefill asks again with the same
    ask number, decode answers with the slots it already lent, and the staged handoff lands, not a 503; no
    slot stays lent. Its HandoffDone is answered late too: prefill waits for that Ack until the handoff's
    deadline, not the bus's timeout."""
    from tests.natsbus import nats_url

    prompt = tiny.tokenizer.encode("late slots still land: " * 4)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    [want] = Engine(tiny, EngineConfig(num_blocks=64, enable_prefix_cache=False)).generate([prompt], params)
    p_engine, d_engine = Engine(tiny, EngineConfig(num_blocks=64)), Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))
    cfg = TransferConfig(slot_bytes=4 * p_engine.layout.bytes_per_token, slots=6, max_slots_per_round=3,
                         timeout_s=20)
    with nats_url() as url:
        async with handoff_pair(url, p_engine, d_engine, cfg) as h:
            h.p_bus.config.request_timeout_s = 0.3
            grant, asks = h.decode.zone._grant, []

            async def slow_first(msg):
                asks.append(msg.ask)
                reply = await grant(msg)
                if len(asks) == 1:
                    await asyncio.sleep(1.0)  # past the requester's timeout, the slots already lent
                return reply

            h.decode.zone._grant = slow_first
            take, taken = h.decode.zone.take_when_landed, []

            async def slow_take(msg, *a):
                taken.append(msg.request_id)
                await asyncio.sleep(1.0)  # the Ack comes after the requester's timeout
                return await take(msg, *a)

            h.decode.zone.take_when_landed = slow_take
            chunks, finished = await collect_chunks(h.p_bus, "r1")
            seq = p_engine.add_request("r1", prompt, params, prefill_only=True, retain_kv=True)
            while not p_engine.step():
                pass
            table = list(seq.block_table)
            done = HandoffDone("r1", seq.prompt_ids, seq.output_ids, seq.output_text, params,
                               {"device": 0, "store": 0, "computed": len(prompt)})
            await h.sender.send("decode-0", "r1", table, len(prompt), done)
            p_engine.block_manager.release(reversed(table))
            await asyncio.wait_for(finished.wait(), 30)
            assert done.output_ids + [t for c in chunks for t in c.token_ids] == want.output_ids
            assert asks[:2] == [1, 1] and len(asks) > 2  # the first ask twice, then the later rounds'
            assert taken == ["r1"]  # HandoffDone went once, and its late Ack was waited for
            assert not h.decode.zone.landings and h.slots.num_free == cfg.slots


async def test_a_failed_staged_handoff_frees_decode_s_landing_without_a_cancel(tiny):
    """The write fails after decode made the landing (its blocks and slots taken). No Cancel is published here (as
    when the bus restarted and lost it): prefill's acknowledged release alone frees them at once, not at expiry."""
    from services.prefill.handoff import HandoffFailed
    from tests.natsbus import nats_url

    prompt = tiny.tokenizer.encode("a write that fails half way: " * 6)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    p_engine, d_engine = Engine(tiny, EngineConfig(num_blocks=64)), Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))
    cfg = TransferConfig(slot_bytes=p_engine.layout.block_bytes, slots=6, max_slots_per_round=3, timeout_s=60,
                         register_pages=False)
    with nats_url() as url:
        async with handoff_pair(url, p_engine, d_engine, cfg) as h:
            free = d_engine.block_manager.num_free_blocks
            seq = p_engine.add_request("f1", prompt, params, prefill_only=True, retain_kv=True)
            while not p_engine.step():
                pass
            table = list(seq.block_table)

            def failing_write(*a, **kw):
                raise RuntimeError("transfer engine: peer unreachable")

            h.sender.transport.write = failing_write
            done = HandoffDone("f1", seq.prompt_ids, seq.output_ids, seq.output_text, params,
                               {"device": 0, "store": 0, "computed": len(prompt)})
            with pytest.raises((HandoffFailed, RuntimeError)):
                await h.sender.send("decode-0", "f1", table, len(prompt), done)
            p_engine.block_manager.release(reversed(table))
            for _ in range(100):  # well under the 60 s expiry
                if not h.decode.zone.landings and not h.sender.releases.pending:
                    break
                await asyncio.sleep(0.05)
            assert not h.decode.zone.landings and not h.sender.releases.pending
            assert d_engine.block_manager.num_free_blocks == free and h.slots.num_free == cfg.slots
            assert h.decode.zone.is_cancelled("f1")  # a late grant or piece of it is refused


# ---------------------------------------------------------------- LandingZone alone


@pytest.fixture
async def decode(tiny):
    async with running_decode(Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS)), slot_bytes=1 << 18) as svc:
        yield svc


def _piece(zone: LandingZone, slot_id: int, offset: int, data: torch.Tensor) -> SlotsFilled:
    zone.slots.view(slot_id, data.numel()).copy_(data)
    return SlotsFilled("r1", [[slot_id, offset, data.numel()]], [checksum(data)])


async def test_overlapping_piece_is_refused_and_done_waits_for_the_last_piece(decode, tiny):
    zone = decode.zone
    prompt = tiny.tokenizer.encode("two pieces, cut inside a token")
    tb = zone.token_bytes
    total = len(prompt) * tb
    reply = await zone.grant(SlotRequest("r1", "prefill-0", total, len(prompt), max_slots=3))
    (a, _, _), (b, _, _), (c, _, _) = reply.slots
    data = torch.randint(0, 255, (total,), dtype=torch.uint8)
    cut = 3 * tb + tb // 2  # inside token 3
    assert (await zone.filled(_piece(zone, a, 0, data[:cut]))).ok
    overlap = await zone.filled(_piece(zone, b, cut - 8, data[cut - 8:cut + 8]))
    assert not overlap.ok and "bad piece" in overlap.error
    assert 3 in zone.landings["r1"].seams  # token 3's first half waits for the rest
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    adopted = _snapshot_on_take(zone, len(prompt))
    adopt = asyncio.create_task(decode.on_landed(
        HandoffDone("r1", prompt, [5], "", params, {"device": 0, "store": 0, "computed": len(prompt)}), None))
    await asyncio.sleep(0.05)
    assert not adopt.done()  # HandoffDone came before the last piece: it waits
    assert (await zone.filled(_piece(zone, c, cut, data[cut:]))).ok
    ack = await asyncio.wait_for(adopt, 10)
    assert ack.ok and not zone.landings
    assert torch.equal(adopted[0].flatten().view(torch.uint8), data)  # token 3 joined from both pieces
    await decode.on_cancel(SimpleNamespace(request_id="r1", reason="test over"), None)
