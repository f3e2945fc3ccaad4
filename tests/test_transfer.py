"""shared.transfer: slot bookkeeping and plan_writes (pure logic), then real loopback-tcp Mooncake writes.

Real-transfer tests run two KVTransports in this one process (Mooncake allows it); a stuck peer needs a
separate process, started with a tiny `python -c` script (mooncake only, ~0.1 s). Every Mooncake call is
run in a daemon thread joined with a timeout, so a hang fails the test instead of stalling the suite
(signal.alarm cannot interrupt a call blocked in C++).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from shared.transfer import (DEFAULT_SLOT_BYTES, NOT_SUBMITTED, KVTransport, LandingSlots, Slot, TransferError,
                             plan_writes, set_tcp_progress_timeout)

# ---------------------------------------------------------------- plan_writes


def test_plan_writes_covers_exactly():
    assert plan_writes(0, 8) == []
    assert plan_writes(8, 8) == [(0, 8)]
    assert plan_writes(20, 8) == [(0, 8), (8, 8), (16, 4)]
    assert plan_writes(3, 8) == [(0, 3)]
    total = 3 * DEFAULT_SLOT_BYTES + 12345
    pieces = plan_writes(total, DEFAULT_SLOT_BYTES)
    assert [o for o, _ in pieces] == [i * DEFAULT_SLOT_BYTES for i in range(4)]
    assert sum(n for _, n in pieces) == total and pieces[-1][1] == 12345
    with pytest.raises(ValueError):
        plan_writes(-1, 8)
    with pytest.raises(ValueError):
        plan_writes(8, 0)


# ---------------------------------------------------------------- LandingSlots (no transport)


def test_slots_acquire_release():
    ls = LandingSlots(4, slot_bytes=64)
    a = ls.acquire(3, "a")
    assert [s.slot_id for s in a] == [0, 1, 2] and ls.num_free == 1
    assert all(s.addr == ls.buffer.data_ptr() + s.slot_id * 64 and s.nbytes == 64 for s in a)
    assert len(ls.acquire(5, "b")) == 1          # fewer than asked
    assert ls.acquire(1, "c") == [] and ls.acquire(0, "c") == []
    ls.check_integrity()
    assert ls.release([0, 2]) == 2 and ls.num_free == 2
    with pytest.raises(ValueError):
        ls.release([0])                           # double release
    with pytest.raises(ValueError):
        ls.release([1, 1])
    ls.check_integrity()
    with pytest.raises(Exception):
        a[0].slot_id = 9                          # frozen
    assert isinstance(a[0], Slot)


def test_slots_release_owner_and_stale_release():
    ls = LandingSlots(3, slot_bytes=16)
    ids = [s.slot_id for s in ls.acquire(2, "req-1")]
    assert ls.release_owner("req-1") == 2 and ls.num_free == 3
    assert ls.release_owner("req-1") == 0 and ls.release_owner("nobody") == 0
    ls.acquire(3, "req-2")                       # req-1's old slots now belong to req-2
    assert ls.release(ids, owner="req-1") == 0   # late release from the cancelled request: no effect
    assert ls.held_by("req-2") == {0, 1, 2}
    assert ls.release(ids, owner="req-2") == 2
    ls.check_integrity()


def test_slots_view():
    ls = LandingSlots(3, slot_bytes=16)
    ls.buffer.copy_(torch.arange(48, dtype=torch.uint8))
    assert ls.view(1, 5).tolist() == [16, 17, 18, 19, 20]
    assert ls.view(2, 0).numel() == 0 and ls.view(2, 16).dtype == torch.uint8
    for bad in [(3, 1), (-1, 1), (0, 17)]:
        with pytest.raises(ValueError):
            ls.view(*bad)


def test_slots_random_ops_keep_integrity():
    rng = random.Random(7)
    ls = LandingSlots(16, slot_bytes=8)
    held: dict[str, list[int]] = {}
    for _ in range(2000):
        owner = f"r{rng.randrange(6)}"
        op = rng.random()
        if op < 0.5:
            got = ls.acquire(rng.randrange(5), owner)
            held.setdefault(owner, []).extend(s.slot_id for s in got)
        elif op < 0.8 and held.get(owner):
            k = rng.randrange(len(held[owner]) + 1)
            part, held[owner] = held[owner][:k], held[owner][k:]
            assert ls.release(part) == len(part)
        else:
            assert ls.release_owner(owner) == len(held.pop(owner, []))
        ls.check_integrity()
        assert ls.num_free == 16 - sum(len(v) for v in held.values())


# ---------------------------------------------------------------- real transfers (loopback tcp)


def bounded(fn, timeout: float = 5.0):
    """Run fn in a daemon thread; fail (not hang) if it does not return within timeout seconds."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    if th.is_alive():
        pytest.fail(f"Mooncake call still blocked after {timeout}s")
    if "error" in out:
        raise out["error"]
    return out.get("value")


