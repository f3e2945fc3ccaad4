"""The direct handoff (issue 11, item 5): prefill writes a request's blocks straight into decode's pages,
decode verifies them in place, and what it adopts is exactly the prefill's KV: greedy output equals a
from-scratch computation token for token.

- pure: the write plan (runs coalesced on both sides and cut into 4 MiB writes, one write per block and
  stage when prefill's pages are split in stages), the grant's runs, decode's tiling check and the
  shares of writes its verifying threads take;
- in process, real Transfer Engines over loopback and a real nats-server, the tiny model on both sides:
  a single-stage and a 3-stage prefill; a byte corrupted in flight by a second Transfer Engine write
  fails that request cleanly and frees its blocks; a decode that takes no direct writes answers
  `unsupported` and the staged path carries the request;
- a handoff cancelled during its write: decode holds the blocks until prefill's write thread has ended
  and its PagesReleased came;
- decode's zone with a real engine: a request dropped (cancelled) while its write may still be in flight
  keeps its blocks out of use until prefill's PagesReleased, a HandoffDone, or expiry.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time

import pytest
import torch

import services.prefill.direct as direct_module
from services.decode.direct import DirectPages, Refused, _shares
from services.prefill.handoff import HandoffFailed
from shared.config import ConfigError
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.handoff_check import checksum
from shared.kv_layout import KVLayout
from shared.messages import InstanceExited, Cancel, HandoffDone, PagesLanded, PagesReleased, PagesRequest
from shared.page_writes import PageWrite, expand_runs, plan, tiling_error, to_runs
from shared.transfer import KVTransport, TransferConfig
from tests.decode_zone import collect_chunks, handoff_pair, running_decode

NUM_BLOCKS = 32


# ---------------------------------------------------------------- pure


def test_early_verify_is_on_by_default_only_where_the_cpus_do_not_copy_the_bytes():
    assert not TransferConfig().verify_while_writing  # tcp: a verify beside the write slows it (bench/handoff.py)
    assert TransferConfig(protocol="rdma").verify_while_writing
    assert TransferConfig(early_verify="on").verify_while_writing
    assert not TransferConfig(protocol="rdma", early_verify="off").verify_while_writing
    with pytest.raises(ConfigError, match="early_verify"):
        TransferConfig(early_verify="yes")


def test_runs_and_their_addresses():
    assert to_runs([4, 5, 6, 9, 3, 4]) == [(4, 3), (9, 1), (3, 2)]
    assert to_runs([]) == []
    assert expand_runs([[1000, 2], [5000, 1]], 3, 100) == [1000, 1100, 5000]
    for bad in ([[1000, 2]], [[1000, 0], [0, 3]], [[1000, -1]], [["x", 1]], [[1, 2, 3]]):
        with pytest.raises(ValueError):
            expand_runs(bad, 3, 100)


def test_plan_coalesces_blocks_consecutive_on_both_sides():
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8)
    bb = layout.block_bytes
    dst = [10 * bb, 11 * bb, 12 * bb, 40 * bb, 41 * bb]
    assert plan([7, 8, 3, 4, 5], dst, layout) == [
        PageWrite(0, 7, 0, 2, 0, 2 * bb),   # src 7,8 and dst 10,11: one span
        PageWrite(0, 3, 2, 1, 0, bb),       # src jumps back: dst 12 alone
        PageWrite(0, 4, 3, 2, 0, 2 * bb)]   # src 4,5 and dst 40,41
    assert plan([0, 1, 2, 3, 4], [i * bb for i in range(5)], layout) == [PageWrite(0, 0, 0, 5, 0, 5 * bb)]
    with pytest.raises(ValueError):
        plan([1, 2], [0], layout)


def test_plan_cuts_long_runs_so_decode_can_verify_their_pieces_in_parallel():
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8)
    bb = layout.block_bytes
    writes = plan(list(range(7)), [i * bb for i in range(7)], layout, max_bytes=3 * bb + 1)
    assert writes == [PageWrite(0, 0, 0, 3, 0, 3 * bb), PageWrite(0, 3, 3, 3, 0, 3 * bb), PageWrite(0, 6, 6, 1, 0, bb)]
    assert tiling_error([w.wire(0) for w in writes], 7, bb) is None
    assert len(plan([0, 1], [0, bb], layout, max_bytes=1)) == 2  # one block at least
    assert [list(r) for r in _shares([4, 4, 1], 2)] == [[0], [1, 2]]  # about equal bytes, in order
    assert [list(r) for r in _shares([1] * 7, 3)] == [[0, 1], [2, 3, 4], [5, 6]]
    assert [list(r) for r in _shares([5], 4)] == [[0]] and _shares([], 2) == []


def test_plan_with_stages_writes_each_stage_at_its_offset_in_decode_block():
    layout = KVLayout(num_layers=5, num_kv_heads=2, head_dim=8, stages=2)  # layers 0-2 and 3-4
    per_layer = 2 * layout.block_size * 2 * 8 * 4
    writes = plan([3, 4], [0, layout.block_bytes], layout)
    assert writes == [PageWrite(0, 3, 0, 1, 0, 3 * per_layer), PageWrite(1, 3, 0, 1, 3 * per_layer, 2 * per_layer),
                      PageWrite(0, 4, 1, 1, 0, 3 * per_layer), PageWrite(1, 4, 1, 1, 3 * per_layer, 2 * per_layer)]
    assert tiling_error([w.wire(0) for w in writes], 2, layout.block_bytes) is None


def test_tiling_must_cover_the_blocks_exactly_once():
    bb = 100
    assert tiling_error([[0, 2, 0, 200, 5], [2, 1, 0, 100, 6]], 3, bb) is None
    assert "cover 200 of 300" in tiling_error([[0, 2, 0, 200, 5]], 3, bb)
    assert "gap" in tiling_error([[0, 1, 0, 100, 5], [2, 1, 0, 100, 6]], 3, bb)
    assert "overlap" in tiling_error([[0, 2, 0, 200, 5], [1, 2, 0, 200, 6]], 3, bb)
    assert "bad write" in tiling_error([[0, 4, 0, 400, 5]], 3, bb)       # beyond the granted blocks
    assert "bad write" in tiling_error([[0, 1, 50, 100, 5]], 3, bb)      # past the end of its one block
    assert "bad write" in tiling_error([[0, 1, 0, 100, 1 << 32]], 1, bb)  # not a 32-bit crc
    assert "bad write" in tiling_error([[0, 1, 0]], 1, bb)
    assert "cover" in tiling_error([], 1, bb)


# ---------------------------------------------------------------- real Transfer Engines + nats, in process


def _setup(tiny, text: str, max_tokens: int):
    """(prompt, params, the from-scratch reference, prefill engine, decode engine) for a pair test."""
    prompt = tiny.tokenizer.encode(text)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    [want] = Engine(tiny, EngineConfig(num_blocks=64, enable_prefix_cache=False)).generate([prompt], params)
    return prompt, params, want, Engine(tiny, EngineConfig(num_blocks=64)), Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))


def _prefill(engine: Engine, rid: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], HandoffDone]:
    seq = engine.add_request(rid, prompt, params, prefill_only=True, retain_kv=True)
    while not engine.step():
        pass
    return list(seq.block_table), HandoffDone(rid, seq.prompt_ids, seq.output_ids, seq.output_text,
                                              params, {"device": 0, "store": 0, "computed": len(prompt)})


async def _generated(h, bus, engine, rid, prompt, params) -> tuple[list[int], object]:
    chunks, finished = await collect_chunks(bus, rid)
    table, done = _prefill(engine, rid, prompt, params)
    try:
        stats = await h.direct.send("decode-0", rid, table, len(prompt), done)
    finally:
        engine.block_manager.release(reversed(table))
    if stats is not None:
        await asyncio.wait_for(finished.wait(), 30)
        assert not any(c.error for c in chunks)
    return done.output_ids + [t for c in chunks for t in c.token_ids], stats


@pytest.mark.parametrize("stages", [1, 3])
async def test_direct_handoff_lands_exactly_what_prefill_computed(tiny, stages):
    from tests.natsbus import nats_url

    prompt = tiny.tokenizer.encode("straight into the pages: " * 5)  # a partly filled last block
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    [want] = Engine(tiny, EngineConfig(num_blocks=64, enable_prefix_cache=False)).generate([prompt], params)
    p_engine = Engine(tiny, EngineConfig(num_blocks=64, stages=stages))
    d_engine = Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))
    d_engine.block_manager.allocate(3)  # decode's free blocks are not prefill's block ids
    n_blocks = -(-len(prompt) // p_engine.layout.block_size)
    assert len(prompt) % p_engine.layout.block_size and n_blocks >= 2
    with nats_url() as url:
        async with handoff_pair(url, p_engine, d_engine, TransferConfig(timeout_s=20)) as h:
            got, stats = await _generated(h, h.p_bus, p_engine, "r1", prompt, params)
            assert got == want.output_ids
            assert stats.mode == "direct" and stats.writes == 1 and stats.crc_ms > 0 and stats.scatter_ms == 0
            assert stats.bytes == n_blocks * p_engine.layout.block_bytes  # whole blocks, nothing gathered
            assert len(stats.entry_bytes) == (1 if stages == 1 else n_blocks * stages)
            report = h.decode.load_report().detail
            assert report["handoff_crc_verified"] == len(stats.entry_bytes) and report["landing"] == 0
            assert report["quarantined"] == 0 and h.slots.num_free == h.slots.num_slots  # no slot was used
            # the next turn of the same history: its full blocks are prefill's cached ones, their CRCs kept
            assert stats.crc_reused == 0
            got, again = await _generated(h, h.p_bus, p_engine, "r2", prompt, params)
            assert got == want.output_ids
            assert again.crc_reused == (n_blocks - 1) * stages  # all but the partly filled last block


async def test_a_decode_that_answers_its_page_request_late_is_asked_again(tiny):
    """A busy host: decode answers the first PagesRequest after the bus timeout. Prefill asks again (decode grants
    a request id the same blocks each time) until transfer.timeout_s, and the handoff lands, not a 503."""
    from tests.natsbus import nats_url

    prompt = tiny.tokenizer.encode("late but there: " * 6)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    [want] = Engine(tiny, EngineConfig(num_blocks=64, enable_prefix_cache=False)).generate([prompt], params)
    p_engine, d_engine = Engine(tiny, EngineConfig(num_blocks=64)), Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))
    with nats_url() as url:
        async with handoff_pair(url, p_engine, d_engine, TransferConfig(timeout_s=20)) as h:
            h.p_bus.config.request_timeout_s = 0.3
            grant, asked = h.decode.direct._grant, []

            async def slow_first(msg):
                asked.append(msg.request_id)
                if len(asked) == 1:
                    await asyncio.sleep(1.0)  # past the requester's timeout
                return await grant(msg)

            h.decode.direct._grant = slow_first
            got, stats = await _generated(h, h.p_bus, p_engine, "late", prompt, params)
            assert got == want.output_ids and stats.mode == "direct"
            assert len(asked) >= 2 and set(asked) == {"late"}
            assert len(h.decode.zone.landings) == 0  # one landing, adopted; nothing left behind


@pytest.mark.parametrize("early_verify", ["off", "on"])
async def test_a_byte_corrupted_in_flight_fails_the_request_and_frees_its_blocks(tiny, monkeypatch, early_verify):
    """Whether decode checks writes as prefill reports them landed (early_verify=on) or all at HandoffDone
    (off: the default over tcp), a byte changed after prefill computed its CRC fails the request."""
    from tests.natsbus import nats_url

    prompt, params, want, p_engine, d_engine = _setup(tiny, "def checksum(data):\n    crc = 0\n" * 3, 8)
    monkeypatch.setattr(direct_module, "CHECK_BYTES", p_engine.layout.block_bytes)  # a write per block: several
    with nats_url() as url:
        async with handoff_pair(url, p_engine, d_engine, TransferConfig(timeout_s=20, early_verify=early_verify)) as h:
            rogue, flip = KVTransport(), torch.zeros(1, dtype=torch.uint8)
            rogue.register(flip)
            real_write, corrupted, told = h.p_te.write, [], []

            def write_then_corrupt(peer, src, dst, lens, on_landed=None):
                told.append(on_landed is not None)  # prefill hears of each landed write only to tell decode
                def corrupt(i: int) -> None:  # piece i landed: one byte of it goes bad before decode checks it
                    if not corrupted:
                        k = lens[i] // 2
                        flip[0] = ctypes.string_at(src[i] + k, 1)[0] ^ 0xFF
                        rogue.write(peer, [flip.data_ptr()], [dst[i] + k], [1])
                        corrupted.append(dst[i] + k)

                def landed(i: int) -> None:  # before prefill hears of it (and may tell decode: PagesLanded)
                    corrupt(i)
                    on_landed(i)

                real_write(peer, src, dst, lens, None if on_landed is None else landed)
                corrupt(0)  # a one-write handoff: after prefill's write, before decode's check

            monkeypatch.setattr(h.p_te, "write", write_then_corrupt)
            try:
                with pytest.raises(HandoffFailed, match="checksum mismatch"):
                    await _generated(h, h.p_bus, p_engine, "bad", prompt, params)
                report = h.decode.load_report().detail
                assert corrupted and report["handoff_crc_failures"] == 1 and report["landing"] == 0
                assert told == [early_verify == "on"]
                assert not h.decode.active and report["quarantined"] == 0
                assert await h.decode.loop.call(lambda: d_engine.block_manager.num_free_blocks) == NUM_BLOCKS
                got, stats = await _generated(h, h.p_bus, p_engine, "good", prompt, params)
                assert got == want.output_ids and stats.mode == "direct"
            finally:
                rogue.close()


async def test_handoff_done_is_encoded_while_the_write_is_still_on_the_wire(tiny, monkeypatch):
    """The HandoffDone (writes and CRCs) is packed during the write, so it goes out the moment the write ends:
    this write waits until it has been, and fails the handoff if it never is."""
    from tests.natsbus import nats_url

    prompt, params, want, p_engine, d_engine = _setup(tiny, "encode the message ahead: " * 6, 4)
    with nats_url() as url:
        async with handoff_pair(url, p_engine, d_engine, TransferConfig(timeout_s=20)) as h:
            packed, real_pack, real_write = threading.Event(), h.p_bus.pack, h.p_te.write
            packed_during_write = []

            def pack(msg):
                data = real_pack(msg)
                if isinstance(msg, HandoffDone):
                    assert len(msg.pages) >= 1 and all(len(w) == 5 for w in msg.pages)  # the CRCs are in
                    packed.set()
                return data

            def write(peer, src, dst, lens, on_landed=None):
                real_write(peer, src, dst, lens, on_landed)
                packed_during_write.append(packed.wait(10))  # the write has not returned yet

            monkeypatch.setattr(h.p_bus, "pack", pack)
            monkeypatch.setattr(h.p_te, "write", write)
            got, stats = await _generated(h, h.p_bus, p_engine, "ahead", prompt, params)
            assert packed_during_write == [True]
            assert got == want.output_ids and stats.mode == "direct"


async def test_a_handoff_cancelled_mid_write_frees_decode_blocks_only_once_the_write_has_ended(tiny, monkeypatch):
    import threading

    from tests.natsbus import nats_url

    prompt = tiny.tokenizer.encode("cancel me while my bytes are on the wire " * 3)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    p_engine, d_engine = Engine(tiny, EngineConfig(num_blocks=64)), Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))
    with nats_url() as url:
        async with handoff_pair(url, p_engine, d_engine, TransferConfig(timeout_s=20)) as h:
            real_write, writing, go_on = h.p_te.write, threading.Event(), threading.Event()

            def slow_write(*args):
                writing.set()
                go_on.wait(10)
                real_write(*args)

            real_checksums, crc_go = h.direct._checksums, threading.Event()

            def slow_checksums(writes):  # both threads still run when the cancel comes; the checksum ends first
                crc_go.wait(10)
                return real_checksums(writes)

            monkeypatch.setattr(h.p_te, "write", slow_write)
            monkeypatch.setattr(h.direct, "_checksums", slow_checksums)
            table, done = _prefill(p_engine, "r1", prompt, params)
            send = asyncio.ensure_future(h.direct.send("decode-0", "r1", table, len(prompt), done))
            assert await asyncio.to_thread(writing.wait, 10)
            await h.decode.on_cancel(Cancel("r1", "client gone"), None)  # decode hears the cancel first
            zone = h.decode.zone
            assert "r1" in zone.quarantine and zone.reserved_tokens > 0  # the write still runs: blocks held
            send.cancel()
            crc_go.set()
            await asyncio.sleep(0.2)
            assert not send.done()  # the cancel waits for the write thread, also once the checksum's has ended
            go_on.set()
            with pytest.raises(asyncio.CancelledError):
                await send
            p_engine.block_manager.release(reversed(table))
            deadline = time.monotonic() + 10
            while zone.quarantine and time.monotonic() < deadline:  # PagesReleased on the bus
                await asyncio.sleep(0.02)
            assert not zone.quarantine and not zone.landings
            assert await h.decode.loop.call(lambda: d_engine.block_manager.num_free_blocks) == NUM_BLOCKS


async def test_a_decode_that_takes_no_direct_writes_gets_the_request_through_landing_slots(tiny):
    from tests.natsbus import nats_url

    prompt, params, want, p_engine, d_engine = _setup(tiny, "the staged path " * 6, 6)
    with nats_url() as url:
        async with handoff_pair(url, p_engine, d_engine, TransferConfig(timeout_s=20)) as h:
            h.decode.direct.reason = "transfer.direct is false"  # as DirectPages(enabled=False) says
            chunks, finished = await collect_chunks(h.p_bus, "r1")
            table, done = _prefill(p_engine, "r1", prompt, params)
            try:
                assert await h.direct.send("decode-0", "r1", table, len(prompt), done) is None
                assert not h.decode.zone.landings  # nothing was allocated for the direct attempt
                stats = await h.sender.send("decode-0", "r1", table, len(prompt), done)  # as prefill then does
            finally:
                p_engine.block_manager.release(reversed(table))
            await asyncio.wait_for(finished.wait(), 30)
            assert stats.mode == "slots" and done.output_ids + [t for c in chunks for t in c.token_ids] == want.output_ids
    # the other reason: two engines whose blocks mean different bytes never pair directly
    p16 = Engine(tiny, EngineConfig(num_blocks=4, kv_dtype="bfloat16"))
    assert p16.layout.block_layout != p_engine.layout.block_layout


# ---------------------------------------------------------------- decode's zone: writes in flight


async def test_a_dropped_grant_keeps_its_blocks_until_prefill_says_its_writes_are_over(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))
    with KVTransport() as te:
        async with running_decode(engine) as decode:
            decode.direct = DirectPages(decode.zone, te, enabled=True)
            await _dropped_grants(decode, engine)


async def test_an_abandoned_landing_expires_at_its_deadline_and_its_request_gets_a_503(tiny):
    """decode's expiry task sleeps until the idlest landing's deadline (`LandingZone.next_expiry`), not by a
    tick: a landing nobody writes is dropped once `transfer.timeout_s` has passed since its grant, never before,
    its blocks come back and its request ends in a 503; a landing still written to is kept."""
    from types import SimpleNamespace

    timeout = 0.6
    engine = Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))
    with KVTransport() as te:
        async with running_decode(engine) as decode:
            decode.direct = DirectPages(decode.zone, te, enabled=True)
            decode.ctx.config = SimpleNamespace(transfer=SimpleNamespace(timeout_s=timeout))
            decode.ctx.stop = asyncio.Event()
            zone, layout = decode.zone, engine.layout
            assert zone.next_expiry(timeout) - time.monotonic() == pytest.approx(timeout, abs=0.05)
            expiry = asyncio.create_task(decode.expire_landings())
            await asyncio.sleep(0.3)  # the task sleeps for a whole timeout from its start: no landing existed
            t0 = time.monotonic()
            await decode.direct.grant(PagesRequest("idle", "prefill-0", 40, layout.block_layout))
            await decode.direct.grant(PagesRequest("busy", "prefill-0", 20, layout.block_layout))
            assert zone.next_expiry(timeout) == pytest.approx(zone.landings["idle"].last_activity + timeout)
            while "idle" in zone.landings:
                zone.landings["busy"].last_activity = time.monotonic()  # being written
                await asyncio.sleep(0.02)
            waited = time.monotonic() - t0
            errors = [m for _, m in decode.bus.published if getattr(m, "request_id", "") == "idle" and m.error]
            # a task that slept a whole timeout from each wake would drop it 0.3 s after its deadline
            assert timeout <= waited < timeout + 0.25 and "busy" in zone.landings
            assert errors and errors[0].error["status"] == 503 and "timed out" in errors[0].error["message"]
            decode.ctx.stop.set()
            await asyncio.wait_for(expiry, 2)
            await zone.drop("busy")
            await zone.expire(0.0)
            assert await decode.loop.call(lambda: engine.block_manager.num_free_blocks) == NUM_BLOCKS


async def _dropped_grants(decode, engine: Engine) -> None:
    layout = engine.layout
    free = lambda: decode.loop.call(lambda: engine.block_manager.num_free_blocks)  # noqa: E731
    grant = await decode.direct.grant(PagesRequest("r1", "prefill-0", 40, layout.block_layout))
    assert grant.runs and sum(n for _, n in grant.runs) == 3 and await free() == NUM_BLOCKS - 3
    again = await decode.direct.grant(PagesRequest("r1", "prefill-0", 40, layout.block_layout))
    assert again.runs == grant.runs  # a repeated request gets the same blocks, never more
    await decode.on_cancel(Cancel("r1", "client gone"), None)
    assert await free() == NUM_BLOCKS - 3 and "r1" in decode.zone.quarantine  # a write may still be coming
    assert decode.zone.reserved_tokens == 3 * layout.block_size
    late = await decode.direct.grant(PagesRequest("r1", "prefill-0", 40, layout.block_layout))
    assert late.fatal and not late.runs
    await decode.direct.released(PagesReleased("r1"))
    assert await free() == NUM_BLOCKS and not decode.zone.quarantine

    # prefill died mid-write: nothing says the writes are over; expiry frees them after the timeout
    grant = await decode.direct.grant(PagesRequest("r2", "prefill-0", 20, layout.block_layout))
    await decode.zone.drop("r2")
    assert await decode.zone.expire(60.0) == [] and "r2" in decode.zone.quarantine
    await decode.zone.expire(0.0)
    assert await free() == NUM_BLOCKS and not decode.zone.quarantine

    # prefill died mid-write and its supervisor says so: its grants end at once, another prefill's stay
    await decode.direct.grant(PagesRequest("r5", "prefill-0", 20, layout.block_layout))
    await decode.direct.grant(PagesRequest("r6", "prefill-1", 20, layout.block_layout))
    await decode.zone.drop("r5")
    await decode.zone.drop("r6")
    assert {"r5", "r6"} <= set(decode.zone.quarantine)
    await decode.on_exited(InstanceExited("prefill", "prefill-0", boot="b1", how="killed by SIGKILL"), None)
    assert set(decode.zone.quarantine) == {"r6"} and await free() == NUM_BLOCKS - 2
    await decode.direct.released(PagesReleased("r6"))
    assert await free() == NUM_BLOCKS and not decode.zone.quarantine

    # a HandoffDone for a dropped request ends its quarantine too, and is refused
    grant = await decode.direct.grant(PagesRequest("r3", "prefill-0", 20, layout.block_layout))
    await decode.zone.drop("r3")
    ack = await decode.on_landed(HandoffDone("r3", [1] * 20, [2], "", SamplingParams(), {}, pages=[[0, 2, 0, 2 * layout.block_bytes, 0]]), None)
    assert not ack.ok and await free() == NUM_BLOCKS and not decode.zone.quarantine
    unsupported = await decode.direct.grant(PagesRequest("r4", "prefill-0", 20, layout.block_layout[:-1] + [32]))
    assert unsupported.unsupported and not unsupported.runs and "r4" not in decode.zone.landings


async def test_decode_checks_every_write_whichever_of_its_threads_verifies_it(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))
    with KVTransport() as te:
        async with running_decode(engine) as decode:
            pages = decode.direct = DirectPages(decode.zone, te, enabled=True)
            pages.threads, pages.inline_bytes = 2, 0  # in threads however small
            await pages.grant(PagesRequest("r1", "prefill-0", 4 * engine.layout.block_size, engine.layout.block_layout))
            landing, bb = decode.zone.landings["r1"], pages.block_bytes
            spans = [pages._bytes[b * bb:(b + 1) * bb] for b in landing.blocks]
            for span in spans:
                span.copy_(torch.randint(0, 256, (bb,), dtype=torch.uint8))
            writes = [[i, 1, 0, bb, checksum(span)] for i, span in enumerate(spans)]  # 2 shares of 2 writes
            assert await pages._verify(landing, writes) == (None, 0)
            spans[3][bb // 2] ^= 1  # in the second share
            assert (await pages._verify(landing, writes))[0].startswith("write 3 ")
            spans[3][bb // 2] ^= 1
            spans[1][0] ^= 1  # the first share's mismatch is the one reported, whichever thread ends first
            spans[2][7] ^= 1
            assert (await pages._verify(landing, writes))[0].startswith("write 1 ")
            await decode.direct.released(PagesReleased("r1"))


async def test_a_small_handoff_is_verified_on_the_loop_without_a_thread_hop(tiny, monkeypatch):
    """Up to inline_bytes in all the writes are checked where HandoffDone is handled (a hop to the worker
    threads and back costs as much as such a CRC); a mismatch is found there all the same."""
    engine = Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))
    with KVTransport() as te:
        async with running_decode(engine) as decode:
            pages = decode.direct = DirectPages(decode.zone, te, enabled=True)
            await pages.grant(PagesRequest("r1", "prefill-0", 4 * engine.layout.block_size, engine.layout.block_layout))
            landing, bb = decode.zone.landings["r1"], pages.block_bytes
            spans = [pages._bytes[b * bb:(b + 1) * bb] for b in landing.blocks]
            for span in spans:
                span.copy_(torch.randint(0, 256, (bb,), dtype=torch.uint8))
            writes = [[i, 1, 0, bb, checksum(span)] for i, span in enumerate(spans)]
            hops, real = [], decode.zone.loop.run_in_worker

            async def run_in_worker(fn):
                hops.append(fn)
                return await real(fn)

            monkeypatch.setattr(decode.zone.loop, "run_in_worker", run_in_worker)
            pages.inline_bytes = 4 * bb
            assert await pages._verify(landing, writes) == (None, 0) and hops == []
            spans[2][bb // 3] ^= 1
            assert (await pages._verify(landing, writes))[0].startswith("write 2 ") and hops == []
            pages.inline_bytes = 4 * bb - 1  # one byte more than that: the threads
            assert (await pages._verify(landing, writes))[0].startswith("write 2 ") and hops
            await decode.direct.released(PagesReleased("r1"))


async def test_writes_told_landed_early_are_checked_once_and_a_bad_one_still_refuses(tiny):
    """PagesLanded starts checking writes while the rest are on the wire; HandoffDone awaits those checks
    instead of repeating them, checks the others, and a mismatch found early refuses the request."""
    engine = Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))
    with KVTransport() as te:
        async with running_decode(engine) as decode:
            pages = decode.direct = DirectPages(decode.zone, te, enabled=True)
            bb, bs = pages.block_bytes, engine.layout.block_size
            free = lambda: decode.loop.call(lambda: engine.block_manager.num_free_blocks)  # noqa: E731

            async def granted(rid: str) -> list:
                await pages.grant(PagesRequest(rid, "prefill-0", 4 * bs, engine.layout.block_layout))
                spans = [pages._bytes[b * bb:(b + 1) * bb] for b in decode.zone.landings[rid].blocks]
                for span in spans:
                    span.copy_(torch.randint(0, 256, (bb,), dtype=torch.uint8))
                return spans

            def done(rid: str, writes: list) -> HandoffDone:
                return HandoffDone(rid, [1] * 4 * bs, [2], "", SamplingParams(), {}, pages=writes)

            spans = await granted("r1")
            writes = [[i, 1, 0, bb, checksum(span)] for i, span in enumerate(spans)]
            outside, junk = [3, 9, 0, bb, 0], "junk"  # ignored: HandoffDone's tiling check is theirs
            await pages.landed(PagesLanded("r1", writes[:2] + [outside, junk]))
            assert set(decode.zone.landings["r1"].checks) == {tuple(w) for w in writes[:2]}
            await pages.landed(PagesLanded("r1", writes[:1]))  # told twice: checked once
            landing, timing = await pages.land(done("r1", writes))
            assert timing["verified_early"] == 2 and decode.zone.checks.verified == 4
            await decode.loop.call(lambda: engine.block_manager.release(landing.blocks))
            await pages.landed(PagesLanded("r1", writes[:1]))  # a late one, for a request already taken: ignored

            spans = await granted("r2")
            writes = [[i, 1, 0, bb, checksum(span)] for i, span in enumerate(spans)]
            spans[1][5] ^= 1  # corrupted in flight, before decode heard it landed
            await pages.landed(PagesLanded("r2", writes[1:2]))
            with pytest.raises(Refused, match="write 1 "):
                await pages.land(done("r2", writes))
            assert "r2" not in decode.zone.landings and await free() == NUM_BLOCKS


async def test_a_release_sent_while_decode_is_not_subscribed_reaches_it_once_it_is(nats_url):
    """The bus restarted between decode's grant and prefill's release: decode is not subscribed again yet, so
    a plain publish was lost and the blocks were held until expiry. The release is asked until acknowledged."""
    from services.prefill.direct import DirectSender
    from shared.bus import Bus, BusConfig
    from shared.messages import Ack
    from shared.transfer import TransferConfig

    prefill_bus = await Bus.connect(BusConfig(url=nats_url, prefix="rel"), "prefill-0")
    decode_bus = await Bus.connect(BusConfig(url=nats_url, prefix="rel"), "decode-0")
    sender = DirectSender(prefill_bus, "prefill-0", None, [], None, TransferConfig(direct=False, timeout_s=30), [])
    got: list[str] = []
    try:
        await sender.release("decode-0", "r1")  # returns at once: nobody listens yet
        assert len(sender.releases.pending) == 1
        await asyncio.sleep(0.8)  # no responders: asked again meanwhile
        assert got == [] and len(sender.releases.pending) == 1

        async def released(msg: PagesReleased, raw) -> Ack:
            got.append(msg.request_id)
            return Ack(msg.request_id, True)

        await decode_bus.subscribe(decode_bus.subjects.decode_pages_released("decode-0"), PagesReleased, released)
        for _ in range(100):
            if not sender.releases.pending:
                break
            await asyncio.sleep(0.05)
        assert got == ["r1"] and not sender.releases.pending  # delivered, acknowledged, no longer asked

        await sender.release("decode-gone", "r2")  # nobody ever answers: stopping the service ends the asking
        await sender.close()
        assert not sender.releases.pending
    finally:
        await prefill_bus.close()
        await decode_bus.close()
