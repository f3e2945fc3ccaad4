"""The early grant (issue 11, item 5): prefill asks decode for a request's pages when the engine starts
the step that completes its prompt, so the grant's round trip overlaps that forward pass.

- the engine names the prefill-only requests a step is about to complete (and only those);
- the prefill service asks once the decode is known (at that step, or at a DecodeAssign after it), never
  for a request that ends at prefill (max_tokens = 1), and gives a grant its handoff never took back
  whatever ends the request (cancel, engine failure, finished at prefill);
- real Transfer Engines and nats-server: a handoff with an early grant lands exactly what prefill
  computed; a grant older than half the timeout is asked for again (decode answers with the same blocks);
  a released grant frees decode's blocks, also when the release overtakes the grant itself.
"""

from __future__ import annotations

import asyncio

import pytest

from services.prefill.main import Pending, PrefillService
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.messages import Cancel, DecodeAssign, HandoffDone, PrefillSubmit
from shared.transfer import TransferConfig
from tests.decode_zone import collect_chunks, handoff_pair, service_ctx

NUM_BLOCKS = 32


def test_the_engine_names_the_prompts_its_next_step_completes(tiny):
    engine = Engine(tiny, EngineConfig(num_blocks=64, max_batched_tokens=32))
    seen = []
    engine.on_prefill_ending = seen.append
    long = engine.add_request("long", list(range(1, 60)), SamplingParams(max_tokens=4), prefill_only=True,
                              retain_kv=True)
    engine.add_request("plain", list(range(1, 10)), SamplingParams(max_tokens=4))  # decodes here: never named
    steps = 0
    while not any(o.request_id == "long" for o in engine.step()):
        steps += 1
    assert steps >= 1 and seen == [["long"]]  # once: for the step that computes its last chunk only
    engine.block_manager.release(reversed(long.block_table))


class _Direct:
    """Records what the prefill service asks of its DirectSender (pure logic: no bus, no engine)."""

    reuse = False
    enabled = True

    def __init__(self):
        self.asked, self.released = [], []

    def pre_grant(self, decode, rid, num_tokens, context=None, block_hashes=()):
        self.asked.append((decode, rid, num_tokens))
        return asyncio.get_running_loop().create_future()

    async def release(self, decode, rid, early):
        self.released.append((decode, rid))


async def _service(tiny, *requests: tuple[str, str, int], sender=None) -> tuple[PrefillService, _Direct]:
    engine, direct = Engine(tiny, EngineConfig(num_blocks=64)), _Direct()
    if sender is not None:  # this prefill's pages take no direct writes: the staged sender asks early
        direct.enabled = False
    svc = PrefillService(service_ctx("prefill"), engine, sender=sender, direct=direct)
    for rid, decode, max_tokens in requests:
        params = SamplingParams(max_tokens=max_tokens)
        seq = engine.add_request(rid, [1, 2, 3], params, prefill_only=True, retain_kv=True)
        svc.pending[rid] = Pending(PrefillSubmit(rid, [1, 2, 3], params, decode), None, seq)
    return svc, direct