@pytest.fixture(scope="module")
def pair():
    src, dst = KVTransport(), KVTransport()
    yield src, dst
    src.close()
    dst.close()


@pytest.fixture
def buffers(pair):
    src_t, dst_t = pair
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=gen)
    dst = torch.full((3 << 20,), 0xAB, dtype=torch.uint8)  # poisoned
    src_t.register(src)
    dst_t.register(dst)
    yield src, dst
    src_t.unregister(src)
    dst_t.unregister(dst)


def test_endpoint_format(pair):
    host, port = pair[1].endpoint.rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert pair[0].endpoint != pair[1].endpoint


def test_write_roundtrip_exact(pair, buffers):
    (src_t, dst_t), (src, dst) = pair, buffers
    # uneven pieces (one not a multiple of 4096), written in shuffled order, covering all of src
    cuts = [0, 1 << 20, (1 << 20) + 4097, (2 << 20) + 13, 3 << 20]
    pieces = [(a, b - a) for a, b in zip(cuts, cuts[1:])][::-1]
    s0, d0 = src.data_ptr(), dst.data_ptr()
    bounded(lambda: src_t.write(dst_t.endpoint, [s0 + o for o, _ in pieces], [d0 + o for o, _ in pieces],
                                [n for _, n in pieces]))
    assert torch.equal(src, dst)


class _CountingEngine:
    """Spies on a Transfer Engine: `batches` = pieces in flight together per group (a group starts when
    none is), `sync_calls` = pieces sent through the busy-polling sync call."""

    def __init__(self, engine):
        self.engine, self.batches, self.sync_calls, self.in_flight = engine, [], [], set()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def transfer_submit_write(self, peer, src, dst, length):
        return self._submitted(self.engine.transfer_submit_write(peer, src, dst, length))

    def batch_transfer_async_read(self, peer, locals_, remotes, lens):
        return self._submitted(self.engine.batch_transfer_async_read(peer, locals_, remotes, lens))

    def _submitted(self, batch):
        if batch in (0, 2**64 - 1):  # not submitted: nothing in flight
            return batch
        if not self.in_flight:
            self.batches.append(0)
        self.batches[-1] += 1
        self.in_flight.add(batch)
        return batch

    def transfer_check_status(self, batch):
        assert batch in self.in_flight, "a batch checked after the engine freed it"
        rc = self.engine.transfer_check_status(batch)
        if rc != 0:
            self.in_flight.discard(batch)
        return rc

    def batch_transfer_sync_write(self, peer, srcs, dsts, lens):
        self.sync_calls.append(len(srcs))
        return self.engine.batch_transfer_sync_write(peer, srcs, dsts, lens)


def test_write_splits_batches_above_max_batch(pair, buffers, monkeypatch):
    (src_t, dst_t), (src, dst) = pair, buffers
    spy = _CountingEngine(src_t._engine)
    monkeypatch.setattr(src_t, "_engine", spy)
    monkeypatch.setattr(src_t, "max_batch", 8)
    pieces = plan_writes(20 * 1000, 1000)   # 20 pieces of 1000 B -> 8 + 8 + 4
    s0, d0 = src.data_ptr(), dst.data_ptr()
    bounded(lambda: src_t.write(dst_t.endpoint, [s0 + o for o, _ in pieces], [d0 + o for o, _ in pieces],
                                [n for _, n in pieces]))
    assert spy.batches == [8, 8, 4] and spy.sync_calls == [] and not spy.in_flight
    assert torch.equal(dst[:20000], src[:20000]) and bool((dst[20000:] == 0xAB).all())
    # default max_batch (512): 600 small pieces also land, in two calls
    monkeypatch.setattr(src_t, "max_batch", 512)
    spy.batches.clear()
    pieces = plan_writes(600 * 512, 512)
    bounded(lambda: src_t.write(dst_t.endpoint, [s0 + o for o, _ in pieces], [d0 + o for o, _ in pieces],
                                [n for _, n in pieces]))
    assert spy.batches == [512, 88] and spy.sync_calls == [] and not spy.in_flight and torch.equal(dst[:600 * 512], src[:600 * 512])


