"""`moorage up --set prefill.pp=2 --set decode.dcp=2` for real: prefill runs as two pipeline ranks (one process
per layer span), decode as two context-parallel ranks (one process per half of the tokens), and the KV changes
layout on the way. The pool keeps one object per stage and counts a chunk only when both stages hold it, output
equals the from-scratch engine's (cold, restored from the pool, handed off as a delta), and a rank killed
mid-service fails what its instance was doing with a clear error, the instance comes back as a unit, and no KV
budget is left held."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import httpx
import pytest

from shared.config import load_config
from shared.hashing import CHUNK_TOKENS, chunk_hashes, namespace_seed
from shared.kv_object import object_key
from shared.pool import PoolClient, PoolConfig
from infra.up import UpConfig, launched
from tests.natsbus import latest_reports, nats_url
from tests.test_pool_e2e import complete, scratch_text, tokens, trace_of


def _system(run_dir, *overrides):
    """tiny, prefill as two pipeline ranks, decode as two context-parallel ranks, and `overrides`."""
    with nats_url() as url:
        cfg = load_config(UpConfig, overrides=[
            "up.model=tiny", "up.port=0", f"up.nats_url={url}", "up.ready_timeout_s=120", f"up.run_dir={run_dir}",
            "prefill.pp=2", "decode.dcp=2", "up.restart_backoff_s=0.2", *overrides])
        with launched(cfg) as (launcher, base):
            yield launcher, base, url


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    yield from _system(tmp_path_factory.mktemp("pp"), "up.store_bytes=67108864",
                       "prefill.engine.num_blocks=80",   # 1280 tokens of device KV: another history evicts the first
                       "prefill.engine.long_prefill_tokens=0", "prefill.pool.min_restore_tokens=256",
                       "decode.engine.num_blocks=512",
                       "up.disk_bytes=0")  # the DRAM pool's group miss: no disk tier to put back what a test removes


def report(nats: str, role: str = "prefill", boot: str | None = None):
    """The role's latest load report (one from a new process when `boot` names the old one)."""
    def enough(seen):
        return any(r.role == role and r.ready and r.boot != boot for r in seen.values())
    seen = asyncio.run(latest_reports(nats, enough=enough))
    return next(r for r in seen.values() if r.role == role)


def wait_for_line(log, text: str) -> None:
    """Until the service's log says `text` and that it stops for a restart."""
    deadline = time.monotonic() + 10
    while not (text in (content := log.read_text()) and "stopping for a restart" in content):
        assert time.monotonic() < deadline, f"{log.name} never said {text!r} and stopped for a restart"
        time.sleep(0.1)


def prefill_report(nats: str, boot: str | None = None):
    return report(nats, "prefill", boot)


