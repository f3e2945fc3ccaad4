"""Device KV block allocator with a content-addressed prefix cache (nano-vllm / vLLM v1 style).

Every block id in [0, num_blocks) is in exactly one of three states:
  * in use         ref > 0; owners are sequences and transient holders (a save, a send). May carry a hash.
  * cached-free    ref == 0, indexed: its KV is still valid and `match_prefix` can hand it out again.
                   Kept in LRU order (least recently released first) and evicted only when `allocate`
                   runs out of plain blocks.
  * plain-free     ref == 0, no hash, no tokens: content is garbage.

A block's hash is the chained digest of its 16 tokens (`shared.hashing`), so one hash names a whole
prefix. The index maps hash -> the one canonical block holding it. A block that computed a prefix
another block already holds (two sequences prefilled the same text) keeps its hash, so later blocks of
its sequence can chain from it, but is not indexed; when freed it turns plain.

Events (`shared.kv_events`) report index changes only: a router mirroring them sees exactly the
index's keys.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from numbers import Integral

from shared.hashing import BLOCK_TOKENS, chain_hashes
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class OutOfBlocks(Exception):
    """Not enough free blocks; the allocator was left unchanged."""


@dataclass(frozen=True)
class PrefixMatch:
    block_ids: list[int]
    block_hashes: list[bytes]
    num_tokens: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_TOKENS, hash_seed: bytes = b"",
                 on_event: Callable[[KVEvent], None] | None = None, max_cached_free: int | None = None) -> None:
        """`max_cached_free`: at most this many cached-free blocks are kept (None: all); a release past it
        evicts the least recently released ones at once (engine.retained_fraction)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if max_cached_free is not None and max_cached_free < 0:
            raise ValueError("max_cached_free must not be negative")
        self.max_cached_free = max_cached_free
        self._num_blocks = num_blocks
        self.block_size = block_size
        self.hash_seed = hash_seed
        self._on_event = on_event
        self.on_allocate: Callable[[list[int]], None] | None = None  # told the ids of every allocate (PageWarmer)
        self._ref = [0] * num_blocks
        # times each block was allocated: its bytes can change only after an allocate (a new owner writes
        # it), so whatever was derived from a block's bytes (a checksum) holds while this stays the same
        self.generation = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # set iff _hash is set
        self._index: dict[bytes, int] = {}  # hash -> canonical block
        # Ordered sets (values unused). Plain: FIFO (so never-used blocks go out in id order: PageWarmer). Cached: LRU, most recently released at the end.
        self._plain_free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()

    # ---- sizes -------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._plain_free) + len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._index)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref[block_id]

    def lookup(self, block_hash: bytes) -> int | None:
        return self._index.get(block_hash)

    # ---- hashing and matching ----------------------------------------------------------------------
    def _hash_chain(self, token_ids: Sequence[int], start: int, stop: int, prev: bytes | None) -> list[bytes]:
        """Hashes of blocks [start, stop); prev is block start-1's hash, or at start 0 the chain's seed
        (a request's tenant namespace; None: this manager's own seed)."""
        return chain_hashes(token_ids[: stop * self.block_size], self.block_size, self.hash_seed,
                            start_unit=start, prev=prev)

    def block_hashes(self, token_ids: Sequence[int], seed: bytes | None = None) -> list[bytes]:
        return self._hash_chain(token_ids, 0, len(token_ids) // self.block_size, seed)

    def _block_tokens(self, token_ids: Sequence[int], i: int) -> tuple[int, ...]:
        return tuple(int(t) for t in token_ids[i * self.block_size : (i + 1) * self.block_size])

    def match_prefix(self, token_ids: Sequence[int], max_tokens: int | None = None,
                     seed: bytes | None = None) -> PrefixMatch:
        """Longest cached run of leading full blocks (under `seed`'s chain). Read-only: `acquire` the
        result to keep it."""
        limit = len(token_ids) if max_tokens is None else min(len(token_ids), max(max_tokens, 0))
        ids: list[int] = []
        hashes: list[bytes] = []
        for i, h in enumerate(self._hash_chain(token_ids, 0, limit // self.block_size, seed)):
            b = self._index.get(h)
            # Collision guard: a hash hit must also hold the very same tokens.
            if b is None or self._tokens[b] != self._block_tokens(token_ids, i):
                break
            ids.append(b)
            hashes.append(h)
        return PrefixMatch(ids, hashes, len(ids) * self.block_size)

    def match_hashes(self, block_hashes: Sequence[bytes]) -> list[int]:
        """The blocks indexed under the leading run of `block_hashes` (a chain: each names its whole prefix),
        for a caller that has the hashes but not the tokens yet (decode's grant). Read-only: `acquire` them,
        and check them against the tokens with `prefix_error` once those come."""
        out: list[int] = []
        for h in block_hashes:
            b = self._index.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def prefix_error(self, block_ids: Sequence[int], token_ids: Sequence[int], seed: bytes | None = None) -> str | None:
        """None when `block_ids` hold exactly the leading full blocks of `token_ids` (each block's chained hash
        under `seed` and its very tokens); else why not."""
        n = len(block_ids)
        if n * self.block_size > len(token_ids):
            return f"{n} blocks for a prompt of {len(token_ids)} tokens"
        for i, (b, h) in enumerate(zip(block_ids, self._hash_chain(token_ids, 0, n, seed))):
            self._check_id(b)
            if self._hash[b] != h or self._tokens[b] != self._block_tokens(token_ids, i):
                return f"block {i} (id {b}) does not hold tokens {i * self.block_size}..{(i + 1) * self.block_size - 1}"
        return None

    def unindex(self, block_ids: Iterable[int]) -> int:
        """Take blocks out of the prefix index (their content is no longer trusted): a free one turns plain
        now, a held one when its last owner lets go. Returns how many were indexed."""
        removed: list[bytes] = []
        for b in block_ids:
            self._check_id(b)
            if not self._is_indexed(b):
                continue
            removed.append(self._hash[b])
            del self._index[self._hash[b]]
            if self._ref[b] == 0:
                del self._cached_free[b]
                self._hash[b] = self._tokens[b] = None
                self._plain_free[b] = None
        if removed:
            self._emit(BlockRemoved(removed))
        return len(removed)

    # ---- ownership ---------------------------------------------------------------------------------
    def acquire(self, block_ids: Iterable[int]) -> None:
        """One more owner per id (repeats count twice). A cached-free block leaves the free pool.

        Only blocks holding something can be acquired: in use or cached. A plain free block has no
        content, so acquiring one is a bug (use `allocate`) and raises ValueError like an unknown id.
        """
        ids = list(block_ids)
        for b in ids:  # validate everything first: all-or-nothing
            self._check_id(b)
            if b in self._plain_free:
                raise ValueError(f"acquire: block {b} is free and holds nothing")
        for b in ids:
            if self._ref[b] == 0:
                del self._cached_free[b]
            self._ref[b] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """One owner lets go of each id. At ref 0 an indexed block becomes cached-free (at the LRU's
        recent end, in the order given: pass a block table reversed so tails are evicted before their
        prefixes), any other block becomes plain and forgets its hash.
        """
        ids = list(block_ids)
        for b, n in Counter(ids).items():  # validate first: all-or-nothing
            self._check_id(b)
            if self._ref[b] < n:
                raise ValueError(f"release: block {b} has {self._ref[b]} owners, released {n} times (double free)")
        for b in ids:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._is_indexed(b):
                    self._cached_free[b] = None
                else:
                    self._hash[b] = self._tokens[b] = None
                    self._plain_free[b] = None
        if self.max_cached_free is not None and len(self._cached_free) > self.max_cached_free:
            self._evict(len(self._cached_free) - self.max_cached_free)

    def _evict(self, n: int) -> None:
        """The n least recently released cached-free blocks turn plain (one BlockRemoved)."""
        evicted = []
        for _ in range(n):
            b = self._cached_free.popitem(last=False)[0]
            evicted.append(self._hash[b])
            del self._index[self._hash[b]]
            self._hash[b] = self._tokens[b] = None
            self._plain_free[b] = None
        self._emit(BlockRemoved(evicted))

    def demote(self, block_hashes: Sequence[bytes]) -> int:
        """The cached-free blocks holding these hashes (a prompt's, prefix first) move to the LRU's old end, the
        last one first: they are evicted before any other cached block, tails before their prefixes (a session
        whose task ended: shared/messages.SessionTurn). Blocks in use or not cached are left alone; returns how
        many moved."""
        moved = 0
        for h in block_hashes:
            b = self._index.get(h)
            if b is not None and b in self._cached_free:
                self._cached_free.move_to_end(b, last=False)
                moved += 1
        return moved

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free_blocks

    @property
    def num_plain_free_blocks(self) -> int:
        return len(self._plain_free)

    def spare_blocks(self, keep: Container[bytes]) -> int:
        """Free blocks that `allocate(n, keep)` may take: plain ones, and cached ones whose hash is not kept."""
        return len(self._plain_free) + sum(self._hash[b] not in keep for b in self._cached_free)

    def allocate(self, n: int, keep: Container[bytes] | None = None) -> list[int]:
        """n fresh blocks at ref 1, no hash. Plain blocks first, then cached ones, evicting LRU-first (never
        one whose hash is in `keep`); in increasing id order, whatever order they were freed in (tables are
        usually released last block first), so that blocks adjacent in memory stay adjacent in the table: a
        handoff or a restore moves a run of consecutive blocks as one piece (a table in reverse order cost one
        write per block)."""
        if n < 0:
            raise ValueError(f"allocate: negative count {n}")
        if n > self.num_free_blocks:
            raise OutOfBlocks(f"need {n} blocks, {self.num_free_blocks} free of {self._num_blocks}")
        victims = None
        if keep:
            victims = [b for b in self._cached_free if self._hash[b] not in keep][:max(0, n - len(self._plain_free))]
            if len(self._plain_free) + len(victims) < n:
                raise OutOfBlocks(f"need {n} blocks, {len(self._plain_free) + len(victims)} free without those kept")
        out: list[int] = []
        evicted: list[bytes] = []
        while len(out) < n and self._plain_free:
            out.append(self._plain_free.popitem(last=False)[0])
        chosen = iter(victims or ())
        while len(out) < n:
            if victims is None:
                b = self._cached_free.popitem(last=False)[0]
            else:
                b = next(chosen)
                del self._cached_free[b]
            h = self._hash[b]
            del self._index[h]
            evicted.append(h)
            self._hash[b] = self._tokens[b] = None
            out.append(b)
        out.sort()
        for b in out:
            self._ref[b] = 1
            self.generation[b] += 1
        if evicted:
            self._emit(BlockRemoved(evicted))
        if self.on_allocate is not None and out:
            self.on_allocate(out)
        return out

    # ---- registration ------------------------------------------------------------------------------
    def register_full_blocks(self, block_ids: Sequence[int], token_ids: Sequence[int], num_full_blocks: int,
                             start_block: int = 0, seed: bytes | None = None) -> list[bytes]:
        """Blocks [start_block, num_full_blocks) of a block table now hold computed KV: hash and index them.

        Returns their hashes. Emits BlockStored for the newly indexed ones: one event per contiguous
        run (a single event unless a duplicate sits between new blocks), so parent_block_hash is exact.
        """
        bs = self.block_size
        if not 0 <= start_block <= num_full_blocks <= len(block_ids):
            raise ValueError(f"register: need 0 <= {start_block=} <= {num_full_blocks=} <= {len(block_ids)}")
        if len(token_ids) < num_full_blocks * bs:
            raise ValueError(f"register: {num_full_blocks} blocks need {num_full_blocks * bs} tokens, "
                             f"got {len(token_ids)}")
        span = [block_ids[i] for i in range(start_block, num_full_blocks)]
        if len(set(span)) != len(span):
            raise ValueError("register: a block appears twice in the block table")
        for b in span:
            self._check_id(b)
            if self._ref[b] == 0:
                raise ValueError(f"register: block {b} is not in use")
        parent: bytes | None = None
        if start_block > 0:
            parent = self._hash[block_ids[start_block - 1]]
            if parent is None:
                raise ValueError(f"register: parent block {block_ids[start_block - 1]} is not registered")
        hashes = self._hash_chain(token_ids, start_block, num_full_blocks, parent if start_block else seed)
        for b, h in zip(span, hashes):  # validate: a block's content never changes once hashed
            if self._hash[b] is not None and self._hash[b] != h:
                raise ValueError(f"register: block {b} already holds a different prefix")

        runs: list[tuple[bytes | None, list[bytes], list[int]]] = []  # (parent, hashes, tokens)
        prev_new = False
        for i, (b, h) in enumerate(zip(span, hashes), start=start_block):
            toks = self._block_tokens(token_ids, i)
            self._hash[b], self._tokens[b] = h, toks
            is_new = h not in self._index  # else: already indexed here (no-op) or a duplicate
            if is_new:
                self._index[h] = b
                if not prev_new:
                    runs.append((hashes[i - start_block - 1] if i > start_block else parent, [], []))
                runs[-1][1].append(h)
                runs[-1][2].extend(toks)
            prev_new = is_new
        for run_parent, run_hashes, run_tokens in runs:
            self._emit(BlockStored(run_hashes, run_parent, run_tokens, bs))
        return hashes

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix. Only allowed when no block is in use (an in-use indexed block
        would otherwise survive an AllBlocksCleared). Returns the number of entries dropped, or -1
        (nothing changed, no event) if some block is in use.
        """
        if len(self._plain_free) + len(self._cached_free) != self._num_blocks:
            return -1
        dropped = len(self._index)
        for b in self._cached_free:
            self._hash[b] = self._tokens[b] = None
        self._plain_free.update(self._cached_free)
        self._cached_free.clear()
        self._index.clear()
        self._emit(AllBlocksCleared())
        return dropped

    def drop_cached(self, block_hashes: Iterable[bytes]) -> int:
        """Forget these prefixes now (a closed session's): each indexed block no request holds becomes plain
        free; a block in use stays as it is. Returns how many were dropped (one BlockRemoved for them)."""
        dropped = []
        for h in block_hashes:
            b = self._index.get(h)
            if b is None or self._ref[b] != 0:
                continue
            del self._cached_free[b], self._index[h]
            self._hash[b] = self._tokens[b] = None
            self._plain_free[b] = None
            dropped.append(h)
        if dropped:
            self._emit(BlockRemoved(dropped))
        return len(dropped)

    # ---- checks ------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        n = self._num_blocks
        plain, cached = self._plain_free, self._cached_free
        for pool, name in ((plain, "plain"), (cached, "cached")):
            bad = [b for b in pool if not 0 <= b < n]
            assert not bad, f"{name} free pool holds out-of-range ids {bad}"
        both = set(plain) & set(cached)
        assert not both, f"blocks {sorted(both)} are in both free pools"
        neg = [b for b in range(n) if self._ref[b] < 0]
        assert not neg, f"negative ref counts on blocks {neg}"
        used = sum(1 for r in self._ref if r > 0)
        assert len(plain) + len(cached) + used == n, \
            f"free ({len(plain)} plain + {len(cached)} cached) + used ({used}) != total ({n})"
        held = [b for b in (*plain, *cached) if self._ref[b] != 0]
        assert not held, f"free blocks {held} have owners"
        for h, b in self._index.items():
            assert self._hash[b] == h, f"index entry {h.hex()} -> block {b}, which records {self._hash[b]!r}"
            toks = self._tokens[b]
            assert toks is not None and len(toks) == self.block_size, \
                f"indexed block {b} has {None if toks is None else len(toks)} tokens, want {self.block_size}"
        for b in range(n):
            assert (self._hash[b] is None) == (self._tokens[b] is None), f"block {b}: hash and tokens disagree"
        unindexed = [b for b in cached if not self._is_indexed(b)]
        assert not unindexed, f"cached free pool holds unindexed blocks {unindexed}"
        hashed = [b for b in plain if self._hash[b] is not None]
        assert not hashed, f"plain free pool holds hashed (or indexed) blocks {hashed}"
        assert self.max_cached_free is None or len(cached) <= self.max_cached_free, \
            f"{len(cached)} cached-free blocks, at most {self.max_cached_free} may be kept"

    # ---- helpers -----------------------------------------------------------------------------------
    def _is_indexed(self, b: int) -> bool:
        h = self._hash[b]
        return h is not None and self._index.get(h) == b

    def _check_id(self, b: int) -> None:
        if not (isinstance(b, Integral) and 0 <= b < self._num_blocks):
            raise ValueError(f"unknown block id {b!r} (have {self._num_blocks})")

    def _emit(self, event: KVEvent) -> None:
        if self._on_event is not None:
            self._on_event(event)