def test_read_pulls_exact_bytes_without_the_sync_call(pair, buffers, monkeypatch):
    """`read` (the pool's direct reads): the peer's registered memory into ours, each piece its own batch,
    checked until none is in flight; a bad piece fails alone, with a code, and nothing is left running."""
    (src_t, dst_t), (src, dst) = pair, buffers
    spy = _CountingEngine(dst_t._engine)
    monkeypatch.setattr(dst_t, "_engine", spy)
    monkeypatch.setattr(dst_t, "max_batch", 2)
    cuts = [0, 1 << 20, (1 << 20) + 4097, (2 << 20) + 13, 3 << 20]
    pieces = [(a, b - a) for a, b in zip(cuts, cuts[1:])][::-1]
    s0, d0 = src.data_ptr(), dst.data_ptr()
    codes = bounded(lambda: dst_t.read([(src_t.endpoint, d0 + o, s0 + o, n) for o, n in pieces]))
    assert codes == [0] * 4 and torch.equal(src, dst)
    assert spy.batches == [2, 2] and spy.sync_calls == [] and not spy.in_flight
    dst.fill_(0xAB)
    codes = bounded(lambda: dst_t.read([(src_t.endpoint, d0, s0, 4096), (src_t.endpoint, d0 + 4096, 0x1000, 4096),
                                        ("127.0.0.1:1", d0 + 8192, s0, 4096)]))
    assert codes[0] == 0 and codes[1] < 0 and codes[2] == NOT_SUBMITTED and not spy.in_flight
    assert torch.equal(dst[:4096], src[:4096]) and bool((dst[8192:] == 0xAB).all())
    loose = torch.ones(4096, dtype=torch.uint8)
    with pytest.raises(TransferError) as e:       # local destination not registered: nothing is read
        dst_t.read([(src_t.endpoint, loose.data_ptr(), s0, 4096)])
    assert e.value.code == -3 and bool((loose == 1).all())
    assert dst_t.covers(dst) and not dst_t.covers(loose)


def test_landing_slots_end_to_end(pair):
    src_t, dst_t = pair
    ls = LandingSlots(4, slot_bytes=1 << 20, transport=dst_t)
    staging = torch.randint(0, 256, ((2 << 20) + 777,), dtype=torch.uint8)
    src_t.register(staging)
    try:
        pieces = plan_writes(staging.numel(), ls.slot_bytes)
        slots = ls.acquire(len(pieces), "req-1")
        assert len(slots) == 3
        s0 = staging.data_ptr()
        bounded(lambda: src_t.write(dst_t.endpoint, [s0 + o for o, _ in pieces], [s.addr for s in slots],
                                    [n for _, n in pieces]))
        got = torch.cat([ls.view(s.slot_id, n) for s, (_, n) in zip(slots, pieces)])
        assert torch.equal(got, staging)
        assert ls.release_owner("req-1") == 3
        ls.check_integrity()
    finally:
        src_t.unregister(staging)
        ls.close()


def test_register_rejects_bad_tensors(pair):
    t = pair[0]
    with pytest.raises(ValueError):
        t.register(torch.zeros(8, 8)[:, 0])      # not contiguous
    with pytest.raises(ValueError):
        t.register(torch.zeros(0))
    x = torch.zeros(4096, dtype=torch.uint8)
    t.register(x)
    try:
        with pytest.raises(TransferError) as e:
            t.register(x)                         # overlapping registration
        assert e.value.code == -7
    finally:
        t.unregister(x)
    with pytest.raises(KeyError):
        t.unregister(x)


