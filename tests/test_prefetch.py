"""Which device blocks a prefetch must leave alone (services/prefill/prefetch.Prefetcher.protected): those of
sessions paused on this prefill and expected back no later than the one prefetched, unless their return
pattern lied (overdue by more than their own expected pause). Pure bookkeeping; clock injected."""

from __future__ import annotations

import asyncio

from services.prefill.prefetch import Prefetcher
from shared.sessions import SessionIndex, SessionKV


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


class Conn:  # what Prefetcher reads off a PoolConnector before it restores anything
    engine = loop = bm = None


async def test_sessions_due_sooner_are_protected_until_they_are_overdue():
    clock, sessions = Clock(), SessionIndex()
    pf = Prefetcher(Conn(), lambda coro: coro.close(), sessions, clock=clock)
    for name, blocks in (("me", b"m"), ("soon", b"s"), ("late", b"l"), ("liar", b"x")):
        key = ("", name)
        sessions.record(key, SessionKV((blocks,), ()))
        pf.submitted(key, [1, 2, 3])
    pf.expect(("", "liar"), 10.0)  # due at 110
    clock.t = 150.0
    pf.expect(("", "me"), 20.0)    # due at 170
    pf.expect(("", "soon"), 5.0)   # due at 155
    pf.expect(("", "late"), 60.0)  # due at 210
    pf.check_integrity()
    # the liar was due at 110 and is 40 s late, more than its 10 s pause: no longer protected
    assert pf.protected(("", "me")) == {b"m", b"s"}
    assert pf.protected(("", "late")) == {b"m", b"s", b"l"}
    clock.t = 115.0  # (were it still within its pause's length of its due time, it would be)
    assert b"x" in pf.protected(("", "me"))
    pf.submitted(("", "soon"), [1, 2, 3, 4])  # back: no longer paused
    clock.t = 150.0
    assert pf.protected(("", "me")) == {b"m"}
    await pf.close()
    pf.forget(("", "me"))
    pf.check_integrity()
    assert not any(t for t in pf._timers.values() if not t.cancelled())
