"""The offline LRU and optimum (bench/agentic/offline.py) on traces small enough to work out by hand."""

from __future__ import annotations

import random

from bench.agentic.offline import chained, lru, optimum, policies


def test_a_returning_session_that_lru_evicts_and_the_optimum_keeps():
    # capacity 4 blocks. A (2 blocks) pauses, B (3 blocks) runs, A returns, then B returns.
    reqs = chained([("a", [1, 2]), ("b", [1, 2, 3]), ("a", [1, 2, 5]), ("b", [1, 2, 3, 4])])
    # LRU: after B, A's 2 blocks + B's 3 = 5 > 4: A's first block goes, so A's return reuses nothing;
    # then B's oldest blocks go too and B reuses nothing: 0 of 12
    assert lru(reqs, 4) == (0, 12)
    # optimum: A's blocks are needed sooner than B's, so B's deepest block goes: A returns with 2 hits, then A's
    # blocks (never used again) and a5 make room and B returns with b1, b2: 2 hits. Keeping all of B instead
    # would give 3, keeping A and B's first two 4: 4 is the best there is.
    assert optimum(reqs, 4) == (4, 12)


def test_same_ids_under_two_prefixes_are_two_blocks():
    reqs = chained([("s", [1, 2]), ("s", [9, 2])])
    assert reqs[0][1] != reqs[1][1]
    assert lru(reqs, 10) == (0, 4)


def test_unbounded_is_the_prefix_ceiling_and_the_optimum_never_loses_to_lru():
    rng = random.Random(7)
    sessions = {f"s{i}": [] for i in range(6)}
    trace = []
    for _ in range(60):
        name = rng.choice(list(sessions))
        sessions[name] += [rng.randrange(1000) for _ in range(rng.randint(1, 4))]
        trace.append((name, list(sessions[name])))
    keys = chained(trace)
    big = sum(len(k) for k in keys)
    assert lru(keys, big) == optimum(keys, big)  # nothing evicted: both are the ceiling
    for cap in (5, 10, 20, 40, 80):
        assert optimum(keys, cap)[0] >= lru(keys, cap)[0]
    shares = policies(trace, {"small": 10, "all": big})
    assert shares["all"]["lru"] == shares["all"]["optimum"] > shares["small"]["lru"]
