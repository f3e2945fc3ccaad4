"""bench/handoff_floor.py: the handoff bench's second baseline (a write into another process plus one bus
round trip) runs against a real nats-server and a real child process, and cleans up after itself."""

from __future__ import annotations

from bench.handoff_floor import FloorTE
from shared.messages import HandoffDone


def _done(pieces: list[int]) -> HandoffDone:
    return HandoffDone("req-floor", list(range(64)), [], "", {"max_tokens": 2}, {"device": 64},
                       pages=[[0, 1, 0, n, 0] for n in pieces])


def test_floor_times_a_write_and_a_round_trip(nats_url):
    pieces = [64 << 10, 48 << 10]
    floor = FloorTE(pieces, nats_url, _done(pieces))
    try:
        times = [floor.write() for _ in range(3)]
    finally:
        floor.close()
    assert all(0 < write <= total for write, total in times)
    assert floor.child.returncode == 0  # it left when its stdin closed

