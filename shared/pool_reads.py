"""Reading pool objects with the reader's own Transfer Engine, waited for without spinning.

Mooncake Store's reads (`batch_get_into*`) wait for their transfers by busy-polling unless the store is
built with event-driven completion, which the pip wheel is not: a restore's read then burns a core of
the prefill host for its whole length, beside the tcp copies and the verify that should overlap it
(measured on 2 cores: 84 MB in 54-65 ms with 54-82 ms of CPU through the store client, 41-56 ms with
36-51 ms of CPU this way).

`DirectReads` has the store client's read interface (`get_into`, `get_into_pieces`: bytes read per
object, or a negative code). It asks the master where each object is (`PoolClient.replicas`: one query,
which grants the read lease a store read's own query would), then reads every piece from the store's
registered memory with `KVTransport.read` (each piece its own batch, checked between short naps).
- An object with no complete in-memory replica (missing, on disk only, master unreachable) is read
  through the store client instead, which answers with the exact code (-704, -900, ...).
- A piece that fails makes its object TRANSFER_FAIL (-800): its store died or is unreachable.
- A read that took longer than `lease_s` (the master's read lease, default_kv_lease_ttl) counts as
  LEASE_EXPIRED (-707), as the store client's does: the object may have been evicted and its memory
  reused meanwhile. Whatever is read is still verified by its reader (header and CRC-32C) before use.
Local buffers must be registered with the transport (and, for the fallback, with the client).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from shared.pool import INVALID_PARAMS, PoolClient, TRANSFER_FAIL
from shared.transfer import KVTransport

LEASE_EXPIRED = -707
DEFAULT_LEASE_S = 10.0  # the master's default_kv_lease_ttl (services/master/config.py)


class DirectReads:
    def __init__(self, client: PoolClient, transport: KVTransport, lease_s: float = DEFAULT_LEASE_S):
        self.client, self.transport, self.lease_s = client, transport, lease_s
        self.counts = {"direct": 0, "through_store": 0}  # objects read each way

    def get_into(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """PoolClient.get_into's contract: each object into [addrs[i], addrs[i] + sizes[i])."""
        return self.get_into_pieces(keys, [[a] for a in addrs], [[n] for n in sizes])

    def get_into_pieces(self, keys: Sequence[str], addrs: Sequence[Sequence[int]],
                        sizes: Sequence[Sequence[int]]) -> list[int]:
        """PoolClient.get_into_pieces's contract: each object into its buffers in order; bytes read per
        object, or a negative code."""
        if len(addrs) != len(keys) or len(sizes) != len(keys) or any(len(a) != len(n) for a, n in zip(addrs, sizes)):
            raise ValueError("each object needs its addresses and as many sizes")
        t0 = time.monotonic()
        out, pieces, owner, other = [0] * len(keys), [], [], []
        for i, where in enumerate(self.client.replicas(keys)):
            if where is None:
                other.append(i)
                continue
            peer, base, size = where
            if size > sum(sizes[i]):
                out[i] = INVALID_PARAMS  # as the store client answers a buffer smaller than the object
                continue
            off = 0
            for addr, n in zip(addrs[i], sizes[i]):
                take = min(n, size - off)
                if take <= 0:
                    break
                pieces.append((peer, addr, base + off, take))
                owner.append(i)
                off += take
            out[i] = size
        for i, rc in zip(owner, self.transport.read(pieces)):
            if rc != 0:
                out[i] = TRANSFER_FAIL
        if time.monotonic() - t0 > self.lease_s:
            out = [LEASE_EXPIRED if got >= 0 else got for got in out]
        self.counts["direct"] += len(keys) - len(other)
        if other:
            self.counts["through_store"] += len(other)
            got = self.client.get_into_pieces([keys[i] for i in other], [addrs[i] for i in other],
                                              [sizes[i] for i in other])
            for i, g in zip(other, got):
                out[i] = g
        return out
