"""Cache-aware routing: the KV index mirrored from events, and the CacheAware strategy in the picker chain.
Pure logic, no bus."""

from __future__ import annotations

import random

import pytest

from services.router.kv_index import KVIndex
from services.router.metrics import RouterMetrics
from services.router.routing import CacheAware, LoadTable, PickRequest, make_picker
from shared.hashing import BLOCK_TOKENS, block_hashes, namespace_seed
from shared.messages import KVEventBatch, LoadReport

NS = "model-a/bf16/b16"


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def stored(hashes, medium="device"):
    return {"type": "stored", "hashes": list(hashes), "medium": medium}


def removed(hashes, medium="device"):
    return {"type": "removed", "hashes": list(hashes), "medium": medium}


def report(instance, ready=True, queued=0, ns: str | None = NS):
    return LoadReport(instance, "prefill", ready, queued_tokens=queued,
                      detail={} if ns is None else {"kv_namespace": ns})


def prompt(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BLOCK_TOKENS))


def hashes_of(ids, ns=NS):
    return block_hashes(ids, namespace_seed(ns))


def picker(policy="cache-aware", imbalance=16384, seed=0, timeout=5.0):
    return make_picker(policy, LoadTable(timeout), 60.0, random.Random(seed), max_imbalance_tokens=imbalance)


def feed(p, now, *reports):
    for r in reports:
        p.update(r, now)


# ---- KVIndex ---------------------------------------------------------------------------------------------
def test_index_stored_removed_cleared_and_longest_prefix():
    idx = KVIndex()
    idx.apply("a", [stored([h(0), h(1), h(2), h(4)])])
    assert idx.longest_prefix("a", [h(0), h(1), h(2), h(3), h(4)]) == 3   # stops at the first gap
    assert idx.longest_prefix("a", [h(9), h(0)]) == 0
    assert idx.longest_prefix("b", [h(0)]) == 0
    assert idx.longest_prefix("a", [h(0), h(1), h(2), h(4)], start=2) == 4
    idx.apply("a", [removed([h(1), h(77)])])
    assert idx.longest_prefix("a", [h(0), h(1), h(2)]) == 1
    idx.apply("b", [stored([h(0)])])
    idx.apply("a", [{"type": "cleared", "hashes": [], "medium": "device"}])
    assert idx.blocks("a") == 0 and idx.instances() == ["b"]                 # only a's entries go
    idx.forget("b")
    assert idx.instances() == [] and idx.total_blocks == 0
    idx.check_integrity()


def test_index_store_medium_is_a_global_count_only():
    idx = KVIndex()
    idx.apply("a", [stored([h(1), h(2)], "store"), stored([h(3)])])
    idx.apply("b", [stored([h(2), h(5)], "store")])
    assert idx.store_chunks == 3 and idx.blocks("a") == 1 and idx.blocks("b") == 0
    assert idx.longest_prefix("b", [h(2)]) == 0                              # the store does not steer
    idx.apply("master", [removed([h(1)], "store")])
    assert idx.store_chunks == 2
    idx.apply("master", [{"type": "cleared", "hashes": [], "medium": "store"}])
    assert idx.store_chunks == 0 and idx.blocks("a") == 1
    idx.check_integrity()


def test_index_is_bounded_oldest_first():
    idx = KVIndex(max_blocks=4, max_store_chunks=2)
    idx.apply("a", [stored([h(0), h(1), h(2)])])
    idx.apply("a", [stored([h(0)])])              # refreshed: now the newest
    idx.apply("a", [stored([h(3), h(4)])])        # over the cap by one: h(1) goes
    assert [idx.longest_prefix("a", [h(i)]) for i in range(5)] == [1, 0, 1, 1, 1]
    idx.apply("a", [stored([h(i) for i in range(10, 20)], "store")])
    assert idx.store_chunks == 2 and idx.evicted == 1 + 8
    idx.check_integrity()


def test_index_ignores_and_counts_malformed_events():
    idx = KVIndex()
    idx.apply("a", [stored([h(0)])])
    bad = [None, "stored", {"type": 3}, {"type": "stored", "hashes": "abc"}, stored(["not bytes"]),
           stored([b"short"]), stored([h(1), 7]), {"type": "removed", "hashes": [h(0)], "medium": None}]
    assert idx.apply("a", bad) == len(bad)
    assert idx.apply("a", "not a list") == 1 and idx.apply("", [stored([h(2)])]) == 1
    assert idx.malformed == len(bad) + 2 and idx.blocks("a") == 1
    # a newer publisher's types and media are not errors, and change nothing here
    assert idx.apply("a", [{"type": "transferred", "hashes": [h(0)], "medium": "device"},
                           stored([h(5)], "ssd")]) == 0
    assert idx.blocks("a") == 1 and idx.store_chunks == 0
    idx.check_integrity()


