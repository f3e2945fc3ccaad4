"""The router's tool-pause tracker (services/router/pauses.py): pauses measured from a tool call's answer to the
session's next request, and the soft-pin TTL they size, with the pool's turnover and the session's recompute
cost under pressure. Clock injected."""

import dataclasses

import numpy as np
import pytest

from services.router.pauses import MIN_SAMPLES, PAUSE_MARGIN, PauseTracker, pin_for


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_pause_runs_from_a_tool_call_to_the_next_request():
    clock = Clock()
    p = PauseTracker(60, 1800, clock=clock)
    key = ("", "s")
    assert p.returned(key) is None  # a first request ends no pause
    p.ended(key, expected_back=True)
    clock.t = 42.0
    assert p.returned(key) == 42.0
    assert p.returned(key) is None  # counted once
    p.ended(key, expected_back=False)  # the task's end: no pause starts
    clock.t = 100.0
    assert p.returned(key) is None
    assert p.stats()["pauses_seen"] == 1


def test_the_pin_outlasts_most_pauses_within_its_bounds():
    clock = Clock()
    p = PauseTracker(60, 1800, clock=clock)
    assert p.pin_s() == 1800 and p.expected_s() == 0.0  # nothing seen yet: the longest pin, no prefetch
    for i in range(MIN_SAMPLES * 4):
        key = ("", f"s{i}")
        p.ended(key, True)
        clock.t += 100.0 if i % 8 else 200.0  # mostly 100 s tools, a few of 200 s
        p.returned(key)
    assert 100 * PAUSE_MARGIN < p.pin_s() <= 200 * PAUSE_MARGIN
    assert p.expected_s() == 100.0  # the median: when a paused session is most likely back
    short = PauseTracker(60, 1800, clock=clock)
    for i in range(MIN_SAMPLES):
        short.ended(("", str(i)), True)
        clock.t += 1.0
        short.returned(("", str(i)))
    assert short.pin_s() == 60  # never under min_s
    with pytest.raises(ValueError):
        PauseTracker(10, 5)


def test_paused_sessions_are_bounded():
    p = PauseTracker(1, 2, max_sessions=3, clock=Clock())
    for i in range(10):
        p.ended(("", str(i)), True)
    assert p.stats()["paused_sessions"] == 3
    assert p.returned(("", "0")) is None and p.returned(("", "9")) == 0.0


# ---- under pressure: the pin weighs the returns it catches past the pool's turnover against the space --------

def _pauses(rng: np.random.Generator, n: int = 512) -> np.ndarray:
    """The tiers bench's mix: 55% 2-30 s, 30% 30 s-5 min, 15% 5-10 min."""
    u = rng.random(n)
    short = rng.uniform(2, 30, n)
    return np.where(u < .55, short, np.where(u < .85, rng.uniform(30, 300, n), rng.uniform(300, 600, n)))


def test_no_pressure_pins_for_the_pauses_alone():
    p = _pauses(np.random.default_rng(0))
    assert pin_for(p, None, 1.0, 60, 1800) == pytest.approx(PAUSE_MARGIN * np.percentile(p, 95))
    assert pin_for(p, None, 9.0, 60, 1800) == pin_for(p, None, 0.1, 60, 1800)  # space is free: weight is moot


def test_a_pool_that_keeps_every_pause_needs_no_pin_past_it():
    p = _pauses(np.random.default_rng(1))
    assert pin_for(p, 700.0, 4.0, 60, 1800) == 60  # LRU already outlasts every pause: the shortest pin


def test_rare_long_pauses_on_a_fast_pool_are_not_worth_their_space():
    # half return within 5 s, half after a 5-minute review; the pool keeps an unpinned chunk 10 s
    rng = np.random.default_rng(2)
    p = np.where(rng.random(512) < .5, rng.uniform(1, 5, 512), rng.uniform(280, 320, 512))
    # LRU space catches a return every ~13 byte-seconds; a review's pin, one every ~150: not worth it
    assert pin_for(p, 10.0, 1.0, 60, 1800) == 60
    # the pool keeps chunks 200 s: catching the other half costs ~100 s more of each: worth it
    pin = pin_for(p, 200.0, 1.0, 60, 1800)
    assert 320 * PAUSE_MARGIN * 0.95 <= pin <= 320 * PAUSE_MARGIN


