"""Decode keeps the session (issue 30): a prompt's landed blocks stay in decode's prefix index after its request
ends, and the next turn's handoff writes only the blocks decode lacks: straight into its pages (direct), or
staged through landing slots (the path of pages the transfer engine cannot register, a GPU's).

- pure: the block manager's hash-only match, its check of held blocks against the tokens, and taking
  blocks out of the index; the tiling check of a handoff that starts past the held blocks;
- in process, real Transfer Engines over loopback and a real nats-server, the tiny model on both sides, each
  handoff both ways:
  a second turn reuses the first prompt's full blocks (the bytes written are the rest, whole blocks) and
  its greedy output equals the scratch one; blocks decode computed itself are never offered; a
  HandoffDone whose prompt differs from the hashes the grant matched is refused and those blocks are
  forgotten, so the retry moves the whole prompt; a held prefix evicted before the grant, or reuse
  turned off, means a full handoff.
"""

from __future__ import annotations

import asyncio

import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.messages import HandoffDone
from shared.page_writes import tiling_error
from shared.transfer import TransferConfig
from tests.decode_zone import collect_chunks, handoff_pair


# ---------------------------------------------------------------- pure

def test_hash_only_match_then_the_tokens_check_then_forgetting():
    bm = BlockManager(8, 4, b"seed")
    tokens = list(range(12))
    blocks = bm.allocate(3)
    bm.register_full_blocks(blocks, tokens, 3)
    hashes = bm.block_hashes(tokens)
    assert bm.match_hashes(hashes) == blocks and bm.match_hashes([hashes[0], b"x" * 16, hashes[2]]) == blocks[:1]
    assert bm.match_hashes(bm.block_hashes(tokens, seed=b"other tenant")) == []
    assert bm.prefix_error(blocks[:2], tokens + [99]) is None
    assert "block 1" in bm.prefix_error(blocks[:2], tokens[:4] + [7, 7, 7, 7])
    assert "for a prompt of 6 tokens" in bm.prefix_error(blocks[:2], tokens[:6])
    assert "block 0" in bm.prefix_error(blocks[:1], tokens, seed=b"other tenant")
    bm.release(reversed(blocks[1:]))  # block 0 held, blocks 1 and 2 cached-free
    assert bm.unindex(blocks[:2]) == 2 and bm.match_hashes(hashes) == []
    bm.check_integrity()
    assert bm.num_free_blocks == 7  # block 1 turned plain at once; block 0 when released
    bm.release([blocks[0]])
    bm.check_integrity()
    assert bm.num_cached_blocks == 1 and bm.lookup(hashes[2]) == blocks[2]


def test_retained_fraction_bounds_what_finished_requests_keep(tiny):
    events = []
    bm = BlockManager(8, 4, b"seed", events.append, max_cached_free=2)
    tokens = list(range(16))
    blocks = bm.allocate(4)
    bm.register_full_blocks(blocks, tokens, 4)
    bm.release(reversed(blocks))  # tail first: the prefix is the most recently released, kept
    bm.check_integrity()
    assert bm.num_cached_blocks == 2 and bm.match_hashes(bm.block_hashes(tokens)) == blocks[:2]
    assert set(events[-1].block_hashes) == set(bm.block_hashes(tokens)[2:]) and bm.num_free_blocks == 8
    engine = Engine(tiny, EngineConfig(num_blocks=40, retained_fraction=0.25))
    assert engine.block_manager.max_cached_free == 10
    engine.generate([[t % 250 for t in range(300)]], PARAMS)  # 18 full blocks registered, 10 kept
    assert engine.block_manager.num_cached_blocks == 10
    with pytest.raises(ValueError, match="retained_fraction"):
        EngineConfig(retained_fraction=1.5)


def test_a_handoff_past_held_blocks_tiles_only_the_rest():
    bb = 100
    assert tiling_error([[2, 1, 0, 100, 5]], 3, bb, first_block=2) is None
    assert "gap" in tiling_error([[2, 1, 0, 100, 5]], 3, bb, first_block=1)
    assert "overlap" in tiling_error([[1, 2, 0, 200, 5]], 3, bb, first_block=2)  # writes into a held block