async def test_the_service_asks_once_the_decode_is_known_and_never_for_a_request_ending_here(tiny):
    svc, direct = await _service(tiny, ("known", "decode-0", 8), ("later", "", 8), ("one", "decode-0", 1))
    svc.on_prefill_ending(["known", "later", "one", "gone"])
    assert direct.asked == [("decode-0", "known", 3)]
    await svc.on_assign(DecodeAssign("later", "decode-1"), None)  # its assignment came after the step began
    assert direct.asked[1:] == [("decode-1", "later", 3)]
    svc.on_prefill_ending(["known"])
    assert len(direct.asked) == 2  # one grant per request


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
async def test_a_grant_the_handoff_never_took_goes_back_however_the_request_ends(tiny, staged):
    """The direct sender asks while this prefill's pages take direct writes; else (a GPU's, unregistered) the staged
    sender asks for its first slot. Either way, what no handoff took goes back to the decode it was asked of."""
    sender = _Direct() if staged else None
    svc, direct = await _service(tiny, ("cancelled", "decode-0", 8), ("failed", "", 8), ("one", "decode-0", 1),
                                 sender=sender)
    asker = sender or direct
    svc.on_prefill_ending(["cancelled", "failed", "one"])
    await svc.on_assign(DecodeAssign("failed", "decode-1"), None)
    assert asker.asked == [("decode-0", "cancelled", 3), ("decode-1", "failed", 3)]
    svc.loop.start()
    try:
        await svc.on_cancel(Cancel("cancelled", "client closed"), None)
        await svc.on_failed(["failed"], "engine step failed")
        await asyncio.gather(*svc.tasks)
    finally:
        await svc.loop.stop()
    assert sorted(asker.released) == [("decode-0", "cancelled"), ("decode-1", "failed")]
    assert list(svc.pending) == ["one"]  # never asked: it ends at prefill
    if staged:
        assert direct.asked == [] and direct.released == []


async def test_a_staged_handoff_with_early_slots_lands_what_prefill_computed_and_sends_only_what_decode_lacks(tiny):
    """The staged path (pages not registered, as a GPU's): slots asked for before the handoff starts, granted while
    the prompt's last step computes, are the handoff's first; on the next turn the early grant also says what
    decode holds, so the windows are cut past it before any is gathered."""
    from tests.natsbus import nats_url

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = tiny.tokenizer.encode("landing slots granted before the handoff: " * 4)
    p_engine, d_engine = Engine(tiny, EngineConfig(num_blocks=64)), Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))
    layout = p_engine.layout

    def scratch(prompt):
        return Engine(tiny, EngineConfig(num_blocks=64, enable_prefix_cache=False)).generate([prompt], params)[0]

    with nats_url() as url:
        cfg = TransferConfig(timeout_s=20, register_pages=False, slot_bytes=2 * layout.block_bytes, slots=4,
                             max_slots_per_round=2)  # two blocks a slot: several windows, asked for in rounds
        async with handoff_pair(url, p_engine, d_engine, cfg) as h:
            assert not h.direct.enabled

            async def turn(rid, prompt):
                chunks, finished = await collect_chunks(h.p_bus, rid)
                early = h.sender.pre_grant("decode-0", rid, len(prompt),
                                           block_hashes=p_engine.block_manager.block_hashes(prompt))
                seq = p_engine.add_request(rid, prompt, params, prefill_only=True, retain_kv=True)
                while not p_engine.step():
                    pass
                while not early.slots:  # granted before the handoff starts
                    await asyncio.sleep(0.01)
                assert rid in h.decode.zone.landings and early.asks == 1 and len(early.slots) == 1  # one held
                done = HandoffDone(rid, seq.prompt_ids, seq.output_ids, seq.output_text, params,
                                   {"device": 0, "store": 0, "computed": len(prompt)})
                table = list(seq.block_table)
                try:
                    stats = await h.sender.send("decode-0", rid, table, len(prompt), done, early=early)
                finally:
                    p_engine.block_manager.release(reversed(table))
                assert early.written == len(early.windows) > 0  # the handoff was the early run itself
                await asyncio.wait_for(finished.wait(), 30)
                assert not any(c.error for c in chunks)
                return done.output_ids + [t for c in chunks for t in c.token_ids], stats

            out1, s1 = await turn("e1", first)
            assert out1 == scratch(first).output_ids and s1.early_grant and s1.mode == "slots" and s1.writes > 4
            assert s1.bytes == len(first) * layout.bytes_per_token and s1.reused_blocks == 0
            second = first + out1 + tiny.tokenizer.encode(" and the next turn")
            out2, s2 = await turn("e2", second)
            held = len(first) // layout.block_size
            assert out2 == scratch(second).output_ids and s2.early_grant and s2.reused_blocks == held
            assert s2.bytes == (len(second) - held * layout.block_size) * layout.bytes_per_token

            # a request that ends without its handoff gives the slots back, also when the release overtakes the ask
            done_early = h.sender.pre_grant("decode-0", "ended", len(first))
            while not done_early.slots:
                await asyncio.sleep(0.01)
            await h.sender.release("decode-0", "ended", done_early)
            racing = h.sender.pre_grant("decode-0", "raced", len(first))
            await h.sender.release("decode-0", "raced", racing)
            zone = h.decode.zone

            async def settled() -> None:  # both releases handled: no landing, none quarantined, every slot back
                while zone.landings or zone.quarantine or not zone.is_cancelled("raced") \
                        or h.slots.num_free != h.slots.num_slots:
                    await h.decode.loop.changed(0.1)

            await asyncio.wait_for(settled(), 10)
            assert await h.decode.loop.call(lambda: d_engine.block_manager.num_free_blocks) == NUM_BLOCKS


