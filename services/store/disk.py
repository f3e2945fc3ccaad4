"""The store's disk tier: pool objects copied to a local disk, so that a chunk the DRAM pool evicted can
come back from there instead of being recomputed. Blocking file I/O: call it from a worker thread.

Layout (`store.disk_path`, one directory per store instance):
    {disk_path}/objects/{quoted key}        one file per pool object, byte for byte as the pool holds it
                                            (the 128-byte moorage header, then the payload)
    {disk_path}/objects/{quoted key}.tmp    a write in progress; never read, removed at start
The file name is the object's key with every character outside [A-Za-z0-9_.-] %-quoted (urllib's quote),
so `ns/s0of2/ab12..` is `ns%2Fs0of2%2Fab12..`. Nothing else is kept: the index is rebuilt at start from the
directory (least recently used first, by modification time; a read touches the file).

Writes are atomic and durable before they count: an object is written to its `.tmp` name, fsynced,
renamed, and the directory fsynced; only then does it enter the index (and the store announce it). A store
killed mid-write leaves a `.tmp` file, which the next start deletes: what was announced is on disk whole.
Reads verify every byte (`shared.kv_object.verify_as`: the header names this key, the size is the
header's, the payload's CRC-32C matches); a file that fails is deleted and counts as a miss, never data.

Space: the tier holds at most `capacity` bytes and evicts its least recently used files to make room. A
write that fails (disk full, I/O error, read-only) stops all further writes, with one error line: the
store goes on as DRAM-only, and what is on disk can still be read. A path that cannot be created or
written at start turns the tier off the same way.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from pathlib import Path
from urllib.parse import quote, unquote

import torch

from shared.kv_object import verify_as

TMP = ".tmp"


def file_name(key: str) -> str:
    return quote(key, safe="")


class DiskTier:
    def __init__(self, path: str, capacity: int, log):
        self.dir, self.capacity, self.log = Path(path) / "objects", capacity, log
        self.lock = threading.Lock()  # the index: a spill's write and a load's read run in two threads
        self.index: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self.used = 0
        self.off_reason = ""  # why writes stopped ("" while they go on)
        self.counters = {"written": 0, "written_bytes": 0, "read": 0, "read_bytes": 0, "evicted": 0,
                         "verify_failures": 0, "read_errors": 0, "partial_removed": 0, "deleted": 0}
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._probe()
        except OSError as e:
            self._stop(f"disk path {path!r} unusable: {e}")
            return
        self._scan()

    @property
    def writable(self) -> bool:
        return not self.off_reason

    def _stop(self, reason: str) -> None:
        if not self.off_reason:
            self.off_reason = reason
            self.log.error("disk tier writes stopped: the store goes on DRAM-only", reason=reason)

    def _probe(self) -> None:
        probe = self.dir / (".probe" + TMP)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"moorage")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink()

    def _scan(self) -> None:
        found = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(TMP):  # a write a killed store never finished: never announced
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                self.counters["partial_removed"] += 1
            elif entry.is_file():
                st = entry.stat()
                found.append((st.st_mtime_ns, unquote(entry.name), st.st_size))
        for _, key, size in sorted(found):
            self.index[key] = size
            self.used += size
        self.trim(0)

    def path(self, key: str) -> Path:
        return self.dir / file_name(key)

    def holds(self, key: str) -> bool:
        with self.lock:
            return key in self.index

    # ---- space ------------------------------------------------------------------------------------
    def trim(self, room: int) -> list[str]:
        """Deletes least recently used files until `room` more bytes fit; the keys removed. (Under the lock.)"""
        gone = []
        while self.index and self.used + room > self.capacity:
            key, size = self.index.popitem(last=False)
            self.used -= size
            with contextlib.suppress(FileNotFoundError):
                self.path(key).unlink()
            self.counters["evicted"] += 1
            gone.append(key)
        return gone

    def delete(self, keys: list[str]) -> list[str]:
        """Deletes these objects' files (a closed session's: nothing will ask for them again); the keys it held."""
        with self.lock:
            held = [k for k in keys if k in self.index]
            for k in held:
                self._forget(k)
            self.counters["deleted"] += len(held)
        return held

    def _forget(self, key: str) -> None:
        size = self.index.pop(key, None)
        if size is not None:
            self.used -= size
            with contextlib.suppress(OSError):
                self.path(key).unlink()

    # ---- write ------------------------------------------------------------------------------------
    def write(self, objects: list[tuple[str, memoryview]]) -> tuple[list[str], list[str]]:
        """Writes these objects (key, bytes) durably; (keys now on disk, keys evicted to make room). Keys
        already held are skipped (an object's bytes never change under its key)."""
        with self.lock:
            todo = [(k, b) for k, b in objects if k not in self.index and len(b) <= self.capacity]
            if not todo or not self.writable:
                return [], []
            evicted = self.trim(sum(len(b) for _, b in todo))
        done = []
        try:
            for key, data in todo:
                self._write_one(key, data)
                done.append((key, len(data)))
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)  # the renames are durable: now (and only now) the objects count
            finally:
                os.close(dfd)
        except OSError as e:
            for key, _ in done:  # renamed but not known durable: not announced, not kept
                with contextlib.suppress(OSError):
                    self.path(key).unlink()
            self._stop(f"writing {self.dir}: {e}")
            return [], evicted
        with self.lock:
            for key, size in done:
                self.index[key] = size
                self.used += size
                self.counters["written"] += 1
                self.counters["written_bytes"] += size
        return [k for k, _ in done], evicted

    def _write_one(self, key: str, data: memoryview) -> None:
        final = self.path(key)
        tmp = final.with_name(final.name + TMP)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view, off = memoryview(data).cast("B"), 0
            while off < len(view):
                off += os.write(fd, view[off:])
            os.fsync(fd)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        os.close(fd)
        os.rename(tmp, final)

    # ---- read -------------------------------------------------------------------------------------
    def size(self, key: str) -> int:
        with self.lock:
            return self.index.get(key, 0)

    def read_into(self, key: str, out: torch.Tensor) -> str | None:
        """Reads object `key` into `out` (uint8, exactly its size) and verifies it; None when `out` now holds
        the object, else why not (the file is then deleted: a miss from now on)."""
        with self.lock:
            if key not in self.index:
                return "not on disk"
        try:
            with open(self.path(key), "rb", buffering=0) as f:
                got = f.readinto(out.numpy())
                extra = f.read(1)
        except OSError as e:  # gone (evicted meanwhile) or unreadable
            with self.lock:
                self.counters["read_errors"] += 1
                self._forget(key)
            return f"read failed: {e}"
        why = "size differs from the index" if got != out.numel() or extra else verify_as(out, key)
        with self.lock:
            if why is not None:
                self.counters["verify_failures"] += 1
                self._forget(key)
            elif key in self.index:
                self.index.move_to_end(key)
        if why is not None:
            self.log.warning("disk object rejected", key=key, reason=why)
            return why
        with contextlib.suppress(OSError):
            os.utime(self.path(key))  # recency survives a restart
        with self.lock:
            self.counters["read"] += 1
            self.counters["read_bytes"] += got
        return None

    def stats(self) -> dict:
        with self.lock:
            return {"objects": len(self.index), "bytes": self.used, "capacity": self.capacity,
                    "writable": self.writable, "off_reason": self.off_reason, **self.counters}
