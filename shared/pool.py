"""A client of the shared KV pool (Mooncake Store): zero-copy batched put/get/exists from registered buffers.

`PoolClient` is a *pure* client (global_segment_size=0): it contributes no memory; the store service
does. Every batch call is synchronous, releases the GIL while it runs, and is cut into batches of at
most `max_batch` keys (over tcp a batch of >1024 requests to one peer fails and can poison that peer).
Call it from a worker thread (`asyncio.to_thread`) in async code.

Facts this module relies on (mooncake-transfer-engine-non-cuda 0.3.13.post1, loopback tcp, measured):
- Return codes are ints, never exceptions. `batch_is_exist`: 1 exists, 0 missing, negative error
  (-900 RPC_FAIL when the master is down). `batch_get_into`: bytes read, or -704 OBJECT_NOT_FOUND,
  -800 TRANSFER_FAIL (the store holding it died: until the master's client_ttl passes, exists still
  says 1 and reads fail -800; then the object is gone: 0 / -704),
  -600 INVALID_PARAMS (buffer smaller than the object; a larger buffer is fine), -900 (master down,
  after ~4 s). `batch_put_from`: 0, or -200 NO_AVAILABLE_HANDLE (pool full: eviction catching up,
  objects leased, or an object larger than any one segment - that never succeeds), -600 (0-byte
  object, or bad group_ids), -900. `batch_remove`: 0, -704, -706 OBJECT_HAS_LEASE (read lease held).
- A put of an existing key returns 0 and keeps the OLD value; duplicate keys in one batch collapse
  silently (both report 0), so put_from refuses them.
- `batch_is_exist` and reads grant a read lease (master `default_kv_lease_ttl`, 10 s): a leased object
  is not evicted (and a pool full of leased objects answers puts with -200 until the leases end).
- `ReplicateConfig.group_ids` is per key (its length must equal the batch's); objects sharing a group
  id are evicted all-or-none. A group evicted before a late member is put is simply started anew.
- An object lives in one segment: it must fit in one store's segment (a larger one gets -200). Worse,
  every put the master cannot place makes it evict ~10% of the pool, so retrying a put that can never
  fit empties the pool (0.5 s of retries evicted every object of a 16%-full pool): put_from refuses
  objects over max_object_bytes locally; keep that below the smallest store segment.
- Over tcp even unregistered source/destination buffers work (memcpy path); rdma needs registration,
  so always register.
- setup() against an unreachable master retries for ~90 s: PoolClient checks the master's port first.
- After the master restarts (losing every object; stores remount by themselves in ~1 s) a client's
  first call fails at once with -900 on its stale connection and the next one works: a -900 that
  came back within STALE_RPC_S is retried once here. A master that is down answers -900 after ~4.3 s
  per call (MC_RPC_CONNECT_TIMEOUT_MS / MC_RPC_TIMEOUT_MS do not shorten that).
- 12 MiB put ~20-30 ms, get ~11-15 ms on loopback tcp (~0.5-1 GB/s).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

OK = 0
NO_AVAILABLE_HANDLE = -200  # pool full (retry after eviction) or the object exceeds a segment
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
CODE_NAMES = {0: "OK", -1: "INTERNAL_ERROR", -200: "NO_AVAILABLE_HANDLE", -600: "INVALID_PARAMS",
              -601: "ILLEGAL_CLIENT", -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND",
              -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
              -800: "TRANSFER_FAIL", -900: "RPC_FAIL"}
MAX_TCP_BATCH = 1024
RETRY_SLEEP_S = 0.02
STALE_RPC_S = 0.5  # a -900 faster than this is a stale connection to a restarted master: retried once


def code_name(rc: int) -> str:
    return CODE_NAMES.get(rc, f"rc={rc}")


class PoolError(RuntimeError):
    """The pool could not be joined (or a registration failed); `code` is Mooncake's return code."""

    def __init__(self, message: str, code: int = -1):
        super().__init__(f"{message} (mooncake rc={code} {code_name(code)})")
        self.code = code