async def test_a_handoff_with_an_early_grant_lands_what_prefill_computed_and_a_stale_one_is_renewed(tiny):
    from tests.natsbus import nats_url
    from tests.test_direct_handoff import _generated

    prompt = tiny.tokenizer.encode("granted while the last chunk computes: " * 4)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    [want] = Engine(tiny, EngineConfig(num_blocks=64, enable_prefix_cache=False)).generate([prompt], params)
    p_engine, d_engine = Engine(tiny, EngineConfig(num_blocks=64)), Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))
    with nats_url() as url:
        async with handoff_pair(url, p_engine, d_engine, TransferConfig(timeout_s=20)) as h:
            send = h.direct.send

            async def with_early(decode, rid, table, n, done, **kw):
                return await send(decode, rid, table, n, done, early=early, **kw)

            h.direct.send = with_early
            early = h.direct.pre_grant("decode-0", "r1", len(prompt))
            await early
            got, stats = await _generated(h, h.p_bus, p_engine, "r1", prompt, params)
            assert got == want.output_ids and stats.mode == "direct" and stats.early_grant

            early = h.direct.pre_grant("decode-0", "r2", len(prompt))
            first, _ = await early
            landing = h.decode.zone.landings["r2"]
            idle_since = landing.last_activity
            h.direct.config.timeout_s = 0.0  # the grant is stale at once: send asks again
            try:
                got, stats = await _generated(h, h.p_bus, p_engine, "r2", prompt, params)
            finally:
                h.direct.config.timeout_s = 20
            assert got == want.output_ids and stats.early_grant
            assert landing.last_activity > idle_since  # decode restarted the grant's idle clock
            assert await h.decode.loop.call(lambda: d_engine.block_manager.num_free_blocks) == NUM_BLOCKS


async def test_a_released_early_grant_frees_decode_blocks_even_when_it_overtakes_the_grant(tiny):
    from tests.natsbus import nats_url

    p_engine, d_engine = Engine(tiny, EngineConfig(num_blocks=64)), Engine(tiny, EngineConfig(num_blocks=NUM_BLOCKS))
    with nats_url() as url:
        async with handoff_pair(url, p_engine, d_engine, TransferConfig(timeout_s=20)) as h:
            zone = h.decode.zone
            early = h.direct.pre_grant("decode-0", "done-at-prefill", 40)
            grant, _ = await early
            assert grant.runs and "done-at-prefill" in zone.landings
            await h.direct.release("decode-0", "done-at-prefill", early)

            racing = h.direct.pre_grant("decode-0", "cancelled-at-once", 40)
            for _ in range(3):  # let the PagesRequest go out, then release before decode has answered
                await asyncio.sleep(0)
            await h.direct.release("decode-0", "cancelled-at-once", racing)

            async def settled() -> None:  # both releases handled: no landing, nothing quarantined
                while zone.landings or zone.quarantine or not zone.is_cancelled("cancelled-at-once"):
                    await h.decode.loop.changed(0.1)

            await asyncio.wait_for(settled(), 10)
            assert await h.decode.loop.call(lambda: d_engine.block_manager.num_free_blocks) == NUM_BLOCKS