def test_index_random_operations_keep_integrity():
    rng = random.Random(5)
    idx = KVIndex(max_blocks=50, max_store_chunks=20)
    for _ in range(500):
        inst = rng.choice("abc")
        kind = rng.choice(["stored", "stored", "removed", "cleared"])
        medium = rng.choice(["device", "device", "store"])
        idx.apply(inst, [{"type": kind, "hashes": [h(rng.randrange(120)) for _ in range(rng.randrange(12))],
                          "medium": medium}])
        if rng.random() < 0.02:
            idx.forget(inst)
        idx.check_integrity()


def test_kv_event_batch_round_trip_feeds_the_index():
    ids = prompt(3)
    raw = KVEventBatch("a", [stored(hashes_of(ids))]).encode()
    batch = KVEventBatch.decode(raw)
    idx = KVIndex()
    assert idx.apply(batch.instance, batch.events) == 0
    assert idx.longest_prefix("a", hashes_of(ids)) == 3


# ---- CacheAware in the chain -----------------------------------------------------------------------------
def test_longest_resident_prefix_wins_over_load():
    p = picker()
    ids = prompt(12)
    hs = hashes_of(ids)
    feed(p, 0.0, report("a", queued=0), report("b", queued=4000), report("c", queued=9000))
    p.index.apply("a", [stored(hs[:2])])
    p.index.apply("b", [stored(hs[:9])])
    p.index.apply("c", [stored(hs[:5])])
    assert p.pick(None, 0.0, len(ids), ids) == "b"
    assert p.last.reason == "cache" and p.last.resident_tokens == 9 * BLOCK_TOKENS


def test_equal_prefixes_go_to_the_less_loaded():
    p = picker()
    ids = prompt(4)
    feed(p, 0.0, report("a", queued=500), report("b", queued=100), report("c", queued=0))
    for inst in ("a", "b"):
        p.index.apply(inst, [stored(hashes_of(ids)[:2])])    # a shared system prompt on a and b
    assert p.pick(None, 0.0, len(ids), ids) == "b"


def test_long_prompt_is_matched_past_every_hashing_step():
    ids = prompt(200)
    hs = hashes_of(ids)
    for depth in (1, 7, 8, 9, 33, 150, 200):
        p = picker()
        feed(p, 0.0, report("a"), report("b"))
        p.index.apply("a", [stored(hs[:depth])])
        p.index.apply("b", [stored(hs[:depth - 1] + hs[depth:])])   # a hole: only depth-1 leading blocks
        assert p.pick(None, 0.0, len(ids), ids) == "a"
        assert p.last.resident_tokens == depth * BLOCK_TOKENS
    # a partial tail block has no hash: 20 tokens are 1 block
    assert CacheAware(p.index).resident(p.loads.fresh("prefill", 0.0), PickRequest(None, 0.0, 20, ids[:20])) == \
        {"a": 1, "b": 1}


@pytest.mark.parametrize("lead, expect", [(16384, "cache"), (16385, "load")])
def test_overloaded_holder_falls_back_to_load(lead, expect):
    p = picker(imbalance=16384)
    ids = prompt(8)
    feed(p, 0.0, report("a", queued=1000 + lead), report("b", queued=1000))
    p.index.apply("a", [stored(hashes_of(ids))])
    choice = p.pick(None, 0.0, len(ids), ids)
    assert p.last.reason == expect
    assert choice == ("a" if expect == "cache" else "b")   # p2c over two: the less loaded
    if expect == "load":
        assert p.last.resident_tokens == 0


def test_assigned_tokens_between_reports_count_toward_overload():
    p = picker(imbalance=1000)
    ids = prompt(8)
    feed(p, 0.0, report("a"), report("b"))
    p.index.apply("a", [stored(hashes_of(ids))])
    picks = [p.pick(None, 0.0, 600, ids) for _ in range(4)]
    assert picks[:2] == ["a", "a"] and "b" in picks[2:]     # a's estimated queue passes b's by > 1000


def test_no_resident_prefix_means_load_decides():
    p = picker()
    feed(p, 0.0, report("a", queued=50_000), report("b", queued=0))
    p.index.apply("a", [stored(hashes_of(prompt(4, start=999)))])   # some other prompt
    ids = prompt(4)
    assert p.pick(None, 0.0, len(ids), ids) == "b"
    assert p.last.reason == "load" and p.last.resident_tokens == 0
    assert p.pick(None, 0.0, 3, [1, 2, 3]) == "b"                    # shorter than a block