def test_a_grant_holds_the_matched_blocks_before_it_allocates_the_rest(tiny):
    """The allocation for the rest could evict the very blocks just matched (they are cached-free): they are
    acquired first, so it runs short instead, and then nothing stays taken."""
    from services.decode.landing import hold_prefix_then_allocate
    from shared.engine.block_manager import OutOfBlocks

    engine = Engine(tiny, EngineConfig(num_blocks=6))
    bm = engine.block_manager
    tokens = list(range(48))
    held = bm.allocate(3)
    bm.register_full_blocks(held, tokens, 3)
    bm.release(reversed(held))  # cached-free: reclaimable
    with pytest.raises(OutOfBlocks):
        hold_prefix_then_allocate(bm, bm.block_hashes(tokens), 3 + 4)  # 4 more than the 3 plain-free blocks
    bm.check_integrity()
    assert bm.match_hashes(bm.block_hashes(tokens)) == held and bm.num_free_blocks == 6
    reused, new = hold_prefix_then_allocate(bm, bm.block_hashes(tokens), 3 + 3)
    assert reused == held and len(new) == 3 and not set(new) & set(held) and bm.num_free_blocks == 0
    bm.release(reversed(reused + new))
    bm.check_integrity()


# ---------------------------------------------------------------- real Transfer Engines + nats, in process

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def _scratch(tiny, prompt):
    [want] = Engine(tiny, EngineConfig(num_blocks=96, enable_prefix_cache=False)).generate([prompt], PARAMS)
    return want.output_ids


# the two handoffs: straight into decode's pages, and staged through landing slots with the pages deliberately
# not registered (the path a GPU's pages take: gather on the pages' device, host buffer, scatter)
MODES = {"direct": {}, "slots": {"register_pages": False}}


def _cfg(mode: str, **kw) -> TransferConfig:
    return TransferConfig(timeout_s=20, **MODES[mode], **kw)


