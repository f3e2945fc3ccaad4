"""The router's tool-pause tracker (services/router/pauses.py): pauses measured from a tool call's answer to the
session's next request, and the soft-pin TTL they size. Clock injected."""

import pytest

from services.router.pauses import MIN_SAMPLES, PAUSE_MARGIN, PauseTracker


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