@dataclass
class PoolConfig:
    master_addr: str = "127.0.0.1:50051"   # mooncake_master RPC address (host:port)
    metadata_server: str = "P2PHANDSHAKE"  # P2PHANDSHAKE (no metadata server) or an etcd/http URL
    protocol: str = "tcp"                  # "rdma" on clusters
    hostname: str = "127.0.0.1"            # address the pool's stores reach this client on
    device_name: str = ""                  # RDMA NIC(s), e.g. "mlx5_0"
    local_buffer_size: int = 0             # client staging buffer in bytes (0: zero-copy from registered buffers only)
    put_retry_s: float = 0.5               # a put answered "pool full" (-200) is retried this long, every ~20 ms
    max_batch: int = 512                   # keys per Mooncake call (tcp fails above 1024 to one peer)
    connect_timeout_s: float = 5.0         # how long to wait for the master's port before giving up
    max_object_bytes: int = 64 << 20       # larger puts are refused here: keep it below the smallest store segment


def wait_for_master(addr: str, timeout: float) -> bool:
    """True once host:port accepts a TCP connection (setup would otherwise retry for ~90 s)."""
    host, _, port = addr.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def store_class():
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction
    except ImportError as e:  # pragma: no cover - depends on the installed extra
        raise PoolError(f"mooncake store is not installed: {e}") from e
    return MooncakeDistributedStore, ReplicateConfig, SoftPinAction


def _memory_replica(replicas) -> tuple[str, int, int] | None:
    """(endpoint, address, size) of the first complete in-memory replica of one object, else None."""
    from mooncake.store import ReplicaStatus

    for r in replicas:
        if r.status == ReplicaStatus.COMPLETE and r.is_memory_replica():
            b = r.get_memory_descriptor().buffer_descriptor
            return b.transport_endpoint, b.buffer_address, b.size
    return None


