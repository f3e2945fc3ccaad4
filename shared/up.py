"""`moorage up`: the whole system on one machine, as real processes.

Starts a nats-server (unless `up.nats_url` names one), then the gate, decode, prefill and router
services, each `python -m services.<name> --config <run_dir>/<name>.toml`, so compose and systemd run
the very same code with other files. Prints the URL once /health answers 200, and on Ctrl-C/SIGTERM
(or when any service dies) stops everything in reverse order. Children get PDEATHSIG, so none
outlives a killed launcher.

Config keys: `up.*` below, plus every key of every service under its name, e.g.
`--set prefill.engine.num_blocks=4096 --set router.router.port=8080`.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from services.decode.config import DecodeConfig
from services.gate.config import GateConfig
from services.prefill.config import PrefillConfig
from services.router.config import RouterConfig
from shared.natsd import NatsServer, start_nats_server
from shared.tomlgen import to_toml

SERVICES = ("gate", "decode", "prefill", "router")  # start order; stop order is the reverse
STATE_FILE = "up.json"


@dataclass
class UpSettings:
    model: str = "smollm2-135m"       # served by prefill and decode, tokenized by the router
    host: str = "127.0.0.1"           # router bind address (loopback unless you mean it)
    port: int = 8000                  # router port
    nats_url: str = ""                # empty: start an embedded nats-server on a free loopback port
    run_dir: str = ".moorage"         # configs, logs, traces, state for `moorage status`
    ready_timeout_s: float = 300.0    # give up if /health is not 200 by then


@dataclass
class UpConfig:
    up: UpSettings = field(default_factory=UpSettings)
    gate: GateConfig = field(default_factory=GateConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    router: RouterConfig = field(default_factory=RouterConfig)


def _service_configs(cfg: UpConfig, nats_url: str, run_dir: Path) -> dict:
    """Each service's config with the launcher's shared choices applied (model, bus, traces)."""
    out = {}
    for name in SERVICES:
        sc = getattr(cfg, name)
        sc = dataclasses.replace(sc, bus=dataclasses.replace(sc.bus, url=nats_url))
        if sc.tracing.exporter == "jsonl" and sc.tracing.path == "moorage-traces.jsonl":
            sc = dataclasses.replace(sc, tracing=dataclasses.replace(sc.tracing, path=str(run_dir / "traces.jsonl")))
        if name in ("prefill", "decode"):
            sc = dataclasses.replace(sc, engine=dataclasses.replace(sc.engine, model=cfg.up.model))
        if name == "router":
            sc = dataclasses.replace(sc, router=dataclasses.replace(sc.router, model=cfg.up.model,
                                                                   host=cfg.up.host, port=cfg.up.port))
        out[name] = sc
    return out


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Launcher:
    def __init__(self, cfg: UpConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.up.run_dir).resolve()
        self.procs: dict[str, subprocess.Popen] = {}
        self.nats: NatsServer | None = None
        self._stopping = False

    def start(self) -> str:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        nats_url = self.cfg.up.nats_url
        if not nats_url:
            self.nats = start_nats_server(log_path=str(self.run_dir / "nats.log"))
            nats_url = self.nats.url
        configs = _service_configs(self.cfg, nats_url, self.run_dir)
        for name in SERVICES:
            path = self.run_dir / f"{name}.toml"
            path.write_text(to_toml(configs[name]))
            log = open(self.run_dir / f"{name}.log", "ab")
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", f"services.{name}", "--config", str(path)],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        url = f"http://{self.cfg.up.host}:{self.cfg.up.port}"
        state = {"nats_url": nats_url, "router_url": url, "pids": {n: p.pid for n, p in self.procs.items()},
                 "run_dir": str(self.run_dir), "started": time.time()}
        (self.run_dir / STATE_FILE).write_text(json.dumps(state, indent=1))
        return url

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def wait_ready(self, url: str) -> None:
        deadline = time.monotonic() + self.cfg.up.ready_timeout_s
        while time.monotonic() < deadline and not self._stopping:
            if self.dead():
                raise RuntimeError(f"{', '.join(self.dead())} exited during start-up; see {self.run_dir}/*.log")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"not ready after {self.cfg.up.ready_timeout_s:.0f} s; see {self.run_dir}/*.log")

    def stop(self, timeout: float = 15.0) -> None:
        self._stopping = True
        for name in reversed(SERVICES):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if self.nats is not None:
            self.nats.stop()
        with_state = self.run_dir / STATE_FILE
        if with_state.exists():
            with_state.unlink()


def run_up(cfg: UpConfig) -> int:
    launcher = Launcher(cfg)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        url = launcher.start()
        print(f"moorage: starting {', '.join(SERVICES)} with model {cfg.up.model} (logs in {launcher.run_dir})",
              flush=True)
        launcher.wait_ready(url)
        print(f"moorage is ready: {url}/v1  (OpenAI-compatible; Ctrl-C stops everything)", flush=True)
        while not launcher.dead():
            time.sleep(0.5)
        print(f"moorage: {', '.join(launcher.dead())} exited unexpectedly; stopping", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("moorage: stopping", flush=True)
    except (RuntimeError, TimeoutError) as e:
        print(f"moorage: {e}", file=sys.stderr)
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        launcher.stop()
    print("moorage: stopped", flush=True)
    return code
