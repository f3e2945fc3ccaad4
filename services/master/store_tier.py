"""Which chunks the pool holds, and what changed: the pure half of the store-tier events (no I/O, no clock).

The pool's truth is mooncake_master's key list (`/get_all_keys` on its HTTP port: read-only, grants no
read lease, so asking never keeps an object from being evicted). moorage names one object per
(chunk, stage): `{namespace}/s{stage}of{stages}/{digest hex}`, and a chunk counts as held only while
every stage's object is there (a restore needs them all). Keys of any other shape are not ours: counted,
never reported.

A chunk can appear and vanish between two listings (a busy, small pool evicts within a second). The
prefills say "stored" (medium store) right after each save; those claims are remembered, and a claimed
chunk the next listing lacks is reported removed, so a router that applied the prefill's "stored" also
gets its "removed". A claim that arrives while a listing is in flight waits for the next listing (the
listing may predate the save).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.hashing import DIGEST_BYTES

KEY_RE = re.compile(r"^(?P<ns>.+)/s(?P<stage>\d+)of(?P<stages>\d+)/(?P<digest>[0-9a-f]{%d})$" % (2 * DIGEST_BYTES))


@dataclass
class Listing:
    chunks: set[bytes]   # digests of chunks whose every stage object is in the pool
    partial: int = 0     # chunks missing a stage (not held)
    foreign: int = 0     # keys that are not moorage chunk objects


def parse_keys(keys: Iterable[str]) -> Listing:
    stages_of: dict[tuple[str, bytes], set[int]] = {}
    want: dict[tuple[str, bytes], int] = {}
    foreign = 0
    for key in keys:
        m = KEY_RE.match(key)
        if m is None or not 0 <= int(m["stage"]) < int(m["stages"]):
            foreign += 1
            continue
        chunk = (m["ns"], bytes.fromhex(m["digest"]))
        stages_of.setdefault(chunk, set()).add(int(m["stage"]))
        want[chunk] = int(m["stages"])
    held = {c for c, s in stages_of.items() if len(s) == want[c]}
    return Listing({digest for _, digest in held}, len(stages_of) - len(held), foreign)


@dataclass
class Diff:
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


class StoreTier:
    """The master's view of the pool between listings. Memory: the chunks of the last listing plus the
    claims of one interval, i.e. bounded by the pool itself."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self._claims: set[bytes] = set()     # "stored" heard since the last listing began
        self._in_flight: set[bytes] = set()  # claims the listing in flight must answer
        self.counters = {"listings": 0, "stored": 0, "removed": 0, "cleared": 0, "partial": 0, "foreign": 0}

    def claim(self, digests: Iterable[bytes]) -> None:
        """A prefill says it saved these chunks."""
        self._claims.update(d for d in digests if isinstance(d, bytes) and len(d) == DIGEST_BYTES)

    def begin_listing(self) -> None:
        """Call right before asking for the key list: the claims heard so far are the ones it answers."""
        self._in_flight |= self._claims
        self._claims = set()

    def observe(self, listing: Listing) -> Diff:
        """The key list came back: what left the pool (held before, or claimed, and absent now) and
        what entered it."""
        diff = Diff(stored=sorted(listing.chunks - self.held),
                    removed=sorted((self.held | self._in_flight) - listing.chunks))
        self.held = set(listing.chunks)
        self._in_flight = set()
        c = self.counters
        c["listings"] += 1
        c["stored"] += len(diff.stored)
        c["removed"] += len(diff.removed)
        c["partial"], c["foreign"] = listing.partial, listing.foreign
        return diff

    def listing_failed(self) -> None:
        """No answer (master down or restarting): keep the claims for the next listing."""
        self._claims |= self._in_flight
        self._in_flight = set()

    def clear(self) -> None:
        """The pool lost every object (its master restarted): forget all, claims included."""
        self.held, self._claims, self._in_flight = set(), set(), set()
        self.counters["cleared"] += 1
