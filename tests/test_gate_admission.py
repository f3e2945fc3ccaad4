"""The gate's admission bookkeeping, as pure logic (no bus, no clock): every test runs in microseconds."""

from __future__ import annotations

import random

import pytest

from services.gate.admission import (NO_INSTANCE, Admission, Admitted, IntegrityError, Invalid, Rejected,
                                     Wait)
from services.gate.config import GateSettings
from shared.config import ConfigError, load_config


class Checked(Admission):
    """Admission that checks its books after every operation."""

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name in ("admit", "drain", "expire", "release", "report"):
            def checked(*a, **k):
                out = attr(*a, **k)
                self.check_integrity()
                return out
            return checked
        return attr


def gate(**settings) -> Checked:
    return Checked(GateSettings(**settings))


def test_budget_is_capacity_times_fraction():
    g = gate(budget_fraction=0.9)
    g.report("d0", 1000, 1000, True, now=0)
    assert g.admit("a", 800, 100, now=0) == Admitted("a", "d0", 900)
    assert isinstance(g.admit("b", 1, 0, now=0), Wait)  # 901 > 900 although 1000 are free
    assert g.stats(0)["reserved_tokens"] == {"d0": 900}


def test_least_committed_fraction_wins():
    g = gate(budget_fraction=1.0)
    g.report("big", 10_000, 10_000, True, now=0)
    g.report("small", 1_000, 1_000, True, now=0)
    assert g.admit("a", 500, 0, now=0).instance == "big"     # both empty: tie broken by name
    assert g.admit("b", 100, 0, now=0).instance == "small"   # big 5% committed, small 0%
    assert g.admit("c", 100, 0, now=0).instance == "big"     # small 10%, big 5%
    assert g.admit("d", 950, 0, now=0).instance == "big"     # does not fit small at all


def test_router_choice_is_honoured_when_live_and_big_enough():
    g = gate(budget_fraction=1.0)
    g.report("d0", 1000, 1000, True, now=0)
    g.report("d1", 1000, 1000, True, now=0)
    g.admit("a", 600, 0, now=0, instance="d1")
    assert g.admit("b", 100, 0, now=0, instance="d1").instance == "d1"  # not the least committed
    assert isinstance(g.admit("c", 400, 0, now=0, instance="d1"), Wait)  # waits for d1
    g.release("a")
    assert g.drain(now=0) == [Admitted("c", "d1", 400)]
    assert g.admit("d", 100, 0, now=0, instance="gone").instance == "d0"  # unknown: the gate picks


@pytest.mark.parametrize("settings, prompt, out, words", [
    (dict(max_input_tokens=100), 101, 1, ["max_input_tokens=100", "context length"]),
    (dict(max_output_tokens=50), 10, 51, ["max_output_tokens=50"]),
    (dict(), 950, 100, ["context length", "1000", "budget"]),
    (dict(), 0, 10, ["prompt_tokens"]),
    (dict(), 10, -1, ["max_tokens"]),
])
def test_invalid_says_which_limit(settings, prompt, out, words):
    g = gate(budget_fraction=1.0, **settings)
    g.report("d0", 1000, 1000, True, now=0)
    r = g.admit("x", prompt, out, now=0)
    assert isinstance(r, Invalid), r
    for w in words:
        assert w in r.reason
    assert g.counters["invalid"] == 1 and not g.queue and not g.reservations


def test_limits_apply_even_with_no_decode_known():
    g = gate(max_input_tokens=100)
    assert isinstance(g.admit("x", 101, 1, now=0), Invalid)
    assert isinstance(g.admit("y", 100, 10**9, now=0), Wait)  # capacity unknown: may fit later