def _sent_bytes(layout, mode: str, num_tokens: int, held_blocks: int) -> int:
    """What a handoff past `held_blocks` moves: whole blocks straight into the pages, the tokens' rows through
    landing slots."""
    if mode == "direct":
        return (-(-num_tokens // layout.block_size) - held_blocks) * layout.block_bytes
    return (num_tokens - held_blocks * layout.block_size) * layout.bytes_per_token


async def _turn(h, p_engine, rid, prompt, tamper=None, hashes=True):
    """Prefill `prompt`, hand it off (with its block hashes unless `hashes` is false), and collect decode's
    tokens: (all output ids, the handoff stats, the error chunk or None). `tamper` changes the HandoffDone's
    prompt after the grant was asked for. The direct handoff when `h.direct` takes it, else the staged one."""
    chunks, finished = await collect_chunks(h.p_bus, rid)
    seq = p_engine.add_request(rid, prompt, PARAMS, prefill_only=True, retain_kv=True)
    while not p_engine.step():
        pass
    table = list(seq.block_table)
    done = HandoffDone(rid, list(prompt) if tamper is None else tamper(list(prompt)), seq.output_ids,
                       seq.output_text, PARAMS, {"device": 0, "store": 0, "computed": len(prompt)})
    block_hashes = p_engine.block_manager.block_hashes(prompt) if hashes else []
    try:
        stats = await h.direct.send("decode-0", rid, table, len(prompt), done, block_hashes=block_hashes)
        if stats is None:  # pages not registered: through landing slots
            stats = await h.sender.send("decode-0", rid, table, len(prompt), done, block_hashes=block_hashes)
    finally:
        p_engine.block_manager.release(reversed(table))
    await asyncio.wait_for(finished.wait(), 30)
    errors = [c.error for c in chunks if c.error]
    return done.output_ids + [t for c in chunks for t in c.token_ids], stats, errors[0] if errors else None


def _engines(tiny, decode_blocks=64):
    return Engine(tiny, EngineConfig(num_blocks=96)), Engine(tiny, EngineConfig(num_blocks=decode_blocks))


@pytest.mark.parametrize("mode", MODES)
async def test_the_next_turn_sends_only_what_decode_lacks_and_answers_as_from_scratch(tiny, mode):
    from tests.natsbus import nats_url

    p_engine, d_engine = _engines(tiny)
    bs, bb = p_engine.layout.block_size, p_engine.layout.block_bytes
    first = tiny.tokenizer.encode("You are a coding agent. Tools: read_file, run_tests. " * 4)
    with nats_url() as url:
        async with handoff_pair(url, p_engine, d_engine, _cfg(mode)) as h:
            out1, s1, err = await _turn(h, p_engine, "t1", first)
            assert err is None and out1 == _scratch(tiny, first) and s1.reused_blocks == 0
            assert s1.mode == mode and s1.bytes == _sent_bytes(p_engine.layout, mode, len(first), 0)
            second = first + out1 + tiny.tokenizer.encode(" The tests pass. Next step?")
            out2, s2, err = await _turn(h, p_engine, "t2", second)
            assert err is None and out2 == _scratch(tiny, second)
            held = len(first) // bs  # the first prompt's full blocks; decode's own (the answer's) are never offered
            assert s2.reused_blocks == held
            assert s2.bytes == _sent_bytes(p_engine.layout, mode, len(second), held)  # only the missing ones
            assert s2.bytes <= (len(second) - held * bs) * p_engine.layout.bytes_per_token + bb
            d = h.decode.load_report().detail
            assert d["reuse_grants"] == 1 and d["reused_blocks"] == held and d["reuse_mismatches"] == 0
            # a third turn reuses the second prompt's blocks: the whole history so far
            third = second + out2 + tiny.tokenizer.encode(" Done.")
            out3, s3, err = await _turn(h, p_engine, "t3", third)
            assert err is None and out3 == _scratch(tiny, third) and s3.reused_blocks == len(second) // bs


@pytest.mark.parametrize("mode", MODES)
async def test_a_prompt_that_differs_from_the_matched_hashes_is_refused_and_the_retry_sends_everything(tiny, mode):
    from tests.natsbus import nats_url

    p_engine, d_engine = _engines(tiny)
    first = tiny.tokenizer.encode("def handler(event):\n    return event['body']\n" * 4)
    with nats_url() as url:
        async with handoff_pair(url, p_engine, d_engine, _cfg(mode)) as h:
            out1, _, err = await _turn(h, p_engine, "m1", first)
            assert err is None
            second = first + out1 + tiny.tokenizer.encode(" again")

            def tamper(prompt):  # the HandoffDone names another history than the hashes decode matched
                return [prompt[0] + 1] + prompt[1:]

            with pytest.raises(Exception, match="retained prefix mismatch"):
                await _turn(h, p_engine, "m2", second, tamper=tamper)
            d = h.decode.load_report().detail
            assert d["reuse_mismatches"] == 1 and d["landing"] == 0
            out, s, err = await _turn(h, p_engine, "m3", second)  # the router's retry: those blocks are forgotten
            assert err is None and s.reused_blocks == 0 and out == _scratch(tiny, second)
            assert s.bytes == _sent_bytes(p_engine.layout, mode, len(second), 0)
            h.decode.engine.block_manager.check_integrity()


@pytest.mark.parametrize("mode", MODES)
async def test_an_evicted_prefix_or_reuse_turned_off_moves_the_whole_prompt(tiny, mode):
    from tests.natsbus import nats_url

    first = tiny.tokenizer.encode("An agent reads a file and then writes a test for it. " * 3)
    for cfg in (_cfg(mode, decode_reuse=False), _cfg(mode)):
        p_engine, d_engine = _engines(tiny, decode_blocks=24)
        with nats_url() as url:
            async with handoff_pair(url, p_engine, d_engine, cfg) as h:
                out1, _, _ = await _turn(h, p_engine, "e1", first)
                second = first + out1 + tiny.tokenizer.encode(" ok")
                if cfg.decode_reuse:  # another request takes every block: the held prefix is evicted
                    other = tiny.tokenizer.encode("something else entirely, " * 40)[:23 * 16]  # 24 blocks with its answer
                    await _turn(h, p_engine, "e-other", other, hashes=False)
                out2, s2, err = await _turn(h, p_engine, "e2", second)
                assert err is None and s2.reused_blocks == 0 and out2 == _scratch(tiny, second)
                assert s2.bytes == _sent_bytes(p_engine.layout, mode, len(second), 0)


# ---------------------------------------------------------------- the whole system (`moorage up`)

def _handoffs(url: str) -> dict:
    """The prefill's handoff totals (its load report)."""
    from tests.natsbus import latest_reports

    reports = asyncio.run(latest_reports(url, enough=lambda seen: any(r.role == "prefill" for r in seen.values())))
    d = next(r.detail for r in reports.values() if r.role == "prefill")
    return {k: d[k] for k in ("handoff_bytes", "handoffs_done", "handoff_reused_blocks")}


@pytest.mark.parametrize("mode", MODES)
def test_through_the_system_a_returning_turn_reuses_decode_s_blocks_and_a_decode_restart_falls_back(
        tiny, tmp_path, mode):
    """Real processes, tiny model, each handoff over tcp: a session's second turn hands off only what decode
    lacks and answers as from scratch; after decode-0 is killed (and restarted by `moorage up`) the next turn
    moves its whole prompt and is still right."""
    import time

    import httpx

    from infra.up import UpConfig, launched
    from shared.config import load_config
    from tests.natsbus import nats_url

    def ask(base: str, prompt: list[int]) -> dict:
        r = httpx.post(base + "/v1/completions", timeout=120, headers={"X-Session-ID": "reuse-1"}, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    def scratch_text(prompt):
        [want] = Engine(tiny, EngineConfig(num_blocks=256, enable_prefix_cache=False)).generate([prompt], PARAMS)
        return want.output_text

    def settled(url: str, done: int) -> dict:
        deadline = time.monotonic() + 20
        while (h := _handoffs(url))["handoffs_done"] < done and time.monotonic() < deadline:
            time.sleep(0.2)
        return h

    first = tiny.tokenizer.encode("System: you are a careful coding agent with tools. " * 12)
    bs = 16
    with nats_url() as url:
        cfg = load_config(UpConfig, overrides=[
            "up.model=tiny", "up.port=0", f"up.nats_url={url}", f"up.run_dir={tmp_path / 'run'}", "up.pool=false",
            "up.kv_memory=256MiB", *(f"{role}.transfer.{k}={str(v).lower()}" for role in ("prefill", "decode")
                                      for k, v in MODES[mode].items())], env={})
        with launched(cfg) as (launcher, base):
            out1 = ask(base, first)
            before = settled(url, 1)
            second = first + tiny.tokenizer.encode(out1["choices"][0]["text"] + " User: run the tests.")
            out2 = ask(base, second)
            after = settled(url, 2)
            assert out2["choices"][0]["text"] == scratch_text(second)
            assert after["handoff_reused_blocks"] - before["handoff_reused_blocks"] == len(first) // bs
            sent = after["handoff_bytes"] - before["handoff_bytes"]
            assert sent <= before["handoff_bytes"] * (-(-(len(second) - len(first)) // bs) + 1) / (-(-len(first) // bs))
            layout = Engine(tiny, EngineConfig(num_blocks=8)).layout  # the services' own (same model, dtype)
            assert before["handoff_bytes"] == _sent_bytes(layout, mode, len(first), 0)  # the mode it says
            assert sent == _sent_bytes(layout, mode, len(second), len(first) // bs)
            launcher.procs["decode-0"].kill()  # `moorage up` restarts it: its retained blocks are gone
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    third = second + tiny.tokenizer.encode(out2["choices"][0]["text"] + " ok")
                    out3 = ask(base, third)
                    break
                except AssertionError:  # 503 while decode is down: a client retries
                    time.sleep(0.5)
            final = settled(url, 3)
            assert out3["choices"][0]["text"] == scratch_text(third)
            assert final["handoff_reused_blocks"] == after["handoff_reused_blocks"]  # nothing held: all sent
