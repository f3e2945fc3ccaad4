"""Moving KV bytes between registered buffers with the Mooncake Transfer Engine.

Prefill gathers a request's KV into a contiguous staging buffer and writes it, in pieces of at most one
landing slot (`plan_writes`), straight into slots the decode side advertised (`LandingSlots`). Only
addresses travel on the bus; bytes travel here.

Facts this module relies on (mooncake-transfer-engine 0.3.13, measured on loopback tcp):
- `initialize(hostname, "P2PHANDSHAKE", protocol, device)` needs no metadata server; a peer is named
  "<hostname>:<rpc_port>". Several engines may live in one process.
- Failures come back as negative return codes, not exceptions: -1 invalid argument / transfer failed
  (bad remote address, dead peer), -3 address not registered, -7 overlapping registration.
- The remote side checks that every written range lies in one of its registered buffers; over tcp the
  *local* source is not checked (rdma would reject it), so `write` checks it here for both.
- Over tcp a batch of >1024 requests to one peer fails and can poison that peer: batches are capped.
- A peer that is alive but stuck (e.g. SIGSTOP) blocks a write until the tcp progress timeout
  (`set_tcp_progress_timeout`, default 30 s) passes; a dead or closed peer fails at once.
- The GIL is released during a transfer.
- `batch_transfer_sync_write` busy-polls its batch: the calling thread burns a core for the whole
  transfer (measured: its CPU time equals wall time), taking it from the tcp copies on a small host.
  So `write` submits each piece as a batch of its own (`transfer_submit_write`) and checks them with
  `transfer_check_status` between short, growing naps (32 MiB over loopback: 12-18 ms with ~2 ms of CPU,
  against 16-25 ms with 8-25 ms of CPU). The engine has no completion callback to wait on instead.
  `transfer_submit_write` returns 0 or 2**64-1 when it cannot submit (no such peer); `transfer_check_status`
  returns 1 done or -1 failed (either frees the batch: it must not be checked again), 0 still running,
  -2 timed out. A submit that fails sends the rest through the sync call, whose failure path also drops
  the engine's cached connection to a dead peer.
- `read` pulls pieces of a peer's registered memory the same way (`batch_transfer_async_read`, one piece
  per batch, since `transfer_check_status` looks at a batch's first task only): the pool's direct reads
  (shared/pool_reads.py) use it on the stores' segments, whose endpoints the master names.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from shared.config import ConfigError
from shared.device_staging import host_buffer

DEFAULT_SLOT_BYTES = 8 * 1024 * 1024
MAX_TCP_BATCH = 1024  # hard limit per call to one peer over tcp (see module docstring)
DEFAULT_MAX_BATCH = 512  # pieces per Transfer Engine call (KVTransport.write splits longer lists)
_NOT_SUBMITTED = (0, 2**64 - 1, -1)  # transfer_submit_write's and batch_transfer_async_read's failure values
NOT_SUBMITTED = -4  # `read`'s code for a piece the engine would not submit (peer unreachable)
FIRST_NAP_S, LONGEST_NAP_S = 25e-6, 0.5e-3  # between status checks of a write in flight


@dataclass
class TransferConfig:
    """The `transfer` section of prefill and decode configs."""
    hostname: str = "127.0.0.1"         # address peers reach this engine on
    protocol: str = "tcp"               # "rdma" on clusters
    metadata_server: str = "P2PHANDSHAKE"  # or an etcd/http metadata server URL
    device_name: str = ""               # RDMA NIC(s), e.g. "mlx5_0"
    slot_bytes: int = DEFAULT_SLOT_BYTES  # largest single write; decode's landing slot size
    slots: int = 8                      # decode: landing slots; prefill: staging buffers
    max_slots_per_round: int = 4        # prefill: credits asked for per round trip
    timeout_s: float = 60.0             # a handoff idle this long is abandoned and its KV freed
    tcp_progress_timeout_s: int = 10    # a stuck peer fails a write after this (process-wide)
    direct: bool = True                 # handoffs write KV straight into decode's pages when both block layouts match (no gather, no scatter); false, or a decode that cannot: through landing slots
    decode_reuse: bool = True           # decode keeps each prompt's landed blocks after its request ends (prefix-cached, reclaimable), and a later prompt that starts with them (a session's next turn) is sent only the rest; false on either side: every handoff moves the whole prompt
    copy_threads: int = 0               # threads of a KV copy that overlaps a transfer: a handoff's gather (prefill) or scatter (decode), a restore's unpack (prefill); 0 = torch's
    register_pages: bool = True         # false: the engine's KV pages are never registered with the transfer engine or the pool client, as a GPU's memory where GPUDirect is not available: no direct handoff, no in-place restore, and every KV copy to or from a staging buffer, landing slot or pool buffer runs through a scratch buffer on the pages' device (shared/device_staging.py: the path KV takes off a device, taken on CPU to test it; pages not on CPU take it whatever this says)
    early_verify: str = "auto"          # prefill, direct handoff: tell decode which writes have landed while the rest are on the wire, so it verifies them meanwhile (PagesLanded): "on", "off", or "auto" = on unless protocol is tcp (there the CPUs copy the bytes, and a verify beside them slows the write more than it saves: bench/handoff.py)

    def __post_init__(self) -> None:
        if self.copy_threads < 0:
            raise ConfigError(f"transfer.copy_threads must be >= 0, got {self.copy_threads}")
        if self.early_verify not in ("auto", "on", "off"):
            raise ConfigError(f"transfer.early_verify must be auto, on or off, got {self.early_verify!r}")

    @property
    def verify_while_writing(self) -> bool:
        """Whether a direct handoff tells decode of its landed writes during the write (`early_verify`)."""
        return self.early_verify == "on" or (self.early_verify == "auto" and self.protocol != "tcp")

    def make_transport(self) -> "KVTransport":
        set_tcp_progress_timeout(self.tcp_progress_timeout_s)
        return KVTransport(self.hostname, self.protocol, self.metadata_server, self.device_name)


class TransferError(RuntimeError):
    """A Mooncake call failed; `code` is the engine's (negative) return code."""

    def __init__(self, message: str, code: int):
        super().__init__(f"{message} (mooncake rc={code})")
        self.code = code


