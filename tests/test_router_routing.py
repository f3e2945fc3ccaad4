"""The router's prefill choice: pure logic, no bus."""

from __future__ import annotations

import random

import pytest

from services.router.config import ROUTING_POLICIES, RouterSettings
from services.router.routing import POLICIES, LoadTable, PowerOfTwo, make_picker
from shared.messages import LoadReport


def report(instance: str, ready: bool = True, queued: int = 0, running: int = 0, role: str = "prefill"):
    return LoadReport(instance, role, ready, queued_tokens=queued, running=running)


STICKY_POLICIES = ["cache-aware", "sticky"]  # both start with the session owner


def picker(policy: str = "cache-aware", idle: float = 60.0, timeout: float = 5.0, seed: int = 0):
    loads = LoadTable(timeout)
    return make_picker(policy, loads, idle, random.Random(seed))


def feed(p, now: float, *reports) -> None:
    for r in reports:
        p.update(r, now)


def test_no_candidates_none():
    p = picker()
    assert p.pick("s", 0.0) is None
    feed(p, 0.0, report("a", ready=False), report("g", role="gate"), report("d", role="decode"))
    assert p.pick("s", 0.0) is None


@pytest.mark.parametrize("policy", STICKY_POLICIES)
def test_sticky_keeps_owner_even_when_busier(policy):
    p = picker(policy)
    feed(p, 0.0, report("a"), report("b"))
    first = p.pick("sess", 0.0)
    other = "b" if first == "a" else "a"
    feed(p, 1.0, report(first, queued=100_000, running=9), report(other))
    assert all(p.pick("sess", 1.0 + i / 10) == first for i in range(20))


@pytest.mark.parametrize("policy", STICKY_POLICIES)
def test_sessions_are_independent_and_anonymous_requests_do_not_stick(policy):
    p = picker(policy)
    feed(p, 0.0, report("a"), report("b"))
    p.pick("s1", 0.0)
    p.pick(None, 0.0)
    assert set(p.sticky.sessions) == {"s1"}


@pytest.mark.parametrize("policy", STICKY_POLICIES)
def test_idle_expiry_lets_load_decide_again(policy):
    p = picker(policy, idle=10.0)
    feed(p, 0.0, report("a"), report("b"))
    owner = p.pick("sess", 0.0)
    other = "b" if owner == "a" else "a"
    feed(p, 9.0, report(owner, queued=5000), report(other))
    assert p.pick("sess", 9.0) == owner           # 9 s idle: still sticky (and refreshed)
    feed(p, 19.5, report(owner, queued=5000), report(other))
    assert p.pick("sess", 19.5) == other          # 10.5 s idle: expired, p2c picks the idle one
    assert p.sticky.owner("sess", 19.5) == other  # and the session moves there


@pytest.mark.parametrize("policy", STICKY_POLICIES)
def test_expired_sessions_are_swept(policy):
    p = picker(policy, idle=10.0)
    feed(p, 0.0, report("a"))
    for i in range(50):
        p.pick(f"s{i}", 0.0)
    feed(p, 100.0, report("a"))
    p.pick("late", 100.0)
    assert list(p.sticky.sessions) == ["late"]


@pytest.mark.parametrize("policy", STICKY_POLICIES)
@pytest.mark.parametrize("how", ["stale", "not_ready"])
def test_failover_when_owner_goes_away(how, policy):
    p = picker(policy, timeout=5.0)
    feed(p, 0.0, report("a"), report("b"))
    owner = p.pick("sess", 0.0)
    other = "b" if owner == "a" else "a"
    if how == "stale":
        feed(p, 7.0, report(other))                  # owner silent for 7 s > 5 s
    else:
        feed(p, 7.0, report(owner, ready=False), report(other))
    assert p.pick("sess", 7.0) == other
    assert p.sticky.owner("sess", 7.0) == other
    feed(p, 8.0, report("a"), report("b"))           # the old owner is back: the session stays put
    assert p.pick("sess", 8.0) == other


def test_p2c_prefers_less_loaded():
    p = picker("p2c")
    feed(p, 0.0, report("a", queued=10_000), report("b", queued=0))
    assert {p.pick("sess", 0.0) for _ in range(30)} == {"b"}
    assert p.sticky is None


def test_p2c_breaks_queued_ties_on_running():
    two = PowerOfTwo(random.Random(1))
    loads = LoadTable(5.0)
    loads.update(report("a", queued=0, running=3), 0.0)
    loads.update(report("b", queued=0, running=1), 0.0)
    assert two(loads.fresh("prefill", 0.0), None) == "b"


def test_p2c_spreads_and_counts_assigned_tokens_between_reports():
    p = picker("p2c", seed=3)
    feed(p, 0.0, report("a"), report("b"))
    picks = [p.pick(None, 0.0, prompt_tokens=1000) for _ in range(10)]
    assert picks.count("a") == 5 and picks.count("b") == 5  # assigned tokens alternate the choice
    feed(p, 1.0, report("a"), report("b"))                   # fresh reports reset the estimate
    assert p.loads.get("prefill", "a").assigned_tokens == 0


def test_p2c_samples_among_many():
    p = picker("p2c", seed=7)
    feed(p, 0.0, *[report(f"p{i}") for i in range(8)])
    chosen = {p.pick(None, 0.0) for _ in range(200)}
    assert len(chosen) == 8


def test_seeded_rng_is_deterministic():
    def run():
        p = picker("p2c", seed=42)
        feed(p, 0.0, *[report(f"p{i}", queued=i % 3) for i in range(5)])
        return [p.pick(None, 0.0) for _ in range(20)]
    assert run() == run()


def test_unknown_policy():
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_picker("cache-aware-v9", LoadTable(5.0), 60.0)


def test_load_table_forgets_long_silent_instances():
    loads = LoadTable(1.0)
    loads.update(report("old"), 0.0)
    loads.update(report("new"), 100.0)
    assert loads.get("prefill", "old") is None
    assert [v.instance for v in loads.fresh("prefill", 100.0)] == ["new"]


def test_default_policy_is_cache_aware_and_every_configured_policy_exists():
    assert RouterSettings().routing == "cache-aware"
    assert set(ROUTING_POLICIES) == set(POLICIES)
    assert make_picker("cache-aware", LoadTable(5.0), 60.0).index is not None
    assert make_picker("sticky", LoadTable(5.0), 60.0).index is None


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_retry_never_goes_to_the_excluded_prefill(policy):
    p = picker(policy)
    feed(p, 0.0, report("a"), report("b", queued=10_000))
    assert p.pick("s", 0.0) == "a"  # the session now sticks to a, which is also the less loaded
    for _ in range(10):
        assert p.pick("s", 0.1, exclude={"a"}) == "b"
    assert p.pick("s", 0.2, exclude={"a", "b"}) is None


def test_load_table_listeners_hear_every_report():
    table, heard = LoadTable(5.0), []
    table.listeners.append(lambda r, now: heard.append((r.instance, r.ready, now)))
    table.update(report("a"), 1.0)
    table.update(report("d", ready=False, role="decode"), 2.0)
    assert heard == [("a", True, 1.0), ("d", False, 2.0)]
