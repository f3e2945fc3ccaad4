"""Runs a rendered unit's service the way systemd on that host would: inside the host's network namespace,
with the host's own files at the paths the unit names.

Each host has a root directory R holding what would be on its disk: R/etc/moorage (the rendered configs and
env files, as `moorage deploy render` wrote them) and R/var/{lib,log,cache}/moorage (what systemd's
StateDirectory=/LogsDirectory=/CacheDirectory= create). A service starts under `ip netns exec` (which gives
it a mount namespace of its own) and, before its ExecStart, mounts read-only overlays so that /etc/moorage
and /var/*/moorage are that host's, then binds the three writable directories. Nothing of this is visible
outside the service's process tree, so the rendered files run unchanged: same paths, same ExecStart.

Readiness: a `Type=notify` service gets a NOTIFY_SOCKET of its own and is ready when its main process sends
READY=1, as systemd has it with NotifyAccess=main (the sender's pid is checked); waiting watches that socket
and the process together (a pidfd), so a service that dies while starting fails at once with its log.
Every service runs in its own process group; `stop` is KillMode=mixed: SIGTERM to the main process, a wait,
then SIGKILL to whatever is left of the group.

Not emulated: User=/Group= (services run as root here), the sandboxing directives (ProtectSystem=, PrivateTmp=,
NoNewPrivileges=, ...), Restart=, the limits, and nats' KillSignal=SIGUSR2 (lame duck: it gets SIGTERM).
"""

from __future__ import annotations

import os
import selectors
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.cluster.netns import Host
from tests.cluster.units import ServiceSpec

WRITABLE = ("var/lib/moorage", "var/log/moorage", "var/cache/moorage")


@dataclass
class HostFS:
    """A host's disk, rooted at `root`."""
    root: Path

    def local(self, path: str | os.PathLike) -> Path:
        """Where a path of this host lives here."""
        return self.root / str(path).lstrip("/")

    def prepare(self, kernel_cache: Path | None = None) -> None:
        """The directories systemd would create; `kernel_cache` (compiled CPU kernels) is copied into the
        host's /var/cache/moorage/kernels, as a host that ran moorage before has it (saves a compile per host)."""
        for d in ("etc/moorage", *WRITABLE):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        if kernel_cache is not None and kernel_cache.is_dir():
            shutil.copytree(kernel_cache, self.root / "var/cache/moorage/kernels", dirs_exist_ok=True)

    def mount_script(self) -> str:
        """Shell lines that make this host's files appear at their paths (run inside the service's own
        mount namespace; the overlays are read-only, the state, log and cache directories writable)."""
        r = shlex.quote(str(self.root))
        lines = [f"mount -t overlay moorage-etc -o lowerdir={r}/etc:/etc /etc",
                 f"mount -t overlay moorage-var -o lowerdir={r}/var:/var /var"]
        lines += [f"mount --bind {r}/{d} /{d}" for d in WRITABLE]
        return "\n".join(lines)

    def refused(self, prefix: list[str]) -> str | None:
        """Why this host's files cannot be mounted at their paths from inside `prefix` (None: they can)."""
        self.prepare()
        script = f"set -e\n{self.mount_script()}\ntest -d /etc/moorage && test -w /var/log/moorage"
        r = subprocess.run([*prefix, "sh", "-c", script], capture_output=True, text=True, timeout=30)
        return None if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


class ServiceFailed(RuntimeError):
    pass


@dataclass
class Service:
    spec: ServiceSpec
    host: Host
    proc: subprocess.Popen
    log_path: Path
    notify_sock: socket.socket | None = None
    ready_s: float | None = None
    status: list[str] = field(default_factory=list)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> float:
        """Seconds until READY=1 (Type=notify); raises with the log tail if it exits or times out first."""
        if self.notify_sock is None:
            return 0.0
        t0 = time.monotonic()
        pidfd = os.pidfd_open(self.proc.pid)
        sel = selectors.DefaultSelector()
        sel.register(self.notify_sock, selectors.EVENT_READ, "notify")
        sel.register(pidfd, selectors.EVENT_READ, "exit")
        try:
            while True:
                left = timeout - (time.monotonic() - t0)
                events = sel.select(max(left, 0)) if left > 0 else []
                if not events:
                    raise ServiceFailed(f"{self.host.name}/{self.spec.unit}: no READY=1 within {timeout:.0f} s\n"
                                        f"{self.log_tail()}")
                for key, _ in events:
                    if key.data == "exit":
                        rc = self.proc.wait()
                        raise ServiceFailed(f"{self.host.name}/{self.spec.unit} exited ({rc}) before READY=1\n"
                                            f"{self.log_tail()}")
                    sender, states = _notification(self.notify_sock)
                    if sender != self.proc.pid:  # NotifyAccess=main: systemd ignores anyone else
                        self.status.append(f"ignored from pid {sender}: {states}")
                        continue
                    self.status += states
                    if "READY=1" in states:
                        self.ready_s = time.monotonic() - t0
                        return self.ready_s
        finally:
            sel.close()
            os.close(pidfd)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to the process group (systemd's KillMode=mixed sends it to the main process; the services
        stop their own children), then SIGKILL to the group if it has not exited within `timeout`."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the group
        except ProcessLookupError:
            pass
        rc = self.proc.wait()
        if self.notify_sock is not None:
            self.notify_sock.close()
            self.notify_sock = None
        return rc


def _notification(sock: socket.socket) -> tuple[int | None, list[str]]:
    """One sd_notify datagram: (the sender's pid from SCM_CREDENTIALS, its KEY=VALUE lines)."""
    data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
    pid = None
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = struct.unpack("3i", payload[:struct.calcsize("3i")])[0]
    return pid, data.decode(errors="replace").split("\n")


def start(spec: ServiceSpec, host: Host, fs: HostFS, run_dir: Path, replace: dict[str, str] | None = None) -> Service:
    """Start `spec` on `host` (its network namespace, its files); `replace` swaps argv words (e.g. where
    nats-server is installed here)."""
    argv = [(replace or {}).get(a, a) for a in spec.argv]
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "HOME")}  # a unit's env is
    env.update(spec.environment)                                                             # nearly empty
    sock = None
    if spec.notify:
        path = run_dir / f"{host.name}-{spec.name}.notify"
        path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        sock.bind(str(path))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # who sent it, as systemd checks
        env["NOTIFY_SOCKET"] = str(path)
    workdir = spec.working_directory or "/"
    script = f"set -e\n{fs.mount_script()}\ncd {shlex.quote(workdir)}\nexec \"$@\""
    log_path = run_dir / f"{host.name}-{spec.name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([*host.exec_prefix(), "sh", "-c", script, spec.name, *argv], env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    return Service(spec, host, proc, log_path, sock)
