"""Processes the launcher owns: dying with their parent, telling one process from a later one with the same
pid, and waiting for processes that are not our children without polling.

- `die_with_parent()` is a `preexec_fn`: PR_SET_PDEATHSIG delivers SIGTERM to the child when the *thread*
  that forked it exits (so spawn from a thread that lives as long as the parent), and if the parent died
  between fork and prctl the child exits at once.
- `ProcId` is (pid, start time in clock ticks since boot, /proc/PID/stat field 22): a pid that was reused
  by another process has another start time.
- `wait_gone` waits on pidfds (Linux >= 5.3), so it wakes when a process exits, not on a timer.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A preexec_fn: the child gets `sig` when the thread that spawned it exits."""
    parent = os.getpid()

    def preexec() -> None:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:  # the parent died before prctl: nobody would ever signal us
            os._exit(1)

    return preexec


def start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: split after the last ')'
    return int(stat[stat.rindex(b")") + 2:].split()[19])


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class ProcId:
    pid: int
    ticks: int

    @classmethod
    def of(cls, pid: int) -> "ProcId | None":
        ticks = start_ticks(pid)
        return None if ticks is None else cls(pid, ticks)

    def alive(self) -> bool:
        """Still the very process recorded (not gone, not a reused pid). A zombie counts as gone."""
        if start_ticks(self.pid) != self.ticks:
            return False
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                stat = f.read()
            return stat[stat.rindex(b")") + 2:].split()[0] != b"Z"
        except OSError:
            return False

    def to_json(self) -> list[int]:
        return [self.pid, self.ticks]

    @classmethod
    def from_json(cls, value) -> "ProcId | None":
        if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value):
            return cls(value[0], value[1])
        return None


def wait_gone(procs: Iterable[ProcId], timeout: float) -> list[ProcId]:
    """Wait until every process has exited or `timeout` passed; returns those still alive. Not our
    children: nothing is reaped here (a zombie of ours counts as gone)."""
    fds: dict[int, ProcId] = {}
    try:
        for p in procs:
            if not p.alive():
                continue
            try:
                fds[os.pidfd_open(p.pid)] = p
            except (ProcessLookupError, PermissionError):
                continue
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout
        left = {fd for fd, p in fds.items() if p.alive()}
        while left and (remaining := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(remaining * 1000):
                poller.unregister(fd)
                left.discard(fd)
            left = {fd for fd in left if fds[fd].alive()}
        return [fds[fd] for fd in left]
    finally:
        for fd in fds:
            os.close(fd)


def terminate(procs: list[ProcId], grace_s: float = 5.0) -> list[ProcId]:
    """SIGTERM, then SIGKILL what is left after grace_s; returns what survived even that (should be none)."""
    for p in procs:
        if p.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, signal.SIGTERM)
    left = wait_gone(procs, grace_s)
    for p in left:
        if p.alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, signal.SIGKILL)
    return wait_gone(left, 2.0)