class PoolClient:
    """A pure client of the pool. Registrations are locked here; batch calls go straight to Mooncake
    (which releases the GIL while they run)."""

    def __init__(self, config: PoolConfig | None = None, store=None):
        """store: a Mooncake store client already set up (a store service's segment owner) to act through,
        instead of joining the pool anew."""
        self.config = c = config or PoolConfig()
        if not 1 <= c.max_batch <= MAX_TCP_BATCH:
            raise ValueError(f"max_batch must be in 1..{MAX_TCP_BATCH}, got {c.max_batch}")
        store_cls, self._replicate_cls, pin = store_class()
        self._pin_enable = pin.ENABLE
        self._lock = threading.Lock()
        self._regions: dict[int, object] = {}  # address -> tensor (kept alive while registered)
        if store is not None:
            self._store = store
            return
        if not wait_for_master(c.master_addr, c.connect_timeout_s):
            raise PoolError(f"mooncake master {c.master_addr} is unreachable", RPC_FAIL)
        self._store = store_cls()
        rc = self._store.setup(c.hostname, c.metadata_server, 0, c.local_buffer_size, c.protocol,
                               c.device_name, c.master_addr)
        if rc != 0:
            self._store = None
            raise PoolError(f"setup({c.hostname!r}, {c.metadata_server!r}, master {c.master_addr}) failed", rc)

    def _live(self):
        if self._store is None:
            raise PoolError("pool client is closed")
        return self._store

    # ---- buffers -------------------------------------------------------------------------------
    def register(self, tensor) -> None:
        """Register a contiguous, non-empty tensor's memory for zero-copy put/get (CPU unless rdma)."""
        if not tensor.is_contiguous() or tensor.numel() == 0:
            raise ValueError("only contiguous, non-empty tensors can be registered")
        if tensor.device.type != "cpu" and self.config.protocol == "tcp":
            raise ValueError("over tcp only CPU tensors can be registered")
        addr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        with self._lock:
            if addr in self._regions:
                raise ValueError(f"a buffer at 0x{addr:x} is already registered")
            rc = self._live().register_buffer(addr, nbytes)
            if rc != 0:
                raise PoolError(f"register_buffer(0x{addr:x}, {nbytes}) failed", rc)
            self._regions[addr] = tensor

    def unregister(self, tensor) -> None:
        addr = tensor.data_ptr()
        with self._lock:
            if addr not in self._regions:
                raise KeyError(f"tensor at 0x{addr:x} is not registered")
            rc = self._live().unregister_buffer(addr)
            del self._regions[addr]
        if rc != 0:
            raise PoolError(f"unregister_buffer(0x{addr:x}) failed", rc)

    # ---- batch calls ---------------------------------------------------------------------------
    def _chunks(self, n: int):
        step = self.config.max_batch
        return ((lo, min(n, lo + step)) for lo in range(0, n, step))

    @staticmethod
    def _call(fn, n: int, *lists) -> list[int]:
        """fn(*lists) -> one code per item; a fast -900 (stale connection) is retried once for those items."""
        t0 = time.monotonic()
        rcs = fn(*lists)
        rcs = list(rcs) if len(rcs) == n else [RPC_FAIL] * n
        stale = [i for i, rc in enumerate(rcs) if rc == RPC_FAIL]
        if stale and time.monotonic() - t0 < STALE_RPC_S:
            again = fn(*[[lst[i] for i in stale] for lst in lists])
            if len(again) == len(stale):
                for i, rc in zip(stale, again):
                    rcs[i] = rc
        return rcs

    @staticmethod
    def _check(keys: Sequence[str], *others: Sequence[int]) -> None:
        if any(len(o) != len(keys) for o in others):
            raise ValueError("keys, addrs and sizes must have the same length")

    def exists(self, keys: Sequence[str]) -> list[bool | None]:
        """True / False per key; None means "could not ask" (ask again later), never a miss.
        Grants each existing object a read lease (master default_kv_lease_ttl)."""
        store, out = self._live(), []
        for lo, hi in self._chunks(len(keys)):
            rcs = self._call(store.batch_is_exist, hi - lo, list(keys[lo:hi]))
            out += [True if rc == 1 else False if rc == 0 else None for rc in rcs]
        return out

    def get_into(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Read each object into [addrs[i], addrs[i] + sizes[i]): bytes read, or a negative code
        (-704 missing, -800 its store died, -600 buffer too small, -900 master unreachable)."""
        self._check(keys, addrs, sizes)
        store, out = self._live(), []
        for lo, hi in self._chunks(len(keys)):
            out += self._call(store.batch_get_into, hi - lo, list(keys[lo:hi]), list(addrs[lo:hi]),
                              list(sizes[lo:hi]))
        return out

    def get_into_pieces(self, keys: Sequence[str], addrs: Sequence[Sequence[int]],
                        sizes: Sequence[Sequence[int]]) -> list[int]:
        """Read each object into several buffers, in order: its first sizes[i][0] bytes at addrs[i][0], the
        next sizes[i][1] at addrs[i][1], and so on. Bytes read, or a negative code as `get_into`'s."""
        self._check(keys, addrs, sizes)
        if any(len(a) != len(n) for a, n in zip(addrs, sizes)):
            raise ValueError("each object needs as many sizes as addresses")
        store, out = self._live(), []
        for lo, hi in self._chunks(len(keys)):
            out += self._call(store.batch_get_into_multi_buffers, hi - lo, list(keys[lo:hi]),
                              [list(a) for a in addrs[lo:hi]], [list(n) for n in sizes[lo:hi]])
        return out

    def replicas(self, keys: Sequence[str]) -> list[tuple[str, int, int] | None]:
        """Where each object's bytes lie: (its store's transfer endpoint, address, size) of a complete
        replica in a store's memory, or None (missing, not complete, only on disk, or the master could not
        be asked). Asking grants each object found a read lease, as a read does (one master query: a read's
        own first step)."""
        store, out = self._live(), []
        for lo, hi in self._chunks(len(keys)):
            found = store.batch_get_replica_desc(list(keys[lo:hi]))
            out += [_memory_replica(found.get(k, ())) for k in keys[lo:hi]]
        return out

    def put_from(self, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int],
                 group_id: str | Sequence[str] | None = None, *,
                 preferred_segment: str | None = None, soft_pin_s: float = 0.0) -> list[int]:
        """Store [addrs[i], addrs[i] + sizes[i]) under keys[i]: 0 or a negative code per key.

        With group_id (one string) every object of this call joins that eviction group (evicted
        all-or-none); a list gives each key its own group (group_id[i] for keys[i]), so one call can put
        several groups (a request's chunks, each chunk's stages one group).
        An existing key answers 0 and keeps its old value. "Pool full" (-200) is retried for up to
        put_retry_s. preferred_segment (a store's "host:port") asks for placement on that store.
        soft_pin_s > 0 soft-pins the new objects for that long (Mooncake's soft pin: the master evicts them only
        once no unpinned object is left to evict; each read or exists renews the pin for as long again).
        Raises ValueError for duplicate keys and for sizes outside 1..max_object_bytes.
        """
        self._check(keys, addrs, sizes)
        if len(set(keys)) != len(keys):
            raise ValueError("duplicate keys in one put (Mooncake would silently keep only one)")
        if soft_pin_s < 0:
            raise ValueError(f"soft_pin_s must not be negative, got {soft_pin_s}")
        bad = [n for n in sizes if not 0 < n <= self.config.max_object_bytes]
        if bad:  # a put the master can never place makes it evict: refuse it before asking
            raise ValueError(f"object size {bad[0]} outside 1..{self.config.max_object_bytes} (max_object_bytes)")
        groups = None if group_id is None else [group_id] * len(keys) if isinstance(group_id, str) else list(group_id)
        if groups is not None and len(groups) != len(keys):
            raise ValueError("group_id as a list needs one group per key")
        store = self._live()
        out: list[int] = []
        for lo, hi in self._chunks(len(keys)):
            out += self._put_chunk(store, list(keys[lo:hi]), list(addrs[lo:hi]), list(sizes[lo:hi]),
                                   None if groups is None else groups[lo:hi], preferred_segment, soft_pin_s)
        return out

    def _put_chunk(self, store, keys, addrs, sizes, groups, preferred_segment, soft_pin_s) -> list[int]:
        def put(idx: list[int]) -> list[int]:
            cfg = self._replicate_cls()
            if groups is not None:
                cfg.group_ids = [groups[i] for i in idx]
            if preferred_segment:
                cfg.preferred_segment = preferred_segment
            if soft_pin_s > 0:
                cfg.soft_pin_action = self._pin_enable
                cfg.soft_pin_ttl_ms = max(1, round(soft_pin_s * 1000))
            return self._call(lambda k, a, n: store.batch_put_from(k, a, n, cfg), len(idx),
                              [keys[i] for i in idx], [addrs[i] for i in idx], [sizes[i] for i in idx])

        rcs = put(list(range(len(keys))))
        deadline = time.monotonic() + self.config.put_retry_s
        while True:
            full = [i for i, rc in enumerate(rcs) if rc == NO_AVAILABLE_HANDLE]
            if not full or time.monotonic() >= deadline:
                return rcs
            time.sleep(RETRY_SLEEP_S)
            for i, rc in zip(full, put(full)):
                rcs[i] = rc

    def remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """0 removed, -704 missing, -706 a read lease is held (force=True removes anyway)."""
        store, out = self._live(), []
        for lo, hi in self._chunks(len(keys)):
            out += self._call(lambda k: store.batch_remove(k, force), hi - lo, list(keys[lo:hi]))
        return out

    def close(self) -> None:
        """Unregister every buffer and leave the pool; idempotent."""
        with self._lock:
            store, self._store = self._store, None
            if store is None:
                return
            for addr in self._regions:
                store.unregister_buffer(addr)
            self._regions.clear()
        store.close()

    def __enter__(self) -> "PoolClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
