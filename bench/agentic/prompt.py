"""Prompt text synthesised from a trace request's hash ids, token-count exact for the byte tokenizer.

Each hash id becomes a deterministic block of printable ASCII (one character is one token of the `tiny`
model's byte tokenizer), so equal ids give byte-identical blocks and the prompt of a request shares
exactly the block prefixes its hash ids share. The alphabet has no `<` or `|`, so no block can spell a
special token such as `<|im_start|>`, and no whitespace, so a template that trims message content
cannot change the length. Ids are namespaced by session id unless the scope is "global".
"""

from __future__ import annotations

import hashlib
import string
from functools import lru_cache

from bench.agentic.trace import TraceRequest, TraceSession

# 64 symbols, one per 6 bits of a hash byte; no whitespace, so a template that trims message content
# cannot change the token count.
ALPHABET = string.ascii_letters + string.digits + "-_"
assert len(ALPHABET) == 64 and "<" not in ALPHABET and "|" not in ALPHABET


def _namespace(session_id: str, scope: str) -> str:
    return "g" if scope == "global" else f"s:{session_id}"


@lru_cache(maxsize=1 << 16)
def _block(namespace: str, hash_id: int, n_chars: int) -> str:
    out: list[str] = []
    counter = 0
    while len(out) < n_chars:
        digest = hashlib.sha256(f"{namespace}\x00{hash_id}\x00{counter}".encode()).digest()
        out.extend(ALPHABET[b & 63] for b in digest)
        counter += 1
    return "".join(out[:n_chars])


def block_text(session_id: str, hash_id: int, scope: str, n_chars: int = 64) -> str:
    """The text of one block: `n_chars` printable characters determined by (namespace, hash id)."""
    if n_chars < 0:
        raise ValueError(f"n_chars must be non-negative, got {n_chars}")
    return _block(_namespace(session_id, scope), int(hash_id), n_chars)


def prompt_text(session: TraceSession, request: TraceRequest) -> str:
    """The request's prompt: its blocks concatenated, the last one cut so the text has exactly
    `request.in_tokens` characters (a partial block is a prefix of the full block with the same id)."""
    bs = session.block_size
    n = request.in_tokens
    if len(request.hash_ids) != -(-n // bs):
        raise ValueError(f"session {session.id!r}: {len(request.hash_ids)} hash ids cannot cover "
                         f"{n} tokens at block size {bs}")
    parts = [block_text(session.id, h, session.hash_id_scope, bs) for h in request.hash_ids]
    if parts and n % bs:
        parts[-1] = parts[-1][: n % bs]
    text = "".join(parts)
    assert len(text) == n
    return text