def test_a_long_history_is_worth_a_longer_pin():
    p = _pauses(np.random.default_rng(3))
    short, long_ = pin_for(p, 120.0, 1.0, 60, 1800), pin_for(p, 120.0, 2.3, 60, 1800)
    assert 60 <= short < long_ <= 600 * PAUSE_MARGIN
    assert pin_for(p, 300.0, 0.5, 60, 1800) < pin_for(p, 300.0, 1.5, 60, 1800)  # a short one gives way


def test_the_tracker_weighs_a_session_by_its_history_against_the_others():
    clock = Clock()
    flat = PauseTracker(60, 1800, clock=clock)  # no knee (every layer windowed): every token costs the same
    knee = PauseTracker(60, 1800, knee_tokens=3072, clock=clock)
    assert knee.weight(8192) == 1.0  # no history seen yet
    for i in range(4):
        for t in (flat, knee):
            t.ended(("", f"s{i}"), True, tokens=2048)
    assert flat.weight(8192) == 1.0 and knee.weight(2048) == pytest.approx(1.0)
    assert knee.weight(8192) == pytest.approx((1 + 8192 / 6144) / (1 + 2048 / 6144))
    assert knee.weight(512) < 1.0
    rng = np.random.default_rng(4)
    for i, pause in enumerate(_pauses(rng, 64)):
        knee.ended(("", f"p{i}"), True, tokens=2048)
        clock.t += pause
        knee.returned(("", f"p{i}"))
    assert knee.pin_s(120.0, 8192) > knee.pin_s(120.0, 2048)
    assert knee.stats()["pin_s"] == round(knee.last_pin_s, 1)


def test_smollm2s_recompute_knee():
    from shared.engine.models import load_model_meta

    _, config = load_model_meta("smollm2-135m")
    # 30 layers of d 576, q 576, kv 192, MLP 1536: 576 * (2*576 + 2*192 + 3*1536) / (2*576) multiply-adds
    assert config.recompute_knee_tokens == 3072.0
    windowed = dataclasses.replace(config, sliding_window=512, sliding_window_pattern=0)
    assert windowed.recompute_knee_tokens == float("inf")


def test_the_router_sends_the_pin_its_pool_turnover_and_the_sessions_history_make():
    """RouterState.session_turn: the SessionTurn carries pin_s(turnover from the store events, the history)."""
    import asyncio
    from types import SimpleNamespace

    from services.router.config import RouterSettings
    from services.router.dispatch import RouterState
    from services.router.pool_turnover import MIN_EVICTIONS
    from services.router.routing import LoadTable, make_picker
    from shared.engine.models import load_model_meta

    sent = []

    async def publish(subject, msg):
        sent.append(msg)

    tokenizer, model = load_model_meta("tiny")
    clock, loads = Clock(), LoadTable(5.0)
    bus = SimpleNamespace(max_message_bytes=1 << 20, publish=publish,
                          subjects=SimpleNamespace(session_turn="moorage.session.turn"))
    state = RouterState(RouterSettings(model="tiny"), bus, tokenizer, model.max_context, loads,
                        make_picker("p2c", loads, 600.0), clock=clock,
                        recompute_knee_tokens=model.recompute_knee_tokens)
    for i, pause in enumerate(_pauses(np.random.default_rng(5), 64)):  # pauses seen, histories of ~2K tokens
        state.pauses.ended(("", f"p{i}"), True, 2048)
        clock.t += pause
        state.pauses.returned(("", f"p{i}"))

    async def turns() -> list[float]:
        await state.session_turn("a", "", True, 2048)
        await state.session_turn("b", "", True, 16384)
        await state.session_turn("c", "", False, 16384)
        return [m.pin_s for m in sent[-3:]]

    calm = asyncio.run(turns())
    seen = np.fromiter(state.pauses._pauses, float)
    assert calm[0] == calm[1] == pytest.approx(PAUSE_MARGIN * np.percentile(seen, 95))
    assert calm[2] == 0.0  # the task ended: no pin
    digests = [i.to_bytes(16, "big") for i in range(MIN_EVICTIONS)]
    state.turnover.apply([{"type": "stored", "medium": "store", "hashes": digests}])
    clock.t += 120.0  # the pool evicts what it was given 2 minutes ago
    state.turnover.apply([{"type": "removed", "medium": "store", "hashes": digests, "causes": ["evicted"]}])
    assert state.turnover.turnover_s() == 120.0
    pressed = asyncio.run(turns())
    assert pressed[0] == state.pauses.pin_s(120.0, 2048) and pressed[1] == state.pauses.pin_s(120.0, 16384)
    assert pressed[0] < calm[0] and pressed[0] < pressed[1]  # space costs: a short history gives way first
    assert pressed[2] == 0.0
