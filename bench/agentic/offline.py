"""What a cache of a given size could keep of a replay, computed offline from its block accesses (issue 52).

A request reads the blocks of its prompt in order; it reuses the longest prefix of them that the cache holds
(a block past a missing one is recomputed all the same: KV is causal), then every block of its prompt is in the
cache, touched or computed. With `capacity` blocks, what does not fit is evicted:
- `lru`: the least recently used block first (what every tier of moorage does by default, and Mooncake);
- `optimum`: Belady's rule, the block whose next use lies farthest in the future (never used again first),
  which needs the future: the offline bound a policy that knows when each session returns could approach.
Belady's rule is the optimum for independent blocks; here a hit also needs every earlier block, so it is the
classic offline bound rather than a proof of the best prefix policy (it never evicts a block needed sooner in
favour of one needed later, which is what a return-aware policy is meant to do).

Both replay the requests in a given order: the trace's own time order, or the order the run served them
(queueing reorders), so a run's measured reuse can be told apart from what reordering alone costs. Blocks are
(namespace, position-chained id) pairs: the same hash id under two prefixes is two blocks.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence


def chained(requests: Iterable[tuple[str, Sequence[int]]]) -> list[list[tuple]]:
    """Each request's blocks as cache keys: (namespace, the hash ids up to and including this block), so a
    block's identity carries its whole prefix, as moorage's chained block hashes do."""
    out = []
    for ns, ids in requests:
        keys, prefix = [], ()
        for h in ids:
            prefix = prefix + (h,)
            keys.append((ns, prefix))
        out.append(keys)
    return out


def _leading(blocks: list[tuple], cache) -> int:
    """How many of a request's leading blocks the cache holds (a prefix hit: none past the first missing one)."""
    n = 0
    while n < len(blocks) and blocks[n] in cache:
        n += 1
    return n


def lru(requests: list[list[tuple]], capacity: int, counted: Sequence[bool] | None = None) -> tuple[int, int]:
    """(blocks reused, blocks read) replaying `requests` (lists of block keys) through an LRU of `capacity`; only
    the requests `counted` marks count (the others still fill the cache: a session's cold first turn)."""
    cache: OrderedDict = OrderedDict()
    hit = total = 0
    for i, blocks in enumerate(requests):
        if counted is None or counted[i]:
            hit, total = hit + _leading(blocks, cache), total + len(blocks)
        for b in blocks:
            cache[b] = True
            cache.move_to_end(b)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hit, total


def optimum(requests: list[list[tuple]], capacity: int, counted: Sequence[bool] | None = None) -> tuple[int, int]:
    """(blocks reused, blocks read) with Belady's rule: on overflow, evict the cached block whose next use is
    farthest ahead (once a request has read its blocks: one never used again goes at once), the deepest of
    equals first."""
    uses: dict = {}
    for i in range(len(requests) - 1, -1, -1):
        for b in requests[i]:
            uses.setdefault(b, []).append(i)  # reversed: the soonest next use is the list's last element
    cache: set = set()
    heap: list = []  # (-next use, -depth, block): farthest first, and of those the deepest (a leaf: its
    # ancestors stay usable without it, never the reverse); stale entries skipped
    hit = total = 0
    never = len(requests)
    for i, blocks in enumerate(requests):
        if counted is None or counted[i]:
            hit, total = hit + _leading(blocks, cache), total + len(blocks)
        for b in blocks:
            pending = uses[b]
            while pending and pending[-1] <= i:
                pending.pop()
            nxt = pending[-1] if pending else never
            cache.add(b)
            heapq.heappush(heap, (-nxt, -len(b[1]), b))
        while len(cache) > capacity:
            neg, _, b = heapq.heappop(heap)
            pending = uses[b]
            if b in cache and -neg == (pending[-1] if pending else never):  # else a stale entry: skipped
                cache.discard(b)
    return hit, total


def policies(requests: list[tuple[str, Sequence[int]]], capacities: dict[str, int],
             counted: Sequence[bool] | None = None) -> dict:
    """Offline LRU and optimum reuse shares at each named capacity (blocks), over `requests` in the order given (of
    the blocks of the `counted` ones), and the ceiling: what an unbounded cache reuses of them."""
    keys = chained(requests)
    ceiling, total = lru(keys, sum(map(len, keys)), counted)
    out = {"ceiling": ceiling / total if total else 0.0}
    for name, cap in capacities.items():
        lh, _ = lru(keys, cap, counted)
        oh, _ = optimum(keys, cap, counted)
        out[name] = {"capacity_blocks": cap, "lru": lh / total if total else 0.0,
                     "optimum": oh / total if total else 0.0}
    return out
