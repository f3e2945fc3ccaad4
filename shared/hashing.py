"""Chained content hashes over token ids, shared bit-for-bit by router and prefill.

Two granularities use the same chain: device blocks (16 tokens) index the prefix cache, store chunks
(256 tokens) name pool objects. Digest i = blake2b-16(digest i-1 || token ids of unit i as little-endian
uint32); digest -1 is the namespace seed, so deployments (model, layout, tenant) never share a chain.
Only full units are hashed: a partial tail has no digest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BLOCK_TOKENS = 16
CHUNK_TOKENS = 256
DIGEST_BYTES = 16

assert CHUNK_TOKENS % BLOCK_TOKENS == 0


def namespace_seed(namespace: str) -> bytes:
    """The chain's starting digest for a namespace string."""
    return hashlib.blake2b(namespace.encode(), digest_size=DIGEST_BYTES).digest()


def token_bytes(token_ids: Sequence[int]) -> bytes:
    return np.asarray(token_ids, dtype="<u4").tobytes()


def hash_unit(prev: bytes, unit_token_ids: Sequence[int]) -> bytes:
    h = hashlib.blake2b(prev, digest_size=DIGEST_BYTES)
    h.update(token_bytes(unit_token_ids))
    return h.digest()


def chain_hashes(
    token_ids: Sequence[int], unit: int, seed: bytes, start_unit: int = 0, prev: bytes | None = None
) -> list[bytes]:
    """Digests of full units [start_unit, len//unit). `prev` is unit start_unit-1's digest (or seed)."""
    raw = token_bytes(token_ids)
    step = unit * 4
    digest = seed if prev is None else prev
    if start_unit > 0 and prev is None:
        raise ValueError("chain_hashes: start_unit > 0 needs the previous digest")
    out = []
    for i in range(start_unit, len(token_ids) // unit):
        h = hashlib.blake2b(digest, digest_size=DIGEST_BYTES)
        h.update(raw[i * step : (i + 1) * step])
        digest = h.digest()
        out.append(digest)
    return out


def block_hashes(token_ids: Sequence[int], seed: bytes) -> list[bytes]:
    return chain_hashes(token_ids, BLOCK_TOKENS, seed)


def chunk_hashes(token_ids: Sequence[int], seed: bytes, chunk_tokens: int = CHUNK_TOKENS) -> list[bytes]:
    return chain_hashes(token_ids, chunk_tokens, seed)
