"""KV-cache lifecycle events, in the vLLM/ATOM shape (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`).

A block manager emits them as blocks enter and leave its prefix-cache index, so a router can mirror
which prefixes a worker holds. Hashes are the chained block digests of `shared.hashing`, so a hash
names its whole prefix. Plain data: serialization lives with the bus messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly indexed, as one chain: block_hashes[0]'s parent is parent_block_hash (None: chain start).

    token_ids is the concatenation of the blocks' tokens, block_size per block.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str = "device"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks no longer indexed (evicted for reuse)."""

    block_hashes: list[bytes]
    medium: str = "device"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every index entry of this medium is gone."""

    medium: str = "device"


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