def test_write_errors(pair, buffers, monkeypatch):
    (src_t, dst_t), (src, dst) = pair, buffers
    s0, d0 = src.data_ptr(), dst.data_ptr()
    spy = _CountingEngine(src_t._engine)
    monkeypatch.setattr(src_t, "_engine", spy)
    with pytest.raises(TransferError):           # one bad piece among good ones: waited for, all of them
        bounded(lambda: src_t.write(dst_t.endpoint, [s0, s0 + 4096, s0 + 8192], [d0, 0x1000, d0 + 8192],
                                    [4096] * 3))
    assert spy.batches == [3] and spy.sync_calls == [] and not spy.in_flight
    with pytest.raises(TransferError):           # remote address outside any registered buffer
        bounded(lambda: src_t.write(dst_t.endpoint, [s0], [0x1000], [4096]))
    with pytest.raises(TransferError):           # runs past the end of the remote buffer
        bounded(lambda: src_t.write(dst_t.endpoint, [s0], [d0 + dst.numel() - 100], [4096]))
    loose = torch.ones(4096, dtype=torch.uint8)
    with pytest.raises(TransferError) as e:      # local source not registered (checked here)
        bounded(lambda: src_t.write(dst_t.endpoint, [loose.data_ptr()], [d0], [4096]))
    assert e.value.code == -3
    with pytest.raises(TransferError):           # nobody listening
        bounded(lambda: src_t.write("127.0.0.1:1", [s0], [d0], [4096]))
    assert spy.sync_calls[-1] == 1               # not submitted: the sync call, which forgets the dead peer
    with pytest.raises(ValueError):
        src_t.write(dst_t.endpoint, [s0], [d0, d0], [1])
    bounded(lambda: src_t.write(dst_t.endpoint, [s0], [d0], [4096]))  # the peer is not poisoned
    assert torch.equal(dst[:4096], src[:4096])


def test_write_to_closed_peer_fails_fast(pair, buffers):
    src_t, (src, _) = pair[0], buffers
    peer = KVTransport()
    land = torch.zeros(1 << 16, dtype=torch.uint8)
    peer.register(land)
    bounded(lambda: src_t.write(peer.endpoint, [src.data_ptr()], [land.data_ptr()], [4096]))
    endpoint = peer.endpoint
    peer.close()
    peer.close()                                  # idempotent
    with pytest.raises(TransferError):
        peer.write(endpoint, [0], [0], [1])       # closed transport
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        bounded(lambda: src_t.write(endpoint, [src.data_ptr()], [land.data_ptr()], [4096]))
    assert time.monotonic() - t0 < 2


# more than loopback socket buffers absorb (tcp_rmem + tcp_wmem maxima: 32 + 4 MiB by default): a write to a
# frozen peer cannot complete into the kernel's buffers (1 MiB once did, at load 9)
STUCK_BYTES = 64 << 20
_STUCK_PEER = f"""
import ctypes, sys
STUCK_BYTES = {STUCK_BYTES}
from mooncake.engine import TransferEngine
e = TransferEngine()
assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
buf = ctypes.create_string_buffer(STUCK_BYTES)
assert e.register_memory(ctypes.addressof(buf), STUCK_BYTES) == 0
print(e.get_rpc_port(), ctypes.addressof(buf), flush=True)
sys.stdin.read()
"""


def _wait_stopped(pid: int) -> None:
    """Until the kernel shows the process stopped (state T): SIGSTOP is delivered asynchronously."""
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        time.sleep(0.005)


def test_write_to_stuck_peer_times_out(pair, monkeypatch):
    """A live but frozen peer blocks a write until the tcp progress timeout (default 30 s; here 1 s)."""
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "30")  # so monkeypatch restores the original
    set_tcp_progress_timeout(1)
    t = pair[0]                                  # created before the timeout was set: still applies
    proc = subprocess.Popen([sys.executable, "-c", _STUCK_PEER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    src = torch.ones(STUCK_BYTES, dtype=torch.uint8)
    t.register(src)
    try:
        port, addr = map(int, bounded(proc.stdout.readline, 10).split())
        bounded(lambda: t.write(f"127.0.0.1:{port}", [src.data_ptr()], [addr], [STUCK_BYTES]))
        os.kill(proc.pid, signal.SIGSTOP)
        bounded(lambda: _wait_stopped(proc.pid), 10)
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            bounded(lambda: t.write(f"127.0.0.1:{port}", [src.data_ptr()], [addr], [STUCK_BYTES]), 5)
        assert time.monotonic() - t0 < 4
    finally:
        proc.kill()
        proc.wait(5)
        t.unregister(src)
    with pytest.raises(ValueError):
        set_tcp_progress_timeout(0)
