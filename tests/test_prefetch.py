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


async def test_a_session_still_away_is_looked_at_again_until_its_pin_ends():
    """Tool pauses have a long tail: a session away t seconds is expected back in t more, and looked at again
    halfway there (t x 1.5 each time), within its pin; its return stops the looks, and without a pin (0) it is
    looked at once. The looks run on the real clock here; `restore` is a stand-in that finds nothing to do."""
    import time
    from types import SimpleNamespace

    looks: list[float] = []

    class Nothing(Conn):
        async def restore(self, *args):
            looks.append(time.monotonic())
            return SimpleNamespace(pinned=[], stats={"chunks": 0}, token_range=(0, 0))

    class Loop:
        async def call_now(self, fn):
            return fn()

    conn = Nothing()
    conn.loop, conn.bm = Loop(), SimpleNamespace(release=lambda blocks: None)
    tasks: list[asyncio.Task] = []
    sessions = SessionIndex()
    pf = Prefetcher(conn, lambda coro: tasks.append(asyncio.ensure_future(coro)), sessions)
    pf.loop, pf.bm = conn.loop, conn.bm
    key, once = ("", "s"), ("", "once")
    for k in (key, once):
        sessions.record(k, SessionKV((b"b",), ()))
        pf.submitted(k, [1, 2, 3])
    pf.expect(key, 0.1, 1.0)  # first look at 0.05 s, then 0.075, 0.11, 0.17, 0.25, 0.38, 0.57, 0.85
    pf.expect(once, 0.1)
    first_guess = pf._paused[key][1]
    await asyncio.sleep(0.3)
    assert pf._paused[key][1] > first_guess  # away longer than the median: expected back later
    await asyncio.sleep(1.2)
    await asyncio.gather(*tasks)
    assert key in pf._paused and key not in pf._timers  # the pin ended, still away: left to the pool
    mine = len(looks) - 1  # the other session's one look
    assert 3 <= mine <= 9, looks  # (8 on an idle host; fewer when the loop runs late)
    gaps = [b - a for a, b in zip(looks[1:], looks[2:])]
    assert all(g > 0 for g in gaps) and gaps[-1] > 2 * gaps[0]  # ever sparser
    assert pf.counters["prefetch_nothing_to_do"] == len(looks)
    await asyncio.sleep(0.5)
    assert len(looks) == mine + 1  # none after the pin ended
    pf.check_integrity()
    pf.expect(key, 0.1, 10.0)
    await asyncio.sleep(0.2)
    pf.submitted(key, [1, 2, 3, 4])  # back: the looks stop
    n = len(looks)
    await asyncio.sleep(0.3)
    await asyncio.gather(*tasks)
    assert len(looks) == n and key not in pf._timers
    pf.check_integrity()
    await pf.close()


async def test_a_prefetch_evicted_before_the_next_look_ends_the_looks():
    """The device lost this pause's prefetch before the next look: it turns over faster than the looks, so the
    session is left to the pool (no second restore that would push out others' KV for nothing)."""
    from types import SimpleNamespace

    restores: list[str] = []
    held = {"tokens": 0}

    class Lossy(Conn):
        engine = SimpleNamespace(kv_namespace=lambda tenant: SimpleNamespace(seed=0))

        async def restore(self, *args):
            restores.append(args[0])
            return SimpleNamespace(pinned=[], stats={"chunks": 2}, token_range=(0, 64))

    class Loop:
        async def call_now(self, fn):
            return fn()

    conn = Lossy()
    conn.loop = Loop()
    conn.bm = SimpleNamespace(release=lambda blocks: None,
                              match_prefix=lambda prompt, max_tokens, seed: SimpleNamespace(num_tokens=held["tokens"]))
    tasks: list[asyncio.Task] = []
    sessions = SessionIndex()
    pf = Prefetcher(conn, lambda coro: tasks.append(asyncio.ensure_future(coro)), sessions)
    key = ("", "s")
    sessions.record(key, SessionKV((b"b",), ()))
    pf.submitted(key, list(range(80)))
    pf.expect(key, 0.1, 5.0)
    await asyncio.sleep(0.06)  # the first look restored 64 tokens; the device keeps them...
    held["tokens"] = 64
    await asyncio.sleep(0.05)  # ...through the second look (nothing to restore: here the stand-in restores again)
    assert pf.counters["prefetch_lost"] == 0 and key in pf._timers
    held["tokens"] = 0  # then evicts them
    await asyncio.sleep(0.3)
    await asyncio.gather(*tasks)
    assert pf.counters["prefetch_lost"] == 1 and key not in pf._timers
    n = len(restores)
    await asyncio.sleep(0.3)
    assert len(restores) == n  # no more looks
    pf.submitted(key, list(range(90)))  # back: judged wasted
    await asyncio.gather(*tasks)
    assert pf.counters["prefetch_wasted"] == 1 and pf.counters["prefetch_used"] == 0
    pf.check_integrity()
    await pf.close()
