"""The restore soak's pure half: sessions whose prompts land around chunk boundaries, how a turn's token
sources are classified, and the counts. No I/O (bench/soak.py drives a real system with these)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

OUTCOMES = ("fresh", "restored", "partial", "miss", "device")


@dataclass
class Session:
    """An agent's conversation: each turn re-sends the previous prompt plus new tokens."""
    sid: str
    prompt: list[int] = field(default_factory=list)  # the last prompt sent (its full chunks were saved)
    turns: int = 0
    bad_chunk: int | None = None     # a chunk of the history the pool must not serve (removed or corrupted)

    def next_prompt(self, rng: random.Random, chunk: int, max_tokens: int) -> list[int]:
        """The next turn's prompt: history + new tokens, ending at chunk*m + delta with delta in
        {-1, 0, 1, 2, random}: exactly at, just before and just after a chunk boundary. Past
        `max_tokens` the conversation starts over (a new task: nothing to restore)."""
        base = len(self.prompt)
        m = base // chunk + 1 + rng.choice((0, 0, 1))
        target = m * chunk + rng.choice((-1, 0, 1, 2, rng.randrange(3, chunk - 3)))
        if target <= base:
            target = base + rng.randrange(1, chunk)
        if target > max_tokens:
            self.prompt, self.bad_chunk = [], None
            target = rng.randrange(1, 3) * chunk + rng.choice((-1, 0, 1, rng.randrange(3, chunk - 3)))
        return self.prompt + [rng.randrange(256) for _ in range(target - len(self.prompt))]

    def reusable_tokens(self, prompt: list[int], chunk: int) -> int:
        """Tokens of `prompt` the pool can give back: the history's saved full chunks (the last prompt
        token is always computed), up to the bad chunk."""
        n = min(len(self.prompt) // chunk, (len(prompt) - 1) // chunk)
        if self.bad_chunk is not None:
            n = min(n, self.bad_chunk)
        return n * chunk

    def served_bad_chunk(self, device: int, store: int, chunk: int) -> bool:
        """The pool restored chunks [device // chunk, + store // chunk): did that take in the bad one?"""
        first = device // chunk
        return self.bad_chunk is not None and store > 0 and first <= self.bad_chunk < first + store // chunk


def classify(expected: int, device: int, store: int) -> str:
    """fresh: nothing reusable; device: the device cache had it all; restored: the pool gave the rest;
    partial: the pool gave some, less than it holds; miss: reusable tokens were recomputed."""
    if expected == 0:
        return "fresh"
    if store == 0:
        return "device" if device >= expected else "miss"
    return "restored" if device + store >= expected else "partial"


@dataclass
class Counts:
    cycles: int = 0
    restores: int = 0           # turns that read any chunk from the pool
    partial_restores: int = 0   # ... fewer than the pool was expected to hold (evicted or rejected chunks)
    misses: int = 0             # turns whose reusable history was recomputed in full
    device_hits: int = 0        # turns the device cache alone served
    fresh: int = 0              # turns with nothing to reuse (first turns)
    store_tokens: int = 0
    computed_tokens: int = 0
    mismatches: int = 0         # outputs different from the from-scratch computation (must be 0)
    errors: int = 0             # requests that failed (HTTP error)
    midway_evictions: int = 0   # sessions whose middle chunk was removed from the pool before a turn
    corruptions: int = 0        # histories whose first chunk was overwritten with garbage before a turn
    served_bad_chunk: int = 0   # turns that got a removed or corrupted chunk from the pool (must be 0)
    bad_chunk_back_from_disk: int = 0  # with a disk tier: turns whose removed or corrupted chunk a store's disk put back
    verify_failures: int = 0    # chunks the prefills rejected on checksum (from their pool counters)
    store_restarts: int = 0
    outcomes: dict = field(default_factory=lambda: {k: 0 for k in OUTCOMES})

    def add(self, outcome: str, usage: dict) -> None:
        self.cycles += 1
        self.outcomes[outcome] += 1
        m = usage["moorage"]
        self.store_tokens += m["store"]
        self.computed_tokens += m["computed"]
        self.restores += m["store"] > 0
        self.partial_restores += outcome == "partial"
        self.misses += outcome == "miss"
        self.device_hits += outcome == "device"
        self.fresh += outcome == "fresh"

    def to_dict(self) -> dict:
        return asdict(self)