def test_fifo_wait_then_admit_on_release():
    g = gate(budget_fraction=1.0)
    g.report("d0", 1000, 1000, True, now=0)
    g.admit("a", 900, 0, now=0)
    assert isinstance(g.admit("big", 500, 0, now=1), Wait)
    assert isinstance(g.admit("small", 10, 0, now=2), Wait)  # would fit, but must not overtake big
    assert g.drain(now=3) == []
    assert g.release("a") == "released"
    got = g.drain(now=4)
    assert [(a.request_id, a.waited_s) for a in got] == [("big", 3), ("small", 2)]
    assert g.counters["admitted"] == 3 and g.counters["released"] == 1


def test_head_of_line_blocks_until_it_fits():
    g = gate(budget_fraction=1.0)
    g.report("d0", 1000, 1000, True, now=0)
    g.admit("a", 600, 0, now=0)
    g.admit("head", 500, 0, now=0)
    for i in range(5):
        assert isinstance(g.admit(f"s{i}", 1, 0, now=0), Wait)
    assert g.drain(now=0) == []
    g.release("a")
    assert [a.request_id for a in g.drain(now=0)] == ["head", "s0", "s1", "s2", "s3", "s4"]


# ---- priority (agent hints) --------------------------------------------------------------------------
def test_a_higher_priority_waits_less_but_only_by_its_head_start():
    g = gate(budget_fraction=1.0, priority_step_s=2.0)
    g.report("d0", 1000, 1000, True, now=0)
    g.admit("a", 900, 0, now=0)
    assert isinstance(g.admit("low", 500, 0, now=1), Wait)               # due at 1
    assert isinstance(g.admit("old", 500, 0, now=2, priority=-1), Wait)  # due at 4
    assert isinstance(g.admit("high", 500, 0, now=5, priority=3), Wait)  # due at -1: first
    assert isinstance(g.admit("late", 500, 0, now=9, priority=3), Wait)  # due at 3: after low, before old
    order = []
    for rid in ("a", "high", "low", "late"):
        g.release(rid)
        order += [x.request_id for x in g.drain(now=10)]
    assert order == ["high", "low", "late", "old"]


def test_a_high_priority_request_that_fits_is_admitted_past_a_waiting_head():
    g = gate(budget_fraction=1.0)
    g.report("d0", 1000, 1000, True, now=0)
    g.admit("a", 600, 0, now=0)
    assert isinstance(g.admit("head", 500, 0, now=1), Wait)
    assert isinstance(g.admit("small", 10, 0, now=2), Wait)                 # due after head: waits (FIFO)
    assert g.admit("urgent", 10, 0, now=2, priority=1) == Admitted("urgent", "d0", 10)  # due at 0 < 1
    assert g.admit("eager", 10, 0, now=2, latency_s=1.5) == Admitted("eager", "d0", 10)  # due at 0.5 < 1
    assert isinstance(g.admit("meek", 10, 0, now=2, latency_s=0.5), Wait)    # due at 1.5: behind head


def test_an_expected_output_length_reserves_less_and_validity_stays_on_max_tokens():
    g = gate(budget_fraction=1.0, osl_margin=1.25)
    g.report("d0", 1000, 1000, True, now=0)
    assert g.admit("said", 100, 800, now=0, osl=80) == Admitted("said", "d0", 200)       # 100 + 80 x 1.25
    assert g.admit("more", 100, 50, now=0, osl=80) == Admitted("more", "d0", 150)        # never above max_tokens
    assert isinstance(g.admit("unsaid", 100, 800, now=0), Wait)                          # 900 does not fit in 650
    assert isinstance(g.admit("huge", 100, 950, now=0, osl=1), Invalid)                  # 1050 could never fit
    g.check_integrity()
    assert g.instances["d0"].reserved == 350
    off = gate(budget_fraction=1.0, osl_margin=0)
    off.report("d0", 1000, 1000, True, now=0)
    assert off.admit("said", 100, 800, now=0, osl=80) == Admitted("said", "d0", 900)
    with pytest.raises(ConfigError, match="osl_margin"):
        GateSettings(osl_margin=0.5)


