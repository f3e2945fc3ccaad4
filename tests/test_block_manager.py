"""BlockManager: prefix matching, ref counting, LRU eviction, events. Integrity is checked after every call."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from shared.engine.block_manager import BlockManager, OutOfBlocks, PrefixMatch
from shared.hashing import BLOCK_TOKENS, chain_hashes, hash_unit, namespace_seed
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

B = BLOCK_TOKENS


class Checked:
    """Proxy that runs check_integrity() after every method call, raising or not."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm

    def __getattr__(self, name):
        attr = getattr(self.bm, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            finally:
                self.bm.check_integrity()

        return call


def make(num_blocks: int = 8, seed: bytes = b"ns", **kw) -> tuple[Checked, list]:
    events: list = []
    bm = Checked(BlockManager(num_blocks, hash_seed=seed, on_event=events.append, **kw))
    bm.check_integrity()
    return bm, events


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def prefill(bm: Checked, tokens: list[int]) -> list[int]:
    """A sequence: allocate blocks for all tokens, register its full blocks."""
    ids = bm.allocate(-(-len(tokens) // B))
    bm.register_full_blocks(ids, tokens, len(tokens) // B)
    return ids


def test_match_after_register_partial_tail_and_max_tokens():
    bm, _ = make()
    t = toks(2 * B + 8)
    ids = prefill(bm, t)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 8 - 3

    m = bm.match_prefix(t)
    assert m == PrefixMatch(ids[:2], bm.block_hashes(t), 2 * B)  # tail block not matched
    assert bm.match_prefix(t + [99] * 100).block_ids == ids[:2]
    assert bm.match_prefix(t, max_tokens=2 * B - 1).block_ids == ids[:1]  # rounded down to whole blocks
    assert bm.match_prefix(t, max_tokens=0).num_tokens == 0
    assert bm.match_prefix(t[: B + 3]).block_ids == ids[:1]
    assert bm.match_prefix([7] + t[1:]).num_tokens == 0  # first block differs: nothing
    assert [bm.ref_count(b) for b in ids] == [1, 1, 1]  # read-only


def test_block_hashes_are_shared_hashing_chain():
    bm, _ = make(seed=b"seed")
    t = toks(3 * B + 5)
    assert bm.block_hashes(t) == chain_hashes(t, B, b"seed")
    assert bm.block_hashes(t)[0] == hash_unit(b"seed", t[:B])


def test_two_extra_owners_free_only_when_last_lets_go():
    bm, _ = make(4)
    t = toks(2 * B)
    ids = prefill(bm, t)
    bm.acquire(ids)  # being saved to the store
    bm.acquire(ids)  # being sent to decode
    assert [bm.ref_count(b) for b in ids] == [3, 3]
    bm.release(reversed(ids))  # the sequence finishes
    bm.release(ids)  # save done
    assert bm.num_free_blocks == 2 and [bm.ref_count(b) for b in ids] == [1, 1]
    bm.release(ids)  # send done
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    # Still matchable, and acquiring brings a cached block back into use.
    m = bm.match_prefix(t)
    bm.acquire(m.block_ids)
    assert bm.num_free_blocks == 2 and [bm.ref_count(b) for b in ids] == [1, 1]


def test_lru_eviction_order_and_one_removed_event():
    bm, events = make(4)
    seqs = [prefill(bm, toks(B, 100 * k)) for k in range(4)]  # a, b, c, d: one block each
    hashes = [bm.block_hashes(toks(B, 100 * k))[0] for k in range(4)]
    events.clear()
    for k in (0, 2, 1, 3):  # released a, c, b, d
        bm.release(seqs[k])
    # Touch b: acquire + release moves it to the most-recent end: order a, c, d, b.
    bm.acquire(seqs[1])
    bm.release(seqs[1])
    assert bm.allocate(3) == [seqs[0][0], seqs[2][0], seqs[3][0]]
    assert events == [BlockRemoved([hashes[0], hashes[2], hashes[3]])]
    assert [bm.lookup(h) for h in hashes] == [None, seqs[1][0], None, None]
    assert bm.num_cached_blocks == 1


def test_plain_free_blocks_preferred_over_cached():
    bm, events = make(4)
    cached = prefill(bm, toks(2 * B))
    bm.release(cached)
    events.clear()
    fresh = bm.allocate(2)
    assert set(fresh).isdisjoint(cached) and events == [] and bm.num_cached_blocks == 2
    assert bm.allocate(1) == [cached[0]] and len(events) == 1 and bm.num_cached_blocks == 1


def test_allocate_never_evicts_a_kept_hash():
    """A prefetch's allocation (allocate(n, keep)): plain blocks first, then the least recently used cached
    blocks outside `keep`; asking for more than that raises and changes nothing."""
    bm, events = make(5)
    seqs = [prefill(bm, toks(B, 100 * k)) for k in range(4)]  # a, b, c, d: one block each
    hashes = [bm.block_hashes(toks(B, 100 * k))[0] for k in range(4)]
    for k in range(4):
        bm.release(seqs[k])
    keep = {hashes[0], hashes[2]}  # a and c: sessions expected back sooner
    assert bm.spare_blocks(keep) == 1 + 2 and bm.spare_blocks(set()) == 5
    events.clear()
    with pytest.raises(OutOfBlocks):
        bm.allocate(4, keep)
    assert events == [] and bm.num_cached_blocks == 4
    got = bm.allocate(2, keep)  # the plain block, then b (older than d)
    assert seqs[1][0] in got and events == [BlockRemoved([hashes[1]])]
    assert [bm.lookup(h) is not None for h in hashes] == [True, False, True, True]


def test_out_of_blocks_changes_nothing():
    bm, events = make(4)
    cached = prefill(bm, toks(2 * B))
    bm.release(cached)
    used = bm.allocate(1)
    events.clear()
    snapshot = (bm.num_free_blocks, bm.num_cached_blocks, [bm.ref_count(b) for b in range(4)],
                list(bm.bm._plain_free), list(bm.bm._cached_free))
    assert not bm.can_allocate(4) and bm.can_allocate(3)
    with pytest.raises(OutOfBlocks):
        bm.allocate(4)
    assert snapshot == (bm.num_free_blocks, bm.num_cached_blocks, [bm.ref_count(b) for b in range(4)],
                        list(bm.bm._plain_free), list(bm.bm._cached_free))
    assert events == [] and bm.match_prefix(toks(2 * B)).block_ids == cached and used


def test_collision_guard_hash_hit_with_other_tokens_is_a_miss(monkeypatch):
    bm, _ = make()

    def position_only(token_ids, start, stop, prev):  # every sequence collides block by block
        return [bytes([i]) * 16 for i in range(start, stop)]

    monkeypatch.setattr(bm.bm, "_hash_chain", position_only)
    x = toks(2 * B)
    ids = prefill(bm, x)
    assert bm.match_prefix(x).block_ids == ids
    assert bm.match_prefix(toks(2 * B, 500)).num_tokens == 0  # hit on block 0's hash, wrong tokens
    y = x[:B] + toks(B, 500)
    assert bm.match_prefix(y).block_ids == ids[:1]  # collision on block 1 stops the match there


def test_duplicate_prefix_registered_by_two_sequences():
    bm, events = make(8)
    t = toks(3 * B)
    h = bm.block_hashes(t)
    a = bm.allocate(2)
    b = bm.allocate(3)
    assert bm.register_full_blocks(a, t, 2) == h[:2]
    assert bm.register_full_blocks(b, t, 2) == h[:2]  # same prefix computed twice
    assert [bm.lookup(x) for x in h[:2]] == a  # the first stays canonical
    assert events == [BlockStored(h[:2], None, t[: 2 * B], B)]
    # The duplicate still chains: b's third block is indexed with parent h[1].
    assert bm.register_full_blocks(b, t, 3, start_block=2) == h[2:]
    assert bm.lookup(h[2]) == b[2] and events[-1] == BlockStored(h[2:], h[1], t[2 * B :], B)
    bm.release(reversed(b))  # duplicates turn plain, the indexed tail is cached
    assert bm.num_cached_blocks == 3 and list(bm.bm._cached_free) == [b[2]]
    bm.release(a)
    assert bm.match_prefix(t).block_ids == a + [b[2]]


def test_duplicate_gets_indexed_once_canonical_is_evicted():
    bm, events = make(3)
    t = toks(B)
    a = prefill(bm, t)
    b = prefill(bm, t)  # duplicate of a
    bm.release(a)
    bm.allocate(2)  # one plain block, then evicts a
    assert bm.lookup(bm.block_hashes(t)[0]) is None
    events.clear()
    bm.register_full_blocks(b, t, 1)  # re-registering the duplicate makes it canonical
    assert bm.lookup(bm.block_hashes(t)[0]) == b[0] and len(events) == 1


def test_register_validation_and_idempotence():
    bm, events = make()
    t = toks(3 * B)
    ids = bm.allocate(3)
    with pytest.raises(ValueError, match="parent"):
        bm.register_full_blocks(ids, t, 3, start_block=1)
    with pytest.raises(ValueError):
        bm.register_full_blocks(ids, t[: 2 * B], 3)  # not enough tokens
    free = bm.allocate(1)
    bm.release(free)
    with pytest.raises(ValueError, match="not in use"):
        bm.register_full_blocks(free, t, 1)
    hashes = bm.register_full_blocks(ids, t, 3)
    events.clear()
    assert bm.register_full_blocks(ids, t, 3) == hashes and events == []  # no-op
    with pytest.raises(ValueError, match="different prefix"):
        bm.register_full_blocks(ids, toks(3 * B, 1000), 3)
    assert [bm.lookup(h) for h in hashes] == ids


def test_double_release_and_bad_acquire_raise():
    bm, _ = make(4)
    [x] = bm.allocate(1)
    with pytest.raises(ValueError, match="double free"):
        bm.release([x, x])  # all-or-nothing: nothing was released
    assert bm.ref_count(x) == 1
    bm.release([x])
    with pytest.raises(ValueError, match="double free"):
        bm.release([x])
    with pytest.raises(ValueError):
        bm.acquire([x])  # plain free block: holds nothing
    with pytest.raises(ValueError):
        bm.acquire([4])
    with pytest.raises(ValueError):
        bm.ref_count(-1)


def test_event_sequence_chunked_prefill_eviction_reset():
    bm, events = make(4)
    t = toks(4 * B)
    h = bm.block_hashes(t)
    ids = bm.allocate(4)
    bm.register_full_blocks(ids, t, 2)
    bm.register_full_blocks(ids, t, 4, start_block=2)
    assert events == [BlockStored(h[:2], None, t[: 2 * B], B), BlockStored(h[2:], h[1], t[2 * B :], B)]
    assert bm.reset_prefix_cache() == -1 and len(events) == 2  # blocks in use: refused
    bm.release(reversed(ids))  # tail first, so it is evicted first
    x = bm.allocate(1)
    assert events[-1] == BlockRemoved([h[3]])
    y = bm.allocate(2)
    assert events[-1] == BlockRemoved([h[2], h[1]]) and len(events) == 4
    assert bm.match_prefix(t).block_ids == ids[:1]  # the chain's head survives
    bm.release(x + y)
    assert bm.reset_prefix_cache() == 1 and events[-1] == AllBlocksCleared()


def test_reset_prefix_cache():
    bm, events = make(4)
    ids = prefill(bm, toks(2 * B))
    bm.release(ids)
    events.clear()
    assert bm.reset_prefix_cache() == 2
    assert events == [AllBlocksCleared()] and bm.num_cached_blocks == 0 and bm.num_free_blocks == 4
    assert bm.match_prefix(toks(2 * B)).num_tokens == 0


def test_hash_seed_namespaces_do_not_share_hits():
    a, _ = make(seed=namespace_seed("model-a"))
    b, _ = make(seed=namespace_seed("model-b"))
    t = toks(2 * B)
    assert set(a.block_hashes(t)).isdisjoint(b.block_hashes(t))
    prefill(a, t)
    assert all(a.lookup(h) is None for h in b.block_hashes(t))
    assert a.match_prefix(t).num_tokens == 2 * B


def test_randomized_stress():
    rng = random.Random(20240611)
    bm, events = make(24)
    mirror: set[bytes] = set()  # a router's view, rebuilt from events alone
    bases = [[rng.randrange(40) for _ in range(5 * B)] for _ in range(3)]
    seqs: list[dict] = []  # {"blocks", "tokens", "registered"}
    pins: list[list[int]] = []  # extra owners (save / send in flight)

    def prompt(extra: int) -> list[int]:  # a shared base prefix, then a random suffix
        return rng.choice(bases)[: rng.randint(0, 5 * B)] + [rng.randrange(40) for _ in range(rng.randint(0, extra))]

    def check_match(query: list[int], max_tokens: int | None) -> PrefixMatch:
        m = bm.match_prefix(query, max_tokens)
        limit = len(query) if max_tokens is None else min(len(query), max_tokens)
        assert m.num_tokens == len(m.block_ids) * B <= limit
        assert m.block_hashes == bm.block_hashes(query)[: len(m.block_ids)]
        for i, (b, h) in enumerate(zip(m.block_ids, m.block_hashes)):
            assert bm.lookup(h) == b and bm.bm._tokens[b] == tuple(query[i * B : (i + 1) * B])
        full = bm.block_hashes(query[: limit // B * B])
        if len(m.block_ids) < len(full):  # maximal: the next block really is not cached
            assert bm.lookup(full[len(m.block_ids)]) is None
        return m

    for _ in range(500):
        op = rng.choices(["start", "prefill", "append", "finish", "pin", "unpin", "match", "reset"],
                         [5, 5, 3, 4, 2, 2, 3, 0.3])[0]
        if op == "start":
            tokens = prompt(40)
            if not tokens:
                continue
            m = check_match(tokens, rng.choice([None, rng.randint(0, len(tokens))]))
            bm.acquire(m.block_ids)
            try:
                new = bm.allocate(-(-len(tokens) // B) - len(m.block_ids))
            except OutOfBlocks:
                bm.release(m.block_ids)
                continue
            seqs.append({"blocks": m.block_ids + new, "tokens": tokens, "registered": len(m.block_ids)})
        elif op == "prefill" and seqs:
            s = rng.choice(seqs)
            full = len(s["tokens"]) // B
            if s["registered"] < full:
                k = rng.randint(s["registered"] + 1, full)
                got = bm.register_full_blocks(s["blocks"], s["tokens"], k, s["registered"])
                assert got == bm.block_hashes(s["tokens"])[s["registered"] : k]
                s["registered"] = k
        elif op == "append" and seqs:
            s = rng.choice(seqs)
            more = [rng.randrange(40) for _ in range(rng.randint(1, 20))]
            need = -(-(len(s["tokens"]) + len(more)) // B) - len(s["blocks"])
            try:
                s["blocks"] += bm.allocate(need)
                s["tokens"] += more
            except OutOfBlocks:
                pass
        elif op == "finish" and seqs:
            s = seqs.pop(rng.randrange(len(seqs)))
            bm.release(reversed(s["blocks"]))
        elif op == "pin" and seqs:
            s = rng.choice(seqs)
            pins.append(list(s["blocks"]))
            bm.acquire(pins[-1])
        elif op == "unpin" and pins:
            bm.release(pins.pop(rng.randrange(len(pins))))
        elif op == "match":
            q = prompt(20)
            check_match(q, rng.choice([None, rng.randint(0, 6 * B)]))
        elif op == "reset":
            r = bm.reset_prefix_cache()
            assert (r == -1) == bool(seqs or pins)

        for e in events:
            if isinstance(e, BlockStored):
                assert len(e.token_ids) == len(e.block_hashes) * B and mirror.isdisjoint(e.block_hashes)
                mirror.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= mirror
                mirror.difference_update(e.block_hashes)
            else:
                mirror.clear()
        events.clear()
        assert mirror == set(bm.bm._index)
        owners = Counter(b for s in seqs for b in s["blocks"]) + Counter(b for p in pins for b in p)
        assert [bm.ref_count(b) for b in range(24)] == [owners[b] for b in range(24)]
