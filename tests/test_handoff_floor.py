"""bench/handoff_floor.py: the handoff bench's second baseline (a write into another process, the child's CRC
check of it and one bus round trip) runs against a real nats-server and a real child process, refuses bytes
that do not match, and cleans up after itself."""

from __future__ import annotations

import pytest

from bench.handoff_floor import FloorTE
from shared.engine.sampling import SamplingParams
from shared.messages import HandoffDone


def _done(pieces: list[int]) -> HandoffDone:
    return HandoffDone("req-floor", list(range(64)), [], "", SamplingParams(max_tokens=2), {"device": 64},
                       pages=[])


def test_floor_times_a_write_its_check_and_a_round_trip(nats_url):
    pieces = [64 << 10, 48 << 10]
    floor = FloorTE(pieces, nats_url, _done(pieces))
    try:
        times = [floor.write() for _ in range(3)]
        floor.src[5] ^= 1  # what lands no longer matches the CRCs the HandoffDone carries
        with pytest.raises(RuntimeError, match=r"refused the HandoffDone: pieces \[0\] differ"):
            floor.write()
    finally:
        floor.close()
    assert all(0 < write <= total and 0 < check < total - write for write, total, check in times)
    assert floor.child.returncode == 0  # it left when its stdin closed



def test_the_handoff_benchs_interval_draws_a_repeat_and_its_raw_writes_together():
    from bench.handoff import ratio_ci

    # every repeat: raw writes 10 ms, handoff 12.5 ms -> handoff/raw exactly 0.8, whatever is drawn
    assert ratio_ci([10.0, 10.0] * 6, [12.5] * 6, 6) == pytest.approx([0.8, 0.8])
    # load that varies between repeats but hits both alike leaves the ratio alone (drawn apart, it would not)
    raw = [t for load in (1, 2, 3, 1.5, 2.5, 1) for t in (10 * load, 10 * load)]
    handoff = [12.5 * load for load in (1, 2, 3, 1.5, 2.5, 1)]
    assert ratio_ci(raw, handoff, 6) == pytest.approx([0.8, 0.8])
    # a noisy handoff widens it around the point estimate
    lo, hi = ratio_ci([10.0] * 12, [9, 16, 11, 14, 12, 13], 6)
    assert lo < 10 / 12.5 < hi and hi - lo > 0.1