def test_the_session_s_last_decode_is_preferred_when_it_fits_now():
    g = gate(budget_fraction=1.0)
    g.report("d0", 1000, 1000, True, now=0)
    g.report("d1", 1000, 1000, True, now=0)
    g.admit("busy", 500, 0, now=0, instance="d1")
    assert g.admit("back", 100, 0, now=1, prefer="d1") == Admitted("back", "d1", 100)  # d0 has less committed
    assert g.admit("new", 100, 0, now=1) == Admitted("new", "d0", 100)
    assert g.admit("big", 500, 0, now=1, prefer="d1") == Admitted("big", "d0", 500)     # d1 has no room: no wait
    assert g.admit("gone", 10, 0, now=1, prefer="d9") == Admitted("gone", "d0", 10)
    g.check_integrity()


def test_expiry_counts_the_tokens_due_before_it():
    g = gate(budget_fraction=1.0, admission_wait_s=5.0, retry_after_max_s=1000.0)
    g.report("d0", 1000, 1000, True, now=0)
    g.admit("a", 500, 0, now=0)
    g.admit("b", 500, 0, now=0)
    g.release("a", now=1)  # 500 tokens freed: a release rate to estimate from
    g.admit("c", 500, 0, now=1)
    assert isinstance(g.admit("low", 300, 0, now=1.5), Wait)
    assert isinstance(g.admit("high", 600, 0, now=1.5, priority=1), Wait)
    rejected = {r.request_id: r for r in g.expire(now=7).rejected}
    assert set(rejected) == {"low", "high"}
    assert rejected["low"].retry_after_s > rejected["high"].retry_after_s  # high is due first: less ahead


def test_wait_then_expire_with_retry_after():
    g = gate(budget_fraction=1.0, admission_wait_s=2.0, retry_after_s=3.0)
    g.report("d0", 1000, 1000, True, now=0)
    g.admit("a", 1000, 0, now=0)
    g.admit("w1", 10, 0, now=0.5)
    g.admit("w2", 10, 0, now=1.5)
    assert g.expire(now=2.0).rejected == []
    g.report("d0", 1000, 0, True, now=2.0)
    exp = g.expire(now=2.6)
    assert [r.request_id for r in exp.rejected] == ["w1"]
    r = exp.rejected[0]
    assert r.retry_after_s == 30.0  # nothing was released: the queue is not moving, so the most
    assert r.waited_s == pytest.approx(2.1) and "budget" in r.reason
    assert [r.request_id for r in g.expire(now=3.5).rejected] == ["w2"]
    assert g.counters["rejected"] == 2 and not g.queue


def test_no_decode_known_waits_then_rejects_no_instance():
    g = gate(admission_wait_s=1.0, instance_timeout_s=5.0)
    assert isinstance(g.admit("a", 10, 10, now=0), Wait)
    assert g.expire(now=0.5).rejected == []
    # Retry-After: the time a (re)started decode takes to be seen (instance_timeout_s)
    assert g.expire(now=1.0).rejected == [Rejected("a", NO_INSTANCE, 1.0, 5.0, unavailable=True)]


def test_decode_appearing_admits_waiting_requests():
    g = gate()
    g.admit("a", 10, 10, now=0)
    g.report("d0", 1000, 1000, True, now=0.1)
    assert g.drain(now=0.1) == [Admitted("a", "d0", 20, pytest.approx(0.1))]


def test_reality_clamp_from_free_tokens():
    g = gate(budget_fraction=1.0)
    g.report("d0", 1000, 1000, True, now=0)
    g.admit("a", 100, 0, now=0)
    g.report("d0", 1000, 200, True, now=1)  # decode holds 800 (say a gate restart lost reservations)
    assert g.stats(1)["committed_tokens"] == {"d0": 800}
    assert isinstance(g.admit("b", 300, 0, now=1), Wait)
    g.report("d0", 1000, 900, True, now=2)  # decode freed it: our own 100 count again
    assert g.stats(2)["committed_tokens"] == {"d0": 100}
    assert g.drain(now=2) == [Admitted("b", "d0", 300, 1)]


