"""Prefetch on resume: a session that paused for a tool finds its history in this prefill's device cache when
it returns, brought back from the pool while it was away.

A session's tool call ends its turn (SessionTurn, expected back); the router says how long agents' pauses
have been taking (`expect_in_s`, the median it saw; 0 until it has seen enough) and how long the pool keeps the
session pinned (`pin_s`). Meanwhile other sessions' work may have evicted this session's blocks from the device
cache. Halfway through the expected pause (PREFETCH_AT) prefill looks again: the chunks of the session's last
prompt that the device lost and the pool holds are restored (read, CRC-verified, registered, as any restore)
into free blocks, waiting for none.

A session not back by then has paused longer than most; tool pauses have a long tail, so one that has been away
t seconds is expected back in about t more. So the look is repeated while the pin lasts: each time the session
is expected back at now + t, and looked at again halfway there (t grows by half each time: about twenty looks
over a 30-minute pin, most of them finding nothing to do). A session still away when its pin ends is left to
the pool, and so is one whose prefetch the device evicted again before the next look (`prefetch_lost`): the
device turns over faster than the looks, and another prefetch would go the same way, pushing out others' KV
(and, from disk, the pool's) for nothing.

A prefetch never evicts a session more likely to be back sooner: the cached blocks of every session paused here and
expected back no later than this one (and not overdue by more than its own expected pause: a session whose
return pattern lied stops being protected) are kept; plain free blocks go first, then the least recently
used of the rest (sessions that ended, traffic without a session, sessions expected back later). The blocks
then sit at the recent end of the prefix cache's LRU, where the session's next request finds them.

Counted: prefetches run, chunks prefetched, and at the session's next request whether the prefetched tokens
were still there (used) or had been evicted again (wasted); a session closed or forgotten with a prefetch
unused counts as wasted. The router's prefill affinity sends a session back to the prefill that served it,
the one that remembered its prompt.

Bounded: the last prompt of at most `max_sessions` sessions is remembered (a reference to the submitted list).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

from shared.logging import get_logger
from shared.sessions import SessionIndex

PREFETCH_AT = 0.5  # of the expected pause: late enough that the device has had its churn, early enough to land

log = get_logger("prefill.prefetch")
Key = tuple[str, str]  # (tenant, session)


class Prefetcher:
    def __init__(self, conn, spawn: Callable, sessions: SessionIndex, max_sessions: int = 256,
                 clock: Callable[[], float] = time.monotonic):
        self.conn, self.spawn, self.sessions, self.max_sessions, self.clock = conn, spawn, sessions, max_sessions, clock
        self.engine, self.loop, self.bm = conn.engine, conn.loop, conn.bm
        self._prompts: OrderedDict[Key, list[int]] = OrderedDict()
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self._paused: dict[Key, tuple[float, float]] = {}  # session -> (paused at, expected back at)
        self._until: dict[Key, float] = {}  # session -> when its pin ends: no look after that
        self._done: dict[Key, int] = {}  # prompt tokens the device holds thanks to a prefetch, not yet used
        self.counters = {"prefetches": 0, "prefetched_chunks": 0, "prefetch_used": 0, "prefetch_wasted": 0,
                         "prefetch_nothing_to_do": 0, "prefetch_lost": 0}

    def submitted(self, key: Key, prompt: list[int]) -> None:
        """The session's request arrived here: its prefetch (if any) is judged, its prompt remembered."""
        self._cancel(key)
        self._paused.pop(key, None)
        self._until.pop(key, None)
        done = self._done.pop(key, None)
        if done is not None:
            self.spawn(self._judge(key, prompt, done))
        self._prompts.pop(key, None)
        self._prompts[key] = prompt
        while len(self._prompts) > self.max_sessions:
            self.forget(next(iter(self._prompts)))

    def expect(self, key: Key, in_s: float, pin_s: float = 0.0) -> None:
        """The session paused for a tool; agents' pauses take `in_s` (0: unknown, no prefetch); the pool keeps
        its KV pinned `pin_s` (0: look once)."""
        if in_s <= 0 or key not in self._prompts:
            return
        self._cancel(key)
        now = self.clock()
        self._paused[key] = (now, now + in_s)
        self._until[key] = now + pin_s
        self._arm(key, in_s * PREFETCH_AT)

    def _arm(self, key: Key, delay_s: float) -> None:
        self._timers[key] = asyncio.get_running_loop().call_later(delay_s, lambda: self.spawn(self._run(key)))

    def _again(self, key: Key) -> None:
        """A look is done and the session is still away t seconds: expected back in t more, looked at again
        halfway there, if that is within its pin."""
        if key not in self._paused or key in self._timers:
            return
        now = self.clock()
        away = now - self._paused[key][0]
        if away <= 0 or now + away * PREFETCH_AT > self._until[key]:
            return
        self._paused[key] = (self._paused[key][0], now + away)
        self._arm(key, away * PREFETCH_AT)

    def forget(self, key: Key) -> None:
        """Closed or pushed out: nothing more is done for it."""
        self._cancel(key)
        self._prompts.pop(key, None)
        self._paused.pop(key, None)
        self._until.pop(key, None)
        if self._done.pop(key, None) is not None:
            self.counters["prefetch_wasted"] += 1

    async def close(self) -> None:
        """On stop: no prefetch starts any more."""
        for key in list(self._timers):
            self._cancel(key)

    def _cancel(self, key: Key) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def protected(self, key: Key) -> set[bytes]:
        """The device blocks a prefetch for `key` must not evict: those of the sessions paused here that are
        expected back no later than it, unless overdue by more than their own expected pause."""
        now, back_at = self.clock(), self._paused[key][1]
        keep: set[bytes] = set()
        for other, (paused_at, at) in self._paused.items():
            kv = self.sessions.sessions.get(other)
            if kv is not None and at <= back_at and now <= at + (at - paused_at):
                keep.update(kv.blocks)
        return keep

    async def _run(self, key: Key) -> None:
        self._timers.pop(key, None)
        prompt = self._prompts.get(key)
        if prompt is None or key not in self._paused:
            return
        try:
            await self._look(key, prompt)
        finally:
            self._again(key)

    async def _look(self, key: Key, prompt: list[int]) -> None:
        tenant, session = key
        done = self._done.get(key)
        if done is not None and await self._held(key, prompt) < done:
            # this pause's prefetch was evicted again before the session came back: the device turns over
            # faster than these looks, so another would go the same way; the session is left to the pool
            self._until[key] = 0.0
            self.counters["prefetch_lost"] += 1
            return
        try:
            restored = await self.conn.restore(f"prefetch:{session}", prompt, None, tenant, self.protected(key))
            await self.loop.call_now(lambda: self.bm.release(reversed(restored.pinned)))
        except Exception as e:  # best effort: the request restores for itself when it comes
            log.warning("prefetch failed", session_id=session, error=str(e))
            return
        chunks = restored.stats.get("chunks", 0)
        if not chunks:
            self.counters["prefetch_nothing_to_do"] += 1
            return
        self.counters["prefetches"] += 1
        self.counters["prefetched_chunks"] += chunks
        if key in self._paused:  # not back (nor closed) meanwhile: its next request judges this prefetch
            self._done[key] = max(self._done.get(key, 0), restored.token_range[1])
        log.info("prefetched", session_id=session, chunks=chunks, tokens=restored.token_range)

    async def _held(self, key: Key, prompt: list[int]) -> int:
        """Leading tokens of `prompt` the device holds for the session's tenant."""
        seed = self.engine.kv_namespace(key[0]).seed
        return await self.loop.call_now(
            lambda: self.bm.match_prefix(prompt, max_tokens=len(prompt) - 1, seed=seed).num_tokens)

    async def _judge(self, key: Key, prompt: list[int], tokens: int) -> None:
        have = await self._held(key, prompt)
        self.counters["prefetch_used" if have >= tokens else "prefetch_wasted"] += 1

    def check_integrity(self) -> None:
        assert len(self._prompts) <= self.max_sessions
        assert set(self._timers) <= set(self._paused) <= set(self._prompts), "a prefetch for a session it forgot"
        assert set(self._until) == set(self._paused), "a paused session without its pin's end"
        assert set(self._done) <= set(self._prompts), "a prefetch is judged for a session it forgot"
