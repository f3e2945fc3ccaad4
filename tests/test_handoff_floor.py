"""bench/handoff_floor.py: the handoff bench's second baseline (a write into another process, the child's CRC
check of it and one bus round trip) runs against a real nats-server and a real child process, refuses bytes
that do not match, and cleans up after itself."""

from __future__ import annotations

import pytest

from bench.handoff_floor import FloorTE
from shared.messages import HandoffDone


def _done(pieces: list[int]) -> HandoffDone:
    return HandoffDone("req-floor", list(range(64)), [], "", {"max_tokens": 2}, {"device": 64},
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