def test_stale_and_not_ready_instances_are_not_chosen():
    g = gate(budget_fraction=1.0, instance_timeout_s=5.0, admission_wait_s=100)
    g.report("d0", 1000, 1000, True, now=0)
    g.report("d1", 1000, 1000, True, now=0)
    g.admit("a", 100, 0, now=0)                      # d0 (tie)
    g.report("d1", 1000, 1000, False, now=1)         # d1 says goodbye
    assert g.admit("b", 100, 0, now=1).instance == "d0"
    g.report("d1", 1000, 1000, True, now=2)
    assert g.admit("c", 100, 0, now=2).instance == "d1"
    assert g.admit("d", 100, 0, now=6.5).instance == "d1"  # d0 last seen at 0: older than 5 s
    e = g.admit("e", 10, 0, now=8)                         # both stale now (d1 last seen at 2): no waiting
    assert isinstance(e, Rejected) and e.unavailable and e.reason == NO_INSTANCE and e.waited_s == 0


def test_known_decodes_all_gone_or_too_small_rejects_at_once():
    g = gate(budget_fraction=1.0, instance_timeout_s=5.0, admission_wait_s=30)
    g.report("big", 10_000, 10_000, True, now=0)
    g.report("small", 1_000, 1_000, True, now=0)
    g.report("big", 10_000, 10_000, False, now=1)          # the big one says goodbye
    r = g.admit("a", 4_000, 100, now=1)
    assert isinstance(r, Rejected) and r.unavailable and "largest live decode KV budget is 1000" in r.reason
    assert isinstance(g.admit("b", 20_000, 0, now=1), Invalid)  # beyond every budget known: never fits
    assert isinstance(g.admit("c", 500, 0, now=1), Admitted)
    assert not g.queue
    g.check_integrity()


def test_release_is_idempotent():
    g = gate()
    g.report("d0", 1000, 1000, True, now=0)
    g.admit("a", 10, 0, now=0)
    assert g.release("a") == "released"
    assert g.release("a") == "duplicate"
    assert g.release("nobody") == "unknown"
    assert g.stats(0)["reserved_tokens"] == {"d0": 0}
    assert (g.counters["released"], g.counters["release_duplicate"], g.counters["release_unknown"]) == (1, 1, 1)


def test_an_admit_that_arrives_after_its_release_reserves_nothing():
    """The bus delivers admits and releases on separate subscriptions, so a router that gave up (a bus
    outage, a timeout) can have its Release handled before its admit: that admit must not reserve, or the
    budget would be held until a Holdings or the TTL frees it (found by bench/faults.py under kill -9 of
    nats-server)."""
    g = gate()
    g.report("d0", 1000, 1000, True, now=0)
    assert g.release("late") == "unknown"
    r = g.admit("late", 100, 10, now=1)
    assert isinstance(r, Rejected) and not r.unavailable and "already released" in r.reason
    g.admit("a", 10, 0, now=1)
    assert g.release("a") == "released"
    assert isinstance(g.admit("a", 10, 0, now=2), Rejected)  # a duplicate admit after the release: the same
    assert not g.reservations and g.stats(2)["reserved_tokens"] == {"d0": 0}
    assert g.counters["admit_after_release"] == 2 and g.counters["admitted"] == 1
    g.check_integrity()


def test_release_of_a_waiting_request_cancels_it():
    g = gate(budget_fraction=1.0)
    g.report("d0", 1000, 1000, True, now=0)
    g.admit("a", 1000, 0, now=0)
    g.admit("w", 10, 0, now=0)
    assert g.release("w") == "cancelled"
    assert not g.queue and g.counters["cancelled"] == 1
    assert g.release("w") == "unknown"


