"""The tracing UI of `moorage up --set up.trace_ui=phoenix`: Arize Phoenix (an OTLP trace UI from PyPI)
as one more local process, and every service's exporter pointed at it.

Phoenix comes from the `[ui]` extra when it is installed in this interpreter, else from its own venv
(`.venv-phoenix`, made on first use with `pip install arize-phoenix`, like bench/aiperf's
.venv-aiperf): it brings ~850 MB (pandas, sqlalchemy, strawberry, ...) that the services never import,
and its pins then never constrain the project's. It listens on loopback, on free ports, and keeps its
database in RUN_DIR/phoenix. Services keep writing RUN_DIR/traces.jsonl too (exporter "jsonl,otlp-http"),
so `moorage trace` works either way.

`python -m infra.trace_ui` makes the venv (infra/dev-env.sh runs it, so CI has Phoenix).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from shared.sockets import free_port
from shared.tracing import PROJECT  # the Phoenix project every service's spans go to

TRACE_UIS = ("", "phoenix")  # "" = none
PHOENIX_SPEC = "arize-phoenix>=12,<30"
DEFAULT_VENV = Path(__file__).resolve().parents[1] / ".venv-phoenix"
MARKER = ".moorage-phoenix"


def venv_ready(venv: Path = DEFAULT_VENV) -> bool:
    return (venv / "bin" / "phoenix").exists() and (venv / MARKER).exists()


def ensure_venv(venv: Path = DEFAULT_VENV, python: str = "python3", log=print) -> Path:
    """The venv with Phoenix (made if missing: ~4 minutes and ~850 MB on these machines). RuntimeError
    with the tail of pip's log if the install fails."""
    venv = Path(venv).absolute()
    if venv_ready(venv):
        return venv
    if not (venv / "bin" / "python").exists():
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
    log(f"trace UI: pip install {PHOENIX_SPEC} into {venv} (first use: a few minutes, ~850 MB)")
    pip_log = venv / "pip-install.log"
    with open(pip_log, "w") as f:
        r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check",
                            PHOENIX_SPEC], stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0 or not (venv / "bin" / "phoenix").exists():
        tail = [ln for ln in pip_log.read_text(errors="replace").splitlines() if "is ignored" not in ln][-15:]
        raise RuntimeError(f"installing {PHOENIX_SPEC} into {venv} failed (exit {r.returncode}; {pip_log}):\n"
                           + "\n".join(tail))
    (venv / MARKER).write_text(PHOENIX_SPEC + "\n")
    return venv


def phoenix_command(venv: Path = DEFAULT_VENV, log=print) -> list[str]:
    """How to run `phoenix serve`: the [ui] extra in this interpreter if present, else the own venv."""
    if importlib.util.find_spec("phoenix") is not None and importlib.util.find_spec("phoenix.server") is not None:
        return [sys.executable, "-m", "phoenix.server.main", "serve"]
    return [str(ensure_venv(venv, log=log) / "bin" / "phoenix"), "serve"]


@dataclass
class Phoenix:
    """A running Phoenix: `url` is the UI (and its OTLP/HTTP endpoint is url + /v1/traces)."""
    process: subprocess.Popen
    url: str
    grpc_port: int
    workdir: Path

    @property
    def otlp_http(self) -> str:
        return self.url + "/v1/traces"

    def trace_url(self, trace_id: str) -> str:
        return f"{self.url}/redirects/traces/{trace_id}"

    def stop(self, timeout: float = 15.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_phoenix(workdir: Path, host: str = "127.0.0.1", port: int = 0, ready_timeout_s: float = 120.0,
                  venv: Path = DEFAULT_VENV, log=print, preexec_fn=None) -> Phoenix:
    """Starts Phoenix (database and log in `workdir`) and returns once /healthz answers 200."""
    workdir = Path(workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    grpc = free_port(host)
    env = {**os.environ, "PHOENIX_HOST": host, "PHOENIX_PORT": str(port), "PHOENIX_GRPC_PORT": str(grpc),
           "PHOENIX_WORKING_DIR": str(workdir), "PHOENIX_TELEMETRY_ENABLED": "false"}
    out = open(workdir / "phoenix.log", "ab")
    proc = subprocess.Popen(phoenix_command(venv, log), env=env, stdout=out, stderr=subprocess.STDOUT,
                            preexec_fn=preexec_fn)
    out.close()
    phoenix = Phoenix(proc, f"http://{host}:{port}", grpc, workdir)
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"Phoenix exited during start-up (code {proc.returncode}); see {workdir}/phoenix.log")
        try:
            with urllib.request.urlopen(phoenix.url + "/healthz", timeout=2) as r:
                if r.status == 200:
                    return phoenix
        except OSError:
            pass
        time.sleep(0.5)  # a child process's readiness: nothing to await but its port
    phoenix.stop()
    raise TimeoutError(f"Phoenix not ready after {ready_timeout_s:.0f} s; see {workdir}/phoenix.log")


def start_trace_ui(kind: str, run_dir: Path, log=print) -> Phoenix:
    """The UI `up.trace_ui` names, started for the system in run_dir (dies with the launcher)."""
    from infra.procs import die_with_parent

    if kind != "phoenix":
        raise ValueError(f"unknown trace UI {kind!r}: expected one of {', '.join(t for t in TRACE_UIS if t)}")
    log("starting Phoenix (the trace UI) ...")
    return start_phoenix(Path(run_dir) / "phoenix", log=log, preexec_fn=die_with_parent())


def export_to(cfg, endpoint: str, traces_path: Path):
    """A copy of an UpConfig whose every service exports to `endpoint` over OTLP/HTTP as well as to
    `traces_path` (jsonl). Sections without tracing (up) are left alone."""
    changed = {}
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        tracing = getattr(section, "tracing", None)
        if tracing is None:
            continue
        path = str(traces_path) if tracing.path == "moorage-traces.jsonl" else tracing.path
        changed[f.name] = dataclasses.replace(section, tracing=dataclasses.replace(
            tracing, exporter="jsonl,otlp-http", endpoint=endpoint, path=path))
    return dataclasses.replace(cfg, **changed)


if __name__ == "__main__":  # python -m infra.trace_ui [VENV]: make Phoenix's venv
    print(ensure_venv(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_VENV))