def test_greedy_output_and_restore_across_stage_ranks(system, tiny):
    launcher, base, nats = system
    pre = prefill_report(nats)
    assert [r["rank"] for r in pre.detail["ranks"]] == [0, 1]
    assert pre.detail["ranks"][1]["layers"] == [2, 3] and pre.detail["ranks"][1]["alive"]
    history = tokens(31, 700)
    first = complete(base, history, "pp-s")
    assert first["choices"][0]["text"] == scratch_text(tiny, history)
    handoff = {s["name"]: s for s in trace_of(launcher, first["id"], {"kv.handoff"})}["kv.handoff"]["attributes"]
    # the staged path (decode's ranks take no direct writes): one write per landing slot of bytes, whatever the
    # stages and ranks, where a copy as the KV lies would take one per token and layer
    assert handoff["mode"] == "slots" and handoff["bytes"] == 700 * 4 * 2 * 2 * 64 * 4
    assert handoff["writes"] == -(-handoff["bytes"] // (8 << 20)) and handoff["naive_writes"] == 700 * 4
    complete(base, tokens(10_031, 1200), "pp-s")  # another history fills the device cache
    turn2 = history + tokens(32, 60)
    second = complete(base, turn2, "pp-s")
    assert second["usage"]["moorage"]["store"] == 2 * CHUNK_TOKENS  # both chunks, each from its two stage objects
    assert second["choices"][0]["text"] == scratch_text(tiny, turn2)
    assert prefill_report(nats).detail["pipeline"]["steps"] > 0
    dec = report(nats, "decode")
    assert [k["tokens"] for k in dec.detail["ranks"]] == ["t % 2 == 0", "t % 2 == 1"]
    # the session's next turn: decode holds the landed blocks of turn 2 and is sent only the rest
    turn3 = turn2 + tokens(33, 30)
    third = complete(base, turn3, "pp-s")
    assert third["choices"][0]["text"] == scratch_text(tiny, turn3)
    assert report(nats, "decode").detail["reused_blocks"] > dec.detail["reused_blocks"]


def test_chunk_missing_one_stage_object_is_a_miss_for_all_stages(system, tiny):
    launcher, base, nats = system
    history = tokens(41, 700)
    complete(base, history, "pp-g")
    ns = prefill_report(nats).detail["kv_namespace"]
    client = PoolClient(PoolConfig(master_addr=launcher.configs["prefill-0"].pool.master_addr))
    try:
        digests = chunk_hashes(history, namespace_seed(ns))
        deadline = time.monotonic() + 10
        keys = [object_key(ns, s, 2, d) for d in digests for s in range(2)]
        while client.exists(keys) != [True] * 4 and time.monotonic() < deadline:
            time.sleep(0.2)  # saves are asynchronous
        assert client.exists(keys) == [True] * 4
        assert client.remove([object_key(ns, 0, 2, digests[1])], force=True) == [0]  # chunk 1 loses stage 0
    finally:
        client.close()
    complete(base, tokens(10_041, 1200), "pp-g")
    turn2 = history + tokens(42, 40)
    second = complete(base, turn2, "pp-g")
    assert second["usage"]["moorage"]["store"] == CHUNK_TOKENS  # chunk 0 only: never half a chunk
    assert second["choices"][0]["text"] == scratch_text(tiny, turn2)


@pytest.fixture(scope="module")
def roomy(tmp_path_factory):
    """Room for a prompt long enough to be mid-computation when its rank dies (no pool: not the point here)."""
    yield from _system(tmp_path_factory.mktemp("pp-kill"), "up.pool=false", "prefill.engine.num_blocks=2048",
                       "decode.engine.num_blocks=2048")


def test_prefill_rank_killed_fails_its_requests_and_the_instance_returns(roomy, tiny):
    launcher, base, nats = roomy
    before = prefill_report(nats)
    rank1 = before.detail["ranks"][1]["pid"]
    results: list = []

    def long_request():
        r = httpx.post(base + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": tokens(51, 20_000), "max_tokens": 4, "temperature": 0})
        results.append((time.monotonic(), r))

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(2.0)  # admitted and computing: 20K tokens take several seconds on two ranks here
    killed_at = time.monotonic()
    os.kill(rank1, 9)
    t.join(60)
    ended, r = results[0]
    # a 503 (the instance restarts): with the rank's exit, or, when the router's retry found the prefill gone, that
    assert r.status_code == 503, r.text
    assert f"pipeline rank 1 (pid {rank1}) exited with code -9" in r.text or "prefill instance" in r.text, r.text
    wait_for_line(launcher.run_dir / "prefill-0.log", f"pipeline rank 1 (pid {rank1}) exited with code -9")
    assert ended - killed_at < 5.0  # the step fails at once; the router then reports the instance's exit
    after = prefill_report(nats, boot=before.boot)  # a new process, with new ranks
    assert after.detail["ranks"][1]["pid"] != rank1 and all(k["alive"] for k in after.detail["ranks"])
    prompt = tokens(52, 300)
    assert complete(base, prompt, "pp-after")["choices"][0]["text"] == scratch_text(tiny, prompt)
    seen = asyncio.run(latest_reports(nats, enough=lambda s: {"gate", "decode"} <= {x.role for x in s.values()}))
    by_role = {x.role: x for x in seen.values()}
    assert by_role["decode"].free_tokens == by_role["decode"].capacity_tokens  # nothing left held
    assert by_role["gate"].free_tokens == by_role["gate"].capacity_tokens


def test_decode_rank_killed_fails_its_requests_and_the_instance_returns(roomy, tiny):
    launcher, base, nats = roomy
    before = report(nats, "decode")
    rank1 = before.detail["ranks"][1]["pid"]
    results: list = []

    def long_answer():
        r = httpx.post(base + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": tokens(61, 200), "max_tokens": 3000, "temperature": 0, "ignore_eos": True})
        results.append(r)

    t = threading.Thread(target=long_answer)
    t.start()
    deadline = time.monotonic() + 30
    while report(nats, "decode").running == 0 and time.monotonic() < deadline:
        time.sleep(0.2)  # decoding now
    os.kill(rank1, 9)
    t.join(60)
    [r] = results
    # the step in flight fails with the rank's exit; had it been between steps, the instance fails it as it stops
    assert r.status_code == 503, r.text
    assert f"dcp rank 1 (pid {rank1}) exited with code -9" in r.text or "decode instance" in r.text, r.text
    wait_for_line(launcher.run_dir / "decode-0.log", f"dcp rank 1 (pid {rank1}) exited with code -9")
    after = report(nats, "decode", boot=before.boot)
    assert after.detail["ranks"][1]["pid"] != rank1 and all(k["alive"] for k in after.detail["ranks"])
    prompt = tokens(62, 300)
    assert complete(base, prompt, "dcp-after")["choices"][0]["text"] == scratch_text(tiny, prompt)
    seen = asyncio.run(latest_reports(nats, enough=lambda s: {"gate", "decode"} <= {x.role for x in s.values()}))
    by_role = {x.role: x for x in seen.values()}
    assert by_role["decode"].free_tokens == by_role["decode"].capacity_tokens
    assert by_role["gate"].free_tokens == by_role["gate"].capacity_tokens