def test_repeated_admit_reserves_once():
    g = gate(budget_fraction=1.0)
    g.report("d0", 1000, 1000, True, now=0)
    assert g.admit("a", 600, 0, now=0) == g.admit("a", 600, 0, now=1) == Admitted("a", "d0", 600)
    assert isinstance(g.admit("w", 600, 0, now=0), Wait)
    assert isinstance(g.admit("w", 600, 0, now=0), Wait)
    assert len(g.queue) == 1 and g.stats(1)["reserved_tokens"] == {"d0": 600} and g.counters["admitted"] == 1


def test_reservation_ttl():
    g = gate(reservation_ttl_s=10.0)
    g.report("d0", 1000, 1000, True, now=0)
    g.admit("a", 10, 0, now=0)
    g.admit("b", 10, 0, now=5)
    assert g.expire(now=9).reservations == []
    exp = g.expire(now=10)
    assert [r.request_id for r in exp.reservations] == ["a"]
    assert g.stats(10)["reserved_tokens"] == {"d0": 10} and g.counters["expired"] == 1
    assert g.release("a") == "duplicate"  # the router came back after all: nothing happens
    assert g.release("b") == "released"


def test_silent_empty_instances_are_forgotten():
    g = gate(reservation_ttl_s=10.0)
    g.report("d0", 1000, 1000, True, now=0)
    g.expire(now=9)
    assert "d0" in g.instances
    g.expire(now=10)
    assert g.instances == {}


def test_integrity_check_catches_bad_books():
    g = gate()
    g.report("d0", 1000, 1000, True, now=0)
    g.admit("a", 10, 0, now=0)
    g.instances["d0"].reserved += 1
    with pytest.raises(IntegrityError):
        g.check_integrity()


def test_settings_are_validated():
    with pytest.raises(ConfigError):
        GateSettings(budget_fraction=1.5)
    from services.gate.config import GateConfig
    with pytest.raises(ConfigError, match="admission_wait_s"):
        load_config(GateConfig, overrides=["gate.admission_wait_s=-1"], env={})
    assert load_config(GateConfig, overrides=["gate.max_input_tokens=8192"], env={}).gate.max_input_tokens == 8192


def test_seeded_random_stress():
    rng = random.Random(1234)
    g = gate(budget_fraction=0.9, admission_wait_s=3.0, reservation_ttl_s=50.0, instance_timeout_s=4.0)
    names = ["d0", "d1", "d2"]
    answered: dict[str, str] = {}
    now = 0.0

    def admitted(a: Admitted) -> None:
        assert a.request_id not in answered
        answered[a.request_id] = "admitted"
        inst = g.instances[a.instance]
        assert g.live(inst, now) and inst.reserved <= inst.budget  # never promised beyond the budget

    for step in range(5000):
        now += rng.random() * 0.2
        op = rng.random()
        if op < 0.4:
            rid = f"r{step}"
            out = g.admit(rid, rng.randint(1, 3000), rng.randint(0, 1000), now,
                          rng.choice(names + [None, None, None]), priority=rng.choice([0, 0, 0, -2, 3]),
                          latency_s=rng.choice([0.0, 0.0, 1.0]), osl=rng.choice([0, 0, 1, 200]))
            if isinstance(out, Admitted):
                admitted(out)
            elif isinstance(out, Invalid):
                answered[rid] = "invalid"
        elif op < 0.7 and (g.reservations or g.queue):
            rid = rng.choice(list(g.reservations) + list(g.queue))
            assert g.release(rid) in ("released", "cancelled")
            if rng.random() < 0.2:
                assert g.release(rid) in ("duplicate", "unknown")
        elif op < 0.85:
            name = rng.choice(names)
            cap = rng.choice([3000, 4000, 8000])
            g.report(name, cap, rng.randint(0, cap), rng.random() > 0.1, now)
        else:
            for a in g.drain(now):
                admitted(a)
            for r in g.expire(now).rejected:
                assert r.request_id not in answered and r.waited_s >= 3.0
                answered[r.request_id] = "rejected"
    c = g.counters
    assert c["admitted"] > 100 and c["rejected"] > 0 and c["invalid"] > 0 and c["released"] > 100
    assert c["admitted"] == c["released"] + c["expired"] + len(g.reservations)
    assert sum(v == "admitted" for v in answered.values()) == c["admitted"]


