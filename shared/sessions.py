"""Which KV a session alone uses, so that closing it frees that and nothing another session still needs.

Prefill records, per (tenant, session), the block hashes (device prefix cache) and the chunk digests (pool
objects) of the session's latest prompt; each later prompt of the session replaces them. Decode records the
block hashes of the prompts whose blocks it keeps (decode reuse), without chunks. Every hash counts
the sessions that hold it. Closing a session returns its hashes no other recorded session holds: a system
prompt and tools shared with its parent or its sibling subagents stay. Sessions this prefill never saw
(served elsewhere) are not counted, so a shared prefix may still be freed here: the cost is a recompute or
a restore for them, never a wrong token (a dropped block or object is a miss).

Bounded: past `max_sessions` the least recently recorded session is forgotten (its KV is left to LRU).
Pure bookkeeping, no clock, no I/O.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

Key = tuple[str, str]  # (tenant, session id)


@dataclass(frozen=True)
class SessionKV:
    blocks: tuple[bytes, ...] = ()   # device prefix cache block hashes
    chunks: tuple[bytes, ...] = ()   # pool chunk digests


@dataclass(frozen=True)
class Closed:
    known: bool                       # the session was recorded here
    blocks: list[bytes] = field(default_factory=list)  # only it held these
    chunks: list[bytes] = field(default_factory=list)


class SessionIndex:
    def __init__(self, max_sessions: int = 1024):
        if max_sessions < 1:
            raise ValueError("max_sessions must be positive")
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[Key, SessionKV] = OrderedDict()
        self._blocks: Counter[bytes] = Counter()
        self._chunks: Counter[bytes] = Counter()

    def record(self, key: Key, kv: SessionKV) -> None:
        self._forget(key)
        self.sessions[key] = kv
        self._blocks.update(set(kv.blocks))
        self._chunks.update(set(kv.chunks))
        while len(self.sessions) > self.max_sessions:
            self._forget(next(iter(self.sessions)))

    def alone(self, key: Key) -> list[bytes] | None:
        """The block hashes only this session holds, prefix first (None: not recorded here); it stays recorded."""
        kv = self.sessions.get(key)
        if kv is None:
            return None
        return [h for h in dict.fromkeys(kv.blocks) if self._blocks[h] == 1]

    def close(self, key: Key) -> Closed:
        kv = self._forget(key)
        if kv is None:
            return Closed(False)
        return Closed(True, [h for h in dict.fromkeys(kv.blocks) if not self._blocks[h]],
                      [d for d in dict.fromkeys(kv.chunks) if not self._chunks[d]])

    def _forget(self, key: Key) -> SessionKV | None:
        kv = self.sessions.pop(key, None)
        if kv is not None:
            for counts, hashes in ((self._blocks, kv.blocks), (self._chunks, kv.chunks)):
                for h in set(hashes):
                    counts[h] -= 1
                    if not counts[h]:
                        del counts[h]
        return kv

    def check_integrity(self) -> None:
        want_b, want_c = Counter(), Counter()
        for kv in self.sessions.values():
            want_b.update(set(kv.blocks))
            want_c.update(set(kv.chunks))
        assert +self._blocks == want_b and +self._chunks == want_c, "hash counts out of step with the sessions"
        assert len(self.sessions) <= self.max_sessions
