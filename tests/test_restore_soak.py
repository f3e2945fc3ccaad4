"""The restore soak at its CI size (bench/soak.py --quick): a real system (tiny model, 2 small stores that
evict all the time, a device cache of ~2 prompts) taking a few hundred save -> evict -> restore turns
across sessions, with chunks removed mid-history, first chunks overwritten with garbage, and store-1
killed halfway (and restarted by `moorage up`). Every output must equal the from-scratch one, and
no removed or corrupted chunk may ever be served."""

from __future__ import annotations

import pytest

from bench.soak import QUICK, run_soak

pytestmark = pytest.mark.slow  # a couple of minutes: `make test` runs it, `make test-fast` does not


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    return run_soak(QUICK, str(tmp_path_factory.mktemp("soak")))


def test_every_turn_matches_from_scratch(soak):
    c = soak["counts"]
    print("\nsoak counts:", {k: v for k, v in c.items()})
    assert c["cycles"] == QUICK.cycles and c["errors"] == 0
    assert c["mismatches"] == 0
    assert all(r["ok"] for r in soak["records"] if "ok" in r)


def test_the_soak_exercised_what_it_claims(soak):
    c, o = soak["counts"], soak["counts"]["outcomes"]
    # the pool served a good share of the turns (timing decides which chunks the small stores still hold):
    # 54-66 restores of 240 in 6 runs once; on 2026-12-06 37-70 in 8 counted runs, this code and the code
    # before stop 46 alike, two below a floor of a sixth (a CI run failed at 39), so an eighth: room for
    # noise, none for a broken pool (which restores nothing)
    assert c["restores"] >= QUICK.cycles // 8
    assert o["restored"] > 0 and o["fresh"] > 0
    assert c["partial_restores"] + c["misses"] > 0  # the small pool lost history along the way
    assert c["midway_evictions"] > 0 and c["corruptions"] > 0
    aligned = {r["prompt_tokens"] % QUICK.chunk_tokens for r in soak["records"] if "prompt_tokens" in r}
    assert {0, 1, QUICK.chunk_tokens - 1} <= aligned  # at, after and before chunk boundaries


def test_removed_or_corrupted_chunks_are_never_served(soak):
    c = soak["counts"]
    assert c["served_bad_chunk"] == 0
    cut_turns = [r for r in soak["records"] if r.get("bad_chunk") is not None]
    assert cut_turns and all(r["ok"] for r in cut_turns)


def test_corrupted_objects_are_never_restored_and_good_ones_always_verify(soak):
    """Garbage under a first chunk's key: a turn that misses the device cache restores nothing from the
    pool and still answers as from scratch; and no good object ever fails its checksum (a verify failure
    for each corruption at most). Whether a corrupted turn reaches the pool at all is the churn's timing
    (the device cache may still hold the chunk, or a small store may have evicted it first: a CI run
    saw none do), so the failure counter going up is proven where it is deterministic:
    tests/test_pool_e2e.py::test_corrupted_object_is_detected_and_recomputed."""
    corrupted = [r for r in soak["records"] if r.get("bad_chunk") == 0]
    assert corrupted and all(r["ok"] and r["store"] == 0 for r in corrupted if r["device"] == 0)
    assert soak["counts"]["verify_failures"] <= soak["counts"]["corruptions"]


def test_store_restarted_midway(soak):
    assert soak["counts"]["store_restarts"] == 1
    assert soak["launcher_restarts"].get("store-1", 0) >= 1


def test_router_store_index_follows_the_pool(soak):
    """Store-tier events under real churn: the master reported what the pool evicted, so once quiet the
    router's store index holds exactly the pool's chunks, no more than the pool can hold."""
    idx = soak["store_index"]
    assert idx["master_store_events"]["removed"] > 0
    assert idx["router_store_chunks"] == idx["pool_chunks"]
    assert idx["pool_chunks"] <= 2 * QUICK.store_bytes // (1 << 20)  # tiny: 1 MiB per 256-token chunk
