"""Restart=on-failure for the processes of `moorage up`.

One supervisor thread owns every child: it spawns them (so PR_SET_PDEATHSIG, which fires when the
spawning *thread* exits, holds exactly as long as the supervisor runs) and restarts them. A waiter
thread per child blocks in `Popen.wait()` and pushes the exit onto the supervisor's queue; the
supervisor blocks on that queue, with a timeout only when a restart is due. Nothing polls.

Before `arm()` (start-up) an exit is fatal: it is recorded in `failed` and `failed_event` is set, so
the launcher can say which service did not start. After `arm()`, a child that exits non-zero or by a
signal is restarted after a backoff (0.5 s doubling to 10 s; back to 0.5 s once a run lasted
`reset_after_s`); one that exits 0 stays stopped (a clean stop, as systemd's on-failure). The others
keep running either way. Every such exit is reported to `on_exit` the moment waitpid returns (the
launcher announces it on the bus: infra/exits.py).

`stop()` stops the children in reverse start order, in waves: consecutive children (in that order) whose
`stop_wave` is the same are sent SIGTERM together and waited for together, so stopping takes the sum of each
wave's slowest child, not of every child.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from shared.config import ConfigError


@dataclass(frozen=True)
class RestartPolicy:
    mode: str = "on-failure"     # on-failure: restart what crashed | no: never restart
    backoff_s: float = 0.5       # first restart delay; doubles per consecutive failure
    backoff_max_s: float = 10.0  # cap of that delay
    reset_after_s: float = 30.0  # a run that lasted this long resets the delay to backoff_s

    def __post_init__(self) -> None:
        if self.mode not in ("on-failure", "no"):
            raise ConfigError(f"restart mode must be on-failure or no, got {self.mode!r}")
        if not 0 < self.backoff_s <= self.backoff_max_s or self.reset_after_s < 0:
            raise ConfigError("need 0 < restart backoff_s <= backoff_max_s and reset_after_s >= 0")

    def restarts(self, returncode: int) -> bool:
        return self.mode == "on-failure" and returncode != 0

    def delay(self, failures: int) -> float:
        """The wait before restart number `failures` of a row of failures (1, 2, ...)."""
        return min(self.backoff_s * 2 ** max(failures - 1, 0), self.backoff_max_s)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class Child:
    name: str
    spawn: Callable[[], subprocess.Popen]
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0          # times restarted by the supervisor
    failures: int = 0          # consecutive failures (backoff)
    last_exit: str = ""        # how it last ended, e.g. "killed by SIGKILL"
    waiter: threading.Thread | None = None


@dataclass
class Supervisor:
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    say: Callable[[str], None] = print                           # one console line per event
    on_change: Callable[["Supervisor"], None] = lambda s: None    # after any spawn/exit (state file)
    on_exit: Callable[[str, subprocess.Popen, int], None] = lambda name, proc, code: None  # a child ended on its
    #                                          own (not stopped by us): called at once, on the supervisor thread
    clock: Callable[[], float] = time.monotonic
    stop_wave: Callable[[str], object] = lambda name: name         # children stopped together (see stop())
    children: dict[str, Child] = field(default_factory=dict)      # in start order
    failed: list[str] = field(default_factory=list)               # exits before arm()
    failed_event: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._events: queue.Queue = queue.Queue()
        self._due: list[tuple[float, str]] = []  # (when, child) restarts waiting for their backoff
        self._armed = self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="moorage-supervisor", daemon=True)
        self._thread.start()

    # -- called from any thread -------------------------------------------------------------------
    def call(self, fn: Callable[[], object]) -> object:
        """Run fn on the supervisor thread and return its result (or raise its exception)."""
        done: Future = Future()
        self._events.put(("call", fn, done))
        return done.result()

    def add(self, name: str, spawn: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        """Start a child (on the supervisor thread) and watch it from now on."""
        return self.call(lambda: self._start(Child(name, spawn)))

    def arm(self) -> None:
        """From now on a crash restarts the child instead of counting as a failed start-up."""
        self.call(lambda: setattr(self, "_armed", True))

    def pids(self) -> dict[str, int]:
        return {n: c.process.pid for n, c in self.children.items() if c.process is not None}

    def stop(self, timeout: float = 15.0) -> None:
        """Stop every child in reverse start order, a wave at a time (SIGTERM to the wave, SIGKILL to what of
        it is left after timeout), then the thread."""
        if self._thread.is_alive():
            self.call(lambda: self._stop_all(timeout))
            self._events.put(("quit",))
            self._thread.join()

    # -- the supervisor thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            wait = max(0.0, self._due[0][0] - self.clock()) if self._due else None
            try:
                event = self._events.get(timeout=wait)
            except queue.Empty:
                self._restart_due()
                continue
            if event[0] == "quit":
                return
            if event[0] == "call":
                _, fn, done = event
                try:
                    done.set_result(fn())
                except BaseException as e:  # handed to the caller
                    done.set_exception(e)
            elif event[0] == "exit":
                self._on_exit(*event[1:])

    def _start(self, child: Child) -> subprocess.Popen:
        self.children[child.name] = child
        self._spawn(child)
        return child.process

    def _spawn(self, child: Child) -> None:
        proc = child.spawn()
        child.process, child.started_at = proc, self.clock()
        child.waiter = threading.Thread(target=lambda: self._events.put(("exit", child.name, proc, proc.wait())),
                                        name=f"wait-{child.name}", daemon=True)
        child.waiter.start()
        self.on_change(self)

    def _on_exit(self, name: str, proc: subprocess.Popen, returncode: int) -> None:
        child = self.children.get(name)
        if child is None or child.process is not proc or self._stopping:
            return  # an earlier run of a restarted child, or we are stopping it ourselves
        child.last_exit = describe_exit(returncode)
        self.on_exit(name, proc, returncode)
        if not self._armed:
            self.failed.append(name)
            self.failed_event.set()
        elif self.policy.restarts(returncode):
            self._schedule(child)
        else:
            self.say(f"{name} stopped ({child.last_exit}); not restarted (restart=on-failure)")
        self.on_change(self)

    def _schedule(self, child: Child) -> None:
        if self.clock() - child.started_at >= self.policy.reset_after_s:
            child.failures = 0
        child.failures += 1
        delay = self.policy.delay(child.failures)
        self.say(f"{child.name} (pid {child.process.pid}) {child.last_exit}; restarting in {delay:g} s")
        heapq.heappush(self._due, (self.clock() + delay, child.name))

    def _restart_due(self) -> None:
        while self._due and self._due[0][0] <= self.clock():
            _, name = heapq.heappop(self._due)
            child = self.children[name]
            if self._stopping or child.process.poll() is None:
                continue
            child.restarts += 1
            try:
                self._spawn(child)
            except Exception as e:  # e.g. the binary is gone: try again later
                child.last_exit = f"restart failed: {e}"
                self._schedule(child)
                continue
            self.say(f"{name} restarted (pid {child.process.pid}, restart {child.restarts})")

    def _stop_all(self, timeout: float) -> None:
        self._stopping = True
        self._due.clear()
        running = [c for c in reversed(list(self.children.values())) if c.process is not None and c.waiter]
        for _, group in itertools.groupby(running, key=lambda c: self.stop_wave(c.name)):
            wave = list(group)
            for child in wave:
                if child.process.returncode is None:
                    child.process.terminate()
            deadline = time.monotonic() + timeout  # the wave's, not the injectable restart clock's
            for child in wave:
                child.waiter.join(max(0.0, deadline - time.monotonic()))
            for child in wave:
                if child.waiter.is_alive():
                    child.process.kill()
                    child.waiter.join()
