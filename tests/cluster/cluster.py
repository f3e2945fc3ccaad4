"""A moorage cluster on K emulated hosts: one inventory rendered with `moorage deploy render`, each host's units
started in its `units` order the way systemd would (see launch.py), stopped the way stopping moorage.target
would on close.

The inventory is the one a user would write for three servers: the bus, the pool's master, the gate and the
router on h1; a store on every host; prefills on h1 and h2; the decode on h3. Only the prefix (this checkout,
so `<prefix>/.venv/bin/moorage` is the real one), the tiny model and small memory sizes are test choices.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from infra.natsd import nats_server_binary
from infra.rendering import CONFIGS
from shared.config import load_config
from tests.cluster import netns
from tests.cluster.launch import HostFS, Service, ServiceFailed, start
from tests.cluster.units import ServiceSpec, service_spec

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-cluster-test"
ROLES = {
    "h1": {"nats": 1, "master": 1, "gate": 1, "router": 1, "store": 1, "prefill": 1},
    "h2": {"store": 1, "prefill": 1},
    "h3": {"store": 1, "decode": 1},
}
NOT_STARTED = {"moorage-hugepages.service", "moorage.target"}  # global host state / a grouping target
READY_TIMEOUT_S = 120.0
STOP_TIERS = (("router", "gate", "prefill", "decode"), ("store",), ("master",), ("nats",))


def inventory(top: netns.Topology, prefix: Path = ROOT) -> str:
    hosts = "".join(
        f'\n[[hosts]]\nname = "{h.name}"\naddress = "{h.address}"\n'
        f"roles = {{{', '.join(f'{r} = {n}' for r, n in ROLES[h.name].items())}}}\n" for h in top.hosts)
    return f"""[cluster]
prefix = "{prefix}"
protocol = "tcp"
model = "tiny"
store_bytes = 100663296          # 96 MiB of DRAM per store
api_keys = ["{API_KEY}"]
{hosts}
[config.prefill]
engine = {{num_blocks = 512}}    # 8K tokens of device KV (tiny: 4 KiB per token)

[config.decode]
engine = {{num_blocks = 512}}
"""


@dataclass
class Cluster:
    top: netns.Topology
    out: Path                     # what `moorage deploy render` wrote: out/<host>/{etc/moorage, systemd, units}
    run_dir: Path                 # notify sockets and service logs
    services: dict[str, Service] = field(default_factory=dict)  # "prefill-0" -> its running service
    hosts: dict[str, str] = field(default_factory=dict)          # "prefill-0" -> "h1"
    configs: dict[str, object] = field(default_factory=dict)     # "prefill-0" -> its loaded config
    ready_s: dict[str, float] = field(default_factory=dict)

    def fs(self, host: str) -> HostFS:
        return HostFS(self.out / host)

    def units(self, host: str) -> list[str]:
        return [u for u in (self.out / host / "units").read_text().split() if u not in NOT_STARTED]

    def spec(self, host: str, unit: str) -> ServiceSpec:
        return service_spec(self.out / host / "systemd", unit, self.fs(host).local)

    def _load(self, host: str, spec: ServiceSpec) -> None:
        """The config the service reads (its --config file and env), to know its ports."""
        if spec.role not in CONFIGS:
            return
        config = spec.argv[spec.argv.index("--config") + 1]
        self.configs[spec.name] = load_config(CONFIGS[spec.role], self.fs(host).local(config), env=spec.environment)

    def start_host(self, host: str, units: list[str] | None = None) -> None:
        """Start `units` (default: all of the host's) one after the other, each once the previous is ready."""
        h = self.top.host(host)
        for unit in self.units(host) if units is None else units:
            spec = self.spec(host, unit)
            self._load(host, spec)
            svc = start(spec, h, self.fs(host), self.run_dir, replace={"/usr/bin/nats-server": nats_server_binary()})
            self.services[spec.name], self.hosts[spec.name] = svc, host
            if spec.role == "nats":
                self.ready_s[spec.name] = self._wait_nats(svc)
            else:
                self.ready_s[spec.name] = svc.wait_ready(READY_TIMEOUT_S)

    def _wait_nats(self, svc: Service) -> float:
        """moorage-nats.service is Type=simple: started is enough for systemd; we wait for its port (the
        other units' Restart=on-failure would otherwise ride out a late bus)."""
        t0 = time.monotonic()
        conf = self.fs(svc.host.name).local(svc.spec.argv[svc.spec.argv.index("-c") + 1]).read_text()
        address, _, port = re.search(r'^listen: "([^"]+)"', conf, re.M).group(1).rpartition(":")
        with netns.in_netns(self.top.switch) as ex:
            def connect() -> None:
                deadline = t0 + 20
                while True:
                    try:
                        socket.create_connection((address, int(port)), timeout=1).close()
                        return
                    except OSError:
                        if svc.proc.poll() is not None or time.monotonic() > deadline:
                            raise ServiceFailed(f"nats on {svc.host.name} is not listening\n{svc.log_tail()}")
                        time.sleep(0.05)
            ex.submit(connect).result()
        return time.monotonic() - t0

    def start(self) -> None:
        """Every host in its own units order, side by side, once the bus and the pool's master (the first
        units of the host that runs them) are ready: the other hosts' units need both from their first
        moment, and this runner has no Restart=on-failure to ride out their absence."""
        first = self.top.hosts[0].name
        units = self.units(first)
        cut = units.index("moorage-master.service") + 1
        self.start_host(first, units[:cut])
        jobs = [(first, units[cut:])] + [(h.name, None) for h in self.top.hosts[1:]]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
            for f in [ex.submit(self.start_host, host, todo) for host, todo in jobs]:
                f.result()

    def http_url(self, name: str) -> str:
        """Where a service's /health and /metrics are (the router's: on its API port)."""
        cfg = self.configs[name]
        if name == "router":
            return f"http://{cfg.router.host}:{cfg.router.port}"
        return f"http://{cfg.http.host}:{cfg.http.port}"

    def close(self) -> dict[str, int | None]:
        """Stop every service, as stopping moorage.target would: the units' After= order reversed, side by
        side within a tier (engines, router and gate; then the stores; then the master; the bus last)."""
        codes: dict[str, int | None] = {}

        def stop(name: str) -> None:
            with contextlib.suppress(Exception):
                codes[name] = self.services[name].stop()

        for tier in STOP_TIERS:
            names = [n for n, svc in self.services.items() if svc.spec.role in tier]
            if names:
                with concurrent.futures.ThreadPoolExecutor(len(names)) as ex:
                    list(ex.map(stop, names))
        for name in self.services:  # anything of a role no tier names
            if name not in codes:
                stop(name)
        return codes


def health_of_all(cluster: Cluster, client: httpx.Client) -> dict[str, httpx.Response]:
    """GET /health of every moorage service, from the operator's box (the switch namespace)."""
    return {name: client.get(cluster.http_url(name) + "/health") for name in cluster.services if name != "nats"}


def wait_healthy(cluster: Cluster, client: httpx.Client, timeout: float = 30.0) -> dict[str, httpx.Response]:
    """Until every /health says 200. READY=1 means a service started; its /health also needs what it serves
    with (a gate its decodes' reports, a router its instances'), which arrives on the bus within seconds."""
    deadline = time.monotonic() + timeout
    while True:
        health = health_of_all(cluster, client)
        if all(r.status_code == 200 for r in health.values()):
            return health
        if time.monotonic() > deadline:
            raise AssertionError("not healthy: " + "; ".join(f"{n}: {r.status_code} {r.text}" for n, r in health.items()
                                                            if r.status_code != 200))
        time.sleep(0.2)
