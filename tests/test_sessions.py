"""Closing a session (issue 30): what its KV is, what closing frees, through the whole system.

Pure: shared/sessions.py says which hashes only the closed session held; BlockManager.drop_cached
frees those blocks no request holds. Real processes (`moorage up`, tiny model, pool on): two sessions share an
opening; after DELETE /v1/sessions/{a}, the other session's next turn is still served from cache, while
session a's own history is gone from the device and the pool (its next turn recomputes all but the shared
opening) and its answer still equals the engine's from scratch."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch

from infra.up import UpConfig, launched
from shared.sessions import SessionIndex, SessionKV
from shared.config import load_config
from shared.engine.block_manager import BlockManager
from shared.engine.engine import Engine, EngineConfig
from shared.engine.sampling import SamplingParams
from shared.kv_events import BlockRemoved
from tests.natsbus import latest_reports, nats_url


def kv(*names: str) -> SessionKV:
    return SessionKV(tuple(n.encode() for n in names), tuple(n.upper().encode() for n in names))


def test_closing_returns_only_what_no_other_session_holds():
    idx = SessionIndex()
    idx.record(("", "a"), kv("sys", "tools", "a1", "a2"))
    idx.record(("", "b"), kv("sys", "tools", "b1"))
    idx.record(("t2", "a"), kv("sys", "x"))  # another tenant's session of the same name
    closed = idx.close(("", "a"))
    assert closed.known and closed.blocks == [b"a1", b"a2"] and closed.chunks == [b"A1", b"A2"]
    idx.check_integrity()
    assert not idx.close(("", "a")).known  # closed already: nothing more
    closed = idx.close(("", "b"))
    assert closed.blocks == [b"tools", b"b1"]  # "sys" is still t2's
    idx.check_integrity()


def test_a_later_prompt_replaces_the_session_s_kv_and_the_index_is_bounded():
    idx = SessionIndex(max_sessions=2)
    idx.record(("", "a"), kv("a1"))
    idx.record(("", "a"), kv("a1", "a2"))  # the next turn: its history grew
    idx.record(("", "b"), kv("b1"))
    idx.record(("", "c"), kv("c1"))  # a is forgotten (least recently recorded)
    idx.check_integrity()
    assert set(idx.sessions) == {("", "b"), ("", "c")} and not idx.close(("", "a")).known


def test_drop_cached_frees_unheld_blocks_and_keeps_held_ones():
    events = []
    bm = BlockManager(8, 4, b"seed", events.append)
    tokens = list(range(12))
    blocks = bm.allocate(3)
    bm.register_full_blocks(blocks, tokens, 3)
    hashes = bm.block_hashes(tokens)
    bm.release(reversed(blocks[1:]))  # blocks 1 and 2 cached-free; block 0 still held
    assert bm.drop_cached(hashes) == 2
    bm.check_integrity()
    assert isinstance(events[-1], BlockRemoved) and set(events[-1].block_hashes) == set(hashes[1:])
    assert bm.lookup(hashes[0]) == blocks[0] and bm.lookup(hashes[1]) is None
    assert bm.num_free_blocks == 7 and bm.drop_cached(hashes) == 0


def test_alone_names_what_only_the_session_holds_and_keeps_it_recorded():
    idx = SessionIndex()
    idx.record(("", "a"), kv("sys", "a1", "a2"))
    idx.record(("", "b"), kv("sys", "b1"))
    assert idx.alone(("", "a")) == [b"a1", b"a2"] and idx.alone(("", "nobody")) is None
    assert idx.alone(("", "a")) == [b"a1", b"a2"]  # still recorded: asking changes nothing
    idx.check_integrity()


def test_an_ended_session_s_blocks_are_evicted_before_any_other():
    """SessionTurn without expected_back: the blocks only that session holds move to the LRU's old end,
    tails first, whatever their release order; blocks in use stay where they are."""
    bm = BlockManager(7, 4, b"seed")  # no plain block: every allocation evicts
    ended, returning, shared = list(range(100, 112)), list(range(200, 212)), list(range(300, 304))
    tables = {}
    for name, tokens in (("ended", ended), ("returning", returning), ("shared", shared)):
        tables[name] = bm.allocate(len(tokens) // 4)
        bm.register_full_blocks(tables[name], tokens, len(tokens) // 4)
    bm.release(reversed(tables["ended"]))      # released first: LRU would evict these first anyway
    bm.release(reversed(tables["returning"]))
    assert bm.demote(bm.block_hashes(ended)) == 3
    order = list(bm._cached_free)
    assert order[:3] == tables["ended"][::-1]  # tail first, then its prefix
    bm.acquire(tables["ended"][:1])  # in use again: demote leaves it alone
    assert bm.demote(bm.block_hashes(ended)) == 2
    bm.release(tables["ended"][:1])
    bm.release(reversed(tables["shared"]))
    assert bm.demote(bm.block_hashes(returning)) == 3
    assert bm.allocate(3) == sorted(tables["returning"])  # demoted last: evicted first
    bm.check_integrity()


# ---- through the system ------------------------------------------------------------------------------
OPENING = 600  # tokens both sessions start with (two pool chunks and more)


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    with nats_url() as url:
        cfg = load_config(UpConfig, overrides=["up.model=tiny", "up.port=0", f"up.nats_url={url}",
                                               "up.kv_memory=256MiB", "up.store_bytes=67108864",
                                               f"up.run_dir={tmp_path_factory.mktemp('sessions')}"], env={})
        with launched(cfg) as (_, base):
            yield base, url


def _complete(base: str, prompt: list[int], session: str) -> dict:
    r = httpx.post(base + "/v1/completions", timeout=120, headers={"X-Session-ID": session}, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def _prefill(url: str, pred, role: str = "prefill") -> dict:
    """The prefill's (or `role`'s) load report detail, once `pred` holds for it (or the last seen after 30 s)."""
    deadline, detail = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        reports = asyncio.run(latest_reports(url, enough=lambda seen: any(r.role == role for r in seen.values())))
        detail = next(r.detail for r in reports.values() if r.role == role)
        if pred(detail):
            break
        time.sleep(0.3)
    return detail


def test_a_closed_session_s_kv_is_freed_and_the_shared_opening_stays(system, tiny):
    base, url = system
    opening = _tokens(1, OPENING)
    a, b = opening + _tokens(2, 700), opening + _tokens(3, 700)
    _complete(base, a, "sess-a")
    _complete(base, b, "sess-b")
    _prefill(url, lambda d: d["pool"]["saved_chunks"] >= 8 and d["sessions"]["recorded"] >= 2)
    r = httpx.delete(base + "/v1/sessions/sess-a", timeout=30)
    assert r.status_code == 200 and r.json() == {"id": "sess-a", "object": "session", "closed": True}
    d = _prefill(url, lambda d: d["sessions"]["sessions_closed"] >= 1)["sessions"]
    assert d["sessions_closed"] == 1 and d["session_blocks_dropped"] > 0 and d["session_objects_removed"] > 0
    stores = asyncio.run(latest_reports(url, enough=lambda seen: sum(r.role == "store" for r in seen.values()) == 2))
    deleted = sum(r.detail["disk"]["deleted"] for r in stores.values() if r.role == "store")
    assert deleted > 0  # the default system's disk tier dropped its copies of a's own chunks too
    d = _prefill(url, lambda d: d["sessions"]["sessions_closed"] >= 1, "decode")["sessions"]  # decode keeps prompts
    assert d["sessions_closed"] == 1 and d["session_blocks_dropped"] >= (700 - 16) // 16  # a's own blocks there
    # b is served from cache as before: its own history and the shared opening
    cached_b = _complete(base, b + _tokens(4, 20), "sess-b")["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached_b >= len(b) - 16
    # a's history is gone from device and pool but the opening b shares: recomputed, and still right
    out = _complete(base, a + _tokens(5, 20), "sess-a")
    cached_a = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert OPENING - 16 <= cached_a < OPENING + 256, cached_a
    engine = Engine(tiny, EngineConfig(num_blocks=256, enable_prefix_cache=False))
    want = engine.generate([a + _tokens(5, 20)], SamplingParams(max_tokens=8, ignore_eos=True))[0].output_text
    assert out["choices"][0]["text"] == want


def test_a_session_whose_answer_ends_its_task_is_the_first_to_go_everywhere(system):
    """The router's SessionTurn after a final answer (no tool call): prefill and decode both move the blocks only
    that session holds to the old end of their LRU."""
    base, url = system
    before = {role: _prefill(url, lambda d: True, role)["sessions"] for role in ("prefill", "decode")}
    _complete(base, _tokens(40, 700), "sess-ended")
    for role in ("prefill", "decode"):
        was = before[role]
        d = _prefill(url, lambda d: d["sessions"]["sessions_ended"] > was["sessions_ended"], role)["sessions"]
        assert d["sessions_ended"] == was["sessions_ended"] + 1, (role, d)
        assert d["session_blocks_demoted"] - was["session_blocks_demoted"] >= (700 - 16) // 16 - 1, (role, d)


def test_closing_an_unknown_session_frees_nothing_and_a_bad_id_is_a_400(system):
    base, _ = system
    assert httpx.delete(base + "/v1/sessions/never-seen", timeout=30).status_code == 200
    r = httpx.delete(base + "/v1/sessions/" + "x" * 300, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"


def test_closing_a_session_mid_request_loses_nothing_and_leaks_no_kv(system, tiny):
    """A fault row of issue 30: the close arrives while the session's request is still computing. The blocks
    that request holds are not freed under it; it answers as from scratch; afterwards every block is free."""
    import threading

    base, url = system
    prompt = _tokens(7, 1800)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(_complete(base, prompt, "sess-mid")))
    t.start()
    _prefill(url, lambda d: d["sessions"]["recorded"] >= 3)  # its prompt is recorded: the close finds it
    assert httpx.delete(base + "/v1/sessions/sess-mid", timeout=30).status_code == 200
    t.join(120)
    engine = Engine(tiny, EngineConfig(num_blocks=256, enable_prefix_cache=False))
    want = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0].output_text
    assert out["choices"][0]["text"] == want
    deadline, held = time.monotonic() + 30, None
    while time.monotonic() < deadline:  # load reports come every second: one from after the request ended
        reports = asyncio.run(latest_reports(url, enough=lambda seen: {r.role for r in seen.values()} >= {"prefill",
                                                                                                          "decode"}))
        held = {r.instance: (r.running, r.capacity_tokens - r.free_tokens) for r in reports.values()
                if r.role in ("prefill", "decode")}
        if all(v == (0, 0) for v in held.values()):
            break
        time.sleep(0.5)
    assert all(v == (0, 0) for v in held.values()), held