def test_sticky_owner_still_comes_first():
    p = picker()
    ids = prompt(6)
    feed(p, 0.0, report("a"), report("b"))
    owner = p.pick("sess", 0.0, 0, [])
    other = "b" if owner == "a" else "a"
    p.index.apply(other, [stored(hashes_of(ids))])
    assert p.pick("sess", 1.0, len(ids), ids) == owner
    assert p.last.reason == "sticky" and p.last.resident_tokens is None
    assert p.pick("new-session", 1.0, len(ids), ids) == other        # a new session follows the cache
    assert p.sticky.owner("new-session", 1.0) == other


def test_namespace_is_per_instance():
    p = picker()
    ids = prompt(6)
    feed(p, 0.0, report("a", ns="ns-x"), report("b", ns="ns-y"), report("c", ns=None))
    p.index.apply("a", [stored(hashes_of(ids, "ns-y")[:5])])   # a's chain is seeded by ns-x: no match
    p.index.apply("b", [stored(hashes_of(ids, "ns-y")[:3])])
    p.index.apply("c", [stored(hashes_of(ids, NS))])           # c names no namespace: not consulted
    assert p.pick(None, 0.0, len(ids), ids) == "b"
    p.index.apply("a", [stored(hashes_of(ids, "ns-x")[:4])])
    assert p.pick(None, 0.0, len(ids), ids) == "a"
    assert p.last.resident_tokens == 4 * BLOCK_TOKENS


def test_index_that_missed_events_still_routes_to_a_ready_instance():
    p = picker()
    ids = prompt(8)
    hs = hashes_of(ids)
    feed(p, 0.0, report("a"), report("b"), report("gone", ready=False))
    # every "stored" lost; or a lost "removed" left claims for an instance that is not a candidate
    p.index.apply("gone", [stored(hs)])
    p.index.apply("ghost", [stored(hs)])
    for _ in range(20):
        assert p.pick(None, 0.0, len(ids), ids) in {"a", "b"}
    # a lost "removed": the index overestimates a; a is still ready, so still a valid choice
    p.index.apply("a", [stored(hs)])
    assert p.pick(None, 0.0, len(ids), ids) == "a"


@pytest.mark.parametrize("how", ["stale", "not_ready", "namespace"])
def test_instance_that_goes_away_is_forgotten(how):
    p = picker(timeout=5.0)
    ids = prompt(4)
    feed(p, 0.0, report("a"), report("b"))
    p.index.apply("a", [stored(hashes_of(ids))])
    p.index.apply("b", [stored(hashes_of(ids)[:1])])
    if how == "stale":
        feed(p, 4.0, report("b"))
        feed(p, 7.0, report("b"))                            # a silent for 7 s > 5 s
        feed(p, 7.5, report("a"))                            # back: what it held meanwhile is unknown
    elif how == "not_ready":
        feed(p, 1.0, report("a", ready=False))
        feed(p, 2.0, report("a"))
    else:
        feed(p, 1.0, report("a", ns="other"))
    assert p.index.blocks("a") == 0 and p.index.blocks("b") == 1
    p.index.check_integrity()


def test_unreported_instance_has_a_grace_period():
    p = picker(timeout=5.0)
    p.index.apply("early", [stored([h(1)])])             # events may beat the first load report
    feed(p, 0.0, report("x"))
    feed(p, 4.0, report("x"))
    assert p.index.blocks("early") == 1
    feed(p, 5.5, report("x"))
    assert p.index.blocks("early") == 0
    p.index.apply("late", [stored([h(1)])])
    for t in range(6, 21):                                # reporting every second: kept
        feed(p, float(t), report("x"), report("late"))
    assert p.index.blocks("late") == 1


def test_other_policies_have_no_index_and_ignore_prompt_ids():
    for policy in ("sticky", "p2c"):
        p = picker(policy)
        feed(p, 0.0, report("a", queued=10_000), report("b"))
        assert p.index is None
        assert p.pick(None, 0.0, 64, prompt(4)) == "b"
        assert p.last.reason == "load" and p.last.resident_tokens is None


def test_metrics_count_decisions_by_reason():
    m = RouterMetrics()
    p = picker()
    ids = prompt(4)
    feed(p, 0.0, report("a"), report("b"))
    p.index.apply("a", [stored(hashes_of(ids)), stored([h(3)], "store")])
    m.watch_index(p.index)
    p.pick("s", 0.0, len(ids), ids)
    m.observe_route(p.last)
    p.pick("s", 0.0, len(ids), ids)
    m.observe_route(p.last)
    text = m.render().decode()
    assert 'moorage_router_routed_total{reason="cache"} 1.0' in text
    assert 'moorage_router_routed_total{reason="sticky"} 1.0' in text
    assert "moorage_router_resident_prefix_tokens_count 1.0" in text
    assert "moorage_router_kv_index_blocks 4.0" in text and "moorage_router_kv_store_chunks 1.0" in text
