"""The pool's turnover as the router hears it (services/router/pool_turnover.py): chunks heard entering (prefills'
"stored", medium store) and leaving evicted (the master's "removed" with cause "evicted"). Clock injected."""

import pytest

from services.router.pool_turnover import MIN_EVICTIONS, PoolTurnover


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _d(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _stored(*ids: int) -> list[dict]:
    return [{"type": "stored", "medium": "store", "hashes": [_d(i) for i in ids]}]


def _removed(*ids: int, cause: str = "evicted") -> list[dict]:
    return [{"type": "removed", "medium": "store", "hashes": [_d(i) for i in ids], "causes": [cause]}]


def test_the_turnover_is_the_median_age_of_recent_evictions():
    clock = Clock()
    t = PoolTurnover(window_s=300, clock=clock)
    n = MIN_EVICTIONS + 1
    for i in range(n):
        clock.t = float(i)
        t.apply(_stored(i))
        t.apply(_stored(i))  # said twice (prefill, then the master's listing): the first time counts
    assert t.turnover_s() is None  # nothing evicted: no pressure
    clock.t = 100.0
    t.apply(_removed(*range(n - 2)))
    assert t.turnover_s() is None  # one short of MIN_EVICTIONS
    clock.t = 110.0
    t.apply(_removed(n - 2, n - 1))
    assert n % 2
    ages = sorted([100.0 - i for i in range(n - 2)] + [110.0 - (n - 2), 110.0 - (n - 1)])
    assert t.turnover_s() == ages[len(ages) // 2]  # (an odd count: the middle one)
    assert t.stats()["pool_turnover_s"] == round(t.turnover_s(), 1)
    clock.t = 500.0  # the evictions are older than the window: the pressure is gone
    assert t.turnover_s() is None and "pool_turnover_s" not in t.stats()


def test_only_store_evictions_of_chunks_heard_entering_count():
    clock = Clock()
    t = PoolTurnover(window_s=300, clock=clock)
    t.apply(_stored(*range(40)))
    t.apply([{"type": "stored", "medium": "device", "hashes": [_d(i) for i in range(40, 80)]}])
    clock.t = 50.0
    t.apply(_removed(*range(20), cause="deleted"))        # a session closed: not pressure
    t.apply(_removed(*range(40, 80)))                     # never heard entering (device medium): no age
    t.apply([{"type": "removed", "medium": "device", "hashes": [_d(i) for i in range(20, 40)]}])
    assert t.turnover_s() is None
    t.apply([{"type": "cleared", "medium": "store", "hashes": []}])  # the master restarted: all gone, no ages
    t.apply(_removed(*range(20, 40)))
    assert t.turnover_s() is None and t.stats()["pool_chunks_tracked"] == 0
    for bad in (None, "x", [None, {"medium": "store"}, {"type": "stored", "medium": "store", "hashes": "no"}]):
        t.apply(bad)  # malformed: ignored


def test_entry_times_are_bounded():
    t = PoolTurnover(window_s=300, max_chunks=10, clock=Clock())
    t.apply(_stored(*range(25)))
    assert t.stats()["pool_chunks_tracked"] == 10
    with pytest.raises(ValueError):
        PoolTurnover(window_s=0)