def _engine_class():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # pragma: no cover - depends on the installed extra
        raise TransferError(f"mooncake transfer engine is not installed: {e}", -1) from e
    return TransferEngine


def _await_batches(engine, batches: list[int], on_done=None) -> list[int]:
    """Checks single-piece batches in flight between short, growing naps until none runs: per batch 0 (done)
    or its failure code (-1 failed, -2 timed out). A batch that ended was freed by its check. on_done(i):
    called (on this thread) as batch i completes."""
    codes, running, nap = [0] * len(batches), list(range(len(batches))), FIRST_NAP_S
    while running:
        still = []
        for i in running:
            rc = engine.transfer_check_status(batches[i])
            if rc == 0:
                still.append(i)
            elif rc != 1:
                codes[i] = rc
            elif on_done is not None:
                on_done(i)
        running = still
        if running:
            time.sleep(nap)
            nap = min(2 * nap, LONGEST_NAP_S)
    return codes


class KVTransport:
    """One Transfer Engine: registered local buffers plus synchronous batched writes to peers.

    Invariant: every registered region is kept alive by a reference in `_regions` until unregistered,
    and `_starts` holds the regions' start addresses, sorted, for the local-range check.
    """

    def __init__(self, hostname: str = "127.0.0.1", protocol: str = "tcp",
                 metadata_server: str = "P2PHANDSHAKE", device_name: str = "",
                 max_batch: int = DEFAULT_MAX_BATCH):
        if not 1 <= max_batch <= MAX_TCP_BATCH:
            raise ValueError(f"max_batch must be in 1..{MAX_TCP_BATCH}, got {max_batch}")
        self.hostname, self.protocol, self.max_batch = hostname, protocol, max_batch
        self._lock = threading.Lock()
        self._regions: dict[int, torch.Tensor] = {}  # start address -> tensor (keeps it alive)
        self._starts: list[int] = []
        self._engine = _engine_class()()
        rc = self._engine.initialize(hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise TransferError(f"initialize({hostname!r}, {metadata_server!r}, {protocol!r}) failed", rc)
        self._endpoint = f"{hostname}:{self._engine.get_rpc_port()}"

    @property
    def endpoint(self) -> str:
        """What peers pass as `peer` to reach this transport, e.g. "127.0.0.1:15568"."""
        return self._endpoint

    def _live(self):
        if self._engine is None:
            raise TransferError("transport is closed", -1)
        return self._engine

    def register(self, tensor: torch.Tensor) -> None:
        """Register a tensor's memory for transfers (contiguous, CPU, non-empty, not overlapping)."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("only contiguous CPU tensors can be registered")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise ValueError("cannot register an empty tensor")
        addr = tensor.data_ptr()
        with self._lock:
            rc = self._live().register_memory(addr, nbytes)
            if rc != 0:
                raise TransferError(f"register_memory(0x{addr:x}, {nbytes}) failed", rc)
            self._regions[addr] = tensor
            bisect.insort(self._starts, addr)

    def unregister(self, tensor: torch.Tensor) -> None:
        addr = tensor.data_ptr()
        with self._lock:
            if addr not in self._regions:
                raise KeyError(f"tensor at 0x{addr:x} is not registered")
            rc = self._live().unregister_memory(addr)
            del self._regions[addr]
            self._starts.remove(addr)
        if rc != 0:
            raise TransferError(f"unregister_memory(0x{addr:x}) failed", rc)

    def _local_ok(self, addr: int, length: int) -> bool:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return False
        t = self._regions[self._starts[i]]
        return addr + length <= self._starts[i] + t.numel() * t.element_size()

    def write(self, peer: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int],
              on_landed=None) -> None:
        """Write src_addrs[i] (local, registered) -> dst_addrs[i] (peer, registered) for every i.
        on_landed(i): called on this thread as piece i is known complete at the peer (not for pieces a
        failed submit sent through the sync call; the write's return covers those).

        Synchronous; sent in batches of at most `max_batch`. On failure raises TransferError: some
        pieces may have landed, none is known to be complete, so the caller treats the whole hand-off
        as failed (and the receiver releases its slots).
        """
        n = len(src_addrs)
        if len(dst_addrs) != n or len(lengths) != n:
            raise ValueError("src_addrs, dst_addrs and lengths must have the same length")
        engine = self._live()
        with self._lock:
            bad = [i for i in range(n) if lengths[i] < 0 or not self._local_ok(src_addrs[i], lengths[i])]
        if bad:
            i = bad[0]
            raise TransferError(f"source 0x{src_addrs[i]:x}+{lengths[i]} is not in a registered buffer", -3)
        for lo in range(0, n, self.max_batch):
            hi = min(n, lo + self.max_batch)
            done = None if on_landed is None else (lambda i, lo=lo: on_landed(lo + i))
            rc = self._submit_and_wait(engine, peer, src_addrs[lo:hi], dst_addrs[lo:hi], lengths[lo:hi], done)
            if rc != 0:
                raise TransferError(f"write of pieces {lo}..{hi - 1} to {peer} failed", rc)

    def covers(self, tensor: torch.Tensor) -> bool:
        """Whether all of a tensor's memory lies in one registered buffer."""
        with self._lock:
            return self._local_ok(tensor.data_ptr(), tensor.numel() * tensor.element_size())

    def read(self, pieces: list[tuple[str, int, int, int]]) -> list[int]:
        """Read each piece (peer, local address, peer's address, length) from the peer's registered memory
        into local registered memory: per piece 0, or a negative code (NOT_SUBMITTED: the peer could not be
        reached). Synchronous, waited for without spinning like `write`; returns once none is in flight.
        Raises TransferError when a local range is not registered (nothing is read then)."""
        engine = self._live()
        with self._lock:
            bad = [p for p in pieces if p[3] < 0 or not self._local_ok(p[1], p[3])]
        if bad:
            raise TransferError(f"destination 0x{bad[0][1]:x}+{bad[0][3]} is not in a registered buffer", -3)
        codes = [0] * len(pieces)
        for lo in range(0, len(pieces), self.max_batch):
            running = []
            for i in range(lo, min(len(pieces), lo + self.max_batch)):
                peer, local, remote, length = pieces[i]
                batch = engine.batch_transfer_async_read(peer, [local], [remote], [length])
                if batch in _NOT_SUBMITTED:
                    codes[i] = NOT_SUBMITTED
                else:
                    running.append((i, batch))
            for (i, _), rc in zip(running, _await_batches(engine, [b for _, b in running])):
                codes[i] = rc
        return codes

    @staticmethod
    def _submit_and_wait(engine, peer: str, srcs: list[int], dsts: list[int], lengths: list[int],
                         on_done=None) -> int:
        """One batch of pieces, each submitted on its own and waited for without spinning; 0 or a failure
        code. Returns only once no piece is in flight (a batch is freed by its last check)."""
        running, submitted = [], 0
        for submitted in range(len(srcs)):
            batch = engine.transfer_submit_write(peer, srcs[submitted], dsts[submitted], lengths[submitted])
            if batch in _NOT_SUBMITTED:
                break
            running.append(batch)
        else:
            submitted = len(srcs)
        failed = next((rc for rc in _await_batches(engine, running, on_done) if rc != 0), 0)
        if failed:
            return failed
        if submitted < len(srcs):  # not submitted (peer unreachable?): the sync call, which also forgets a dead peer
            return engine.batch_transfer_sync_write(peer, srcs[submitted:], dsts[submitted:], lengths[submitted:])
        return 0

    def close(self) -> None:
        """Unregister everything and destroy the engine (takes ~0.3-1 s); idempotent."""
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is None:
                return
            for addr in self._starts:
                engine.unregister_memory(addr)
            self._regions.clear()
            self._starts.clear()
        del engine  # the pybind destructor stops the engine's threads and listeners

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def set_tcp_progress_timeout(seconds: int) -> None:
    """Fail a tcp transfer that makes no progress for this many whole seconds (engine default 30).

    Process-wide: the engine reads MC_TCP_PROGRESS_TIMEOUT_SEC from the environment while transferring,
    so it applies to every transport in the process, including ones already created.
    """
    if int(seconds) < 1:
        raise ValueError("the tcp progress timeout is whole seconds, at least 1")
    os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(int(seconds))


def plan_writes(total_bytes: int, slot_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) pieces covering [0, total_bytes) in order, each <= slot_bytes, only the last shorter."""
    if total_bytes < 0 or slot_bytes <= 0:
        raise ValueError(f"bad sizes: total_bytes={total_bytes}, slot_bytes={slot_bytes}")
    return [(off, min(slot_bytes, total_bytes - off)) for off in range(0, total_bytes, slot_bytes)]


@dataclass(frozen=True)
class Slot:
    slot_id: int
    addr: int  # absolute address in the decode process, for the peer to write to
    nbytes: int  # capacity


class LandingSlots:
    """Decode-side landing area: one contiguous uint8 host buffer cut into equal slots, lent out as credits.

    Invariant (check_integrity): every slot id is either in `_free` or in `_held`, never both, and the
    owner index `_by_owner` is exactly `_held` inverted. All methods are thread-safe.
    """

    def __init__(self, num_slots: int, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 transport: KVTransport | None = None, device: torch.device | str = "cpu"):
        """device: where the pages the slots are scattered into live; for a CUDA device the slots are pinned."""
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError(f"bad sizes: num_slots={num_slots}, slot_bytes={slot_bytes}")
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        # Written once now: a slot's first write must not page-fault its way in (~2K faults per 8 MiB slot,
        # paid inside the peer's transfer), and never-written bytes are zeros, not old heap contents.
        self.buffer = host_buffer(num_slots * slot_bytes, device).fill_(0)
        self._transport = transport
        if transport is not None:
            transport.register(self.buffer)
        self._base = self.buffer.data_ptr()
        self._lock = threading.Lock()
        self._free: deque[int] = deque(reversed(range(num_slots)))  # acquire pops from the right: 0 first
        self._held: dict[int, str] = {}
        self._by_owner: dict[str, set[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, n: int, owner: str) -> list[Slot]:
        """Up to n free slots for `owner` (fewer, possibly none, when short): the most recently released
        first (last in, first out), whose bytes are likeliest still in cache."""
        with self._lock:
            ids = [self._free.pop() for _ in range(min(max(n, 0), len(self._free)))]
            for s in ids:
                self._held[s] = owner
            if ids:
                self._by_owner.setdefault(owner, set()).update(ids)
        return [Slot(s, self._base + s * self.slot_bytes, self.slot_bytes) for s in ids]

    def view(self, slot_id: int, nbytes: int) -> torch.Tensor:
        """uint8 view of the first nbytes of a slot (no copy: read it before releasing the slot)."""
        if not 0 <= slot_id < self.num_slots or not 0 <= nbytes <= self.slot_bytes:
            raise ValueError(f"bad view: slot {slot_id}, {nbytes} bytes")
        start = slot_id * self.slot_bytes
        return self.buffer[start:start + nbytes]

    def release(self, slot_ids, owner: str | None = None) -> int:
        """Return slots to the free list; returns how many were freed.

        Without `owner` a slot that is not held is an error (double release). With `owner`, slots no
        longer held by that owner are skipped: a late release after `release_owner` (cancel) must not
        free a slot that has since been lent to someone else.
        """
        with self._lock:
            ids = list(slot_ids)
            if owner is None:
                stray = [s for s in ids if s not in self._held]
                if stray or len(set(ids)) != len(ids):
                    raise ValueError(f"slots not held (or repeated): {stray or ids}")
            else:
                ids = [s for s in dict.fromkeys(ids) if self._held.get(s) == owner]
            for s in ids:
                who = self._held.pop(s)
                held = self._by_owner[who]
                held.discard(s)
                if not held:
                    del self._by_owner[who]
                self._free.append(s)
            return len(ids)

    def release_owner(self, owner: str) -> int:
        """Free every slot held by `owner` (request cancelled, peer dead); returns how many."""
        with self._lock:
            ids = list(self._by_owner.get(owner, ()))
        return self.release(ids, owner=owner)

    def held_by(self, owner: str) -> set[int]:
        with self._lock:
            return set(self._by_owner.get(owner, ()))

    def check_integrity(self) -> None:
        with self._lock:
            free = list(self._free)
            assert len(set(free)) == len(free), "duplicate slot in the free list"
            assert not set(free) & self._held.keys(), "slot both free and held"
            assert len(free) + len(self._held) == self.num_slots, "slots lost or invented"
            inverted: dict[str, set[int]] = {}
            for s, who in self._held.items():
                inverted.setdefault(who, set()).add(s)
            assert inverted == self._by_owner, "owner index out of step with held slots"

    def close(self) -> None:
        if self._transport is not None:
            self._transport.unregister(self.buffer)
            self._transport = None