# ---- Retry-After from the queue -------------------------------------------------------------------
def test_retry_after_is_the_tokens_to_free_over_the_release_rate():
    g = gate(budget_fraction=1.0, admission_wait_s=5.0, retry_after_s=1.0, retry_after_max_s=30.0,
             release_window_s=60.0)
    g.report("d0", 1000, 1000, True, now=0)
    for i in range(4):  # 4 x 250 fill the budget
        assert isinstance(g.admit(f"r{i}", 200, 50, now=0), Admitted)
    for i in range(2):  # over 20 s, 500 tokens were given back: 25 tokens/s
        now = 10.0 * (i + 1)
        g.report("d0", 1000, 1000, True, now=now)
        g.release(f"r{i}", now=now)
        assert isinstance(g.admit(f"n{i}", 200, 50, now=now), Admitted)
    assert g.release_rate(20.0) == pytest.approx(25.0)
    # a request of 250 behind nobody, with nothing free: 250 tokens to free at 25/s
    assert g.retry_after(250, now=20.0) == pytest.approx(10.0)
    assert isinstance(g.admit("w", 200, 50, now=20.0), Wait)
    assert g.retry_after(250, now=20.0) == pytest.approx(20.0)  # behind the waiting 250: 500 to free
    g.report("d0", 1000, 1000, True, now=25.0)
    [r] = g.expire(now=25.0).rejected  # w waited 5 s: its estimate counts itself only (nothing ahead)
    assert r.request_id == "w" and r.retry_after_s == pytest.approx(250 / (500 / 25.0))


def test_retry_after_is_bounded_and_the_floor_when_it_fits():
    g = gate(budget_fraction=1.0, retry_after_s=2.0, retry_after_max_s=30.0, release_window_s=10.0)
    g.report("d0", 1000, 1000, True, now=0)
    assert g.retry_after(100, now=0) == 2.0             # fits now: the floor
    g.admit("big", 990, 0, now=0)
    assert g.retry_after(100, now=1) == 30.0            # nothing released yet: the queue is not moving
    g.admit("small", 5, 0, now=1)
    g.release("small", now=1)                           # 5 tokens in the first 1 s: 5 tokens/s
    assert g.retry_after(100, now=1) == pytest.approx(90 / 5)  # 100 wanted, 10 free
    g.release("big", now=1)
    g.admit("big2", 999, 0, now=1)
    assert g.retry_after(1000, now=1) == 2.0            # 999 to free at 995 tokens/s: ~1 s, below the floor
    g.report("d0", 1000, 1000, True, now=20.0)
    assert g.retry_after(100, now=20.0) == 30.0         # both releases left the 10 s window


def test_retry_after_without_a_live_decode_is_the_instance_timeout():
    g = gate(retry_after_s=1.0, retry_after_max_s=30.0, instance_timeout_s=5.0)
    g.report("d0", 1000, 1000, True, now=0)
    g.report("d0", 1000, 1000, False, now=1)            # its goodbye
    r = g.admit("a", 10, 10, now=2)
    assert isinstance(r, Rejected) and r.unavailable and r.retry_after_s == 5.0


def test_retry_after_settings_are_checked():
    with pytest.raises(ConfigError, match="retry_after_max_s"):
        GateSettings(retry_after_s=5.0, retry_after_max_s=2.0)
    with pytest.raises(ConfigError, match="release_window_s"):
        GateSettings(release_window_s=0)
