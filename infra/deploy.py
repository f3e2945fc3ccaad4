"""`moorage deploy render --inventory cluster.toml --out DIR`: one inventory of hosts in, for each host
every instance's TOML, the systemd units to enable, the NATS config with its cluster routes, and the
env file with the secrets out. A user with twelve servers writes one inventory, not sixty config files.

    [cluster]                      # every key optional
    prefix = "/opt/moorage"        # where moorage is installed on every host
    protocol = "tcp"               # transfer engine and pool: tcp | rdma
    model = "smollm2-135m"

    [[hosts]]
    name = "node1"
    address = "10.0.0.1"           # what the other hosts reach this one on
    rdma_devices = ["mlx5_0"]
    roles = {nats = 1, master = 1, gate = 1, router = 1, store = 1, prefill = 1}

    [config.prefill]               # any keys of that role's config, for every instance of the role
    engine = {kv_memory = "40%"}

Instances are numbered across the cluster (prefill-0 on node1, prefill-1 on node2), so each is one
`moorage-<role>@<n>.service` with `/etc/moorage/<role>-<n>.toml`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path

from infra.rendering import CONFIGS, PER_HOST, SINGLE, UNIT_DIR, config_file, instance_config, nats_conf, unit_name
from infra.tomlgen import to_toml
from shared.config import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROLES = ("nats", "master", "store", "gate", "prefill", "decode", "router")


@dataclass
class Cluster:
    prefix: str = "/opt/moorage"      # install directory on every host (the units' ExecStart)
    etc: str = "/etc/moorage"         # where configs and the env file go on every host
    protocol: str = "tcp"             # transfer engine and pool: tcp | rdma
    metadata_server: str = "P2PHANDSHAKE"  # Mooncake metadata: P2PHANDSHAKE or an etcd/http URL
    model: str = "smollm2-135m"
    nats_port: int = 4222
    nats_cluster_port: int = 6222
    master_port: int = 50051
    router_port: int = 8000
    http_port: int = 9100             # first /health + /metrics port on a host; one per instance from there
    store_bytes: int = 1 << 30        # DRAM each store contributes
    disk_bytes: int = 16 << 30        # each store's disk tier under the unit's StateDirectory (/var/lib/moorage/disk/<store>); 0: none
    api_keys: list[str] = field(default_factory=list)  # router keys; empty: one is generated
    nats_user: str = "moorage"

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"cluster.protocol must be tcp or rdma, got {self.protocol!r}")
        if self.disk_bytes < 0:
            raise ConfigError(f"cluster.disk_bytes must be >= 0 (0: no disk tier), got {self.disk_bytes}")


@dataclass
class Host:
    name: str
    address: str
    roles: dict[str, int] = field(default_factory=dict)
    rdma_devices: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        bad = sorted(set(self.roles) - set(ROLES))
        if bad:
            raise ConfigError(f"host {self.name}: unknown roles {bad} (known: {', '.join(ROLES)})")
        if any(not isinstance(n, int) or n < 0 for n in self.roles.values()):
            raise ConfigError(f"host {self.name}: role counts must be integers >= 0")


@dataclass
class Inventory:
    cluster: Cluster
    hosts: list[Host]
    config: dict[str, dict]  # role -> keys for every instance of it

    def hosts_with(self, role: str) -> list[Host]:
        return [h for h in self.hosts if h.roles.get(role, 0) > 0]


def _typed(cls, data: dict, where: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown} (known: {', '.join(sorted(known))})")
    try:
        return cls(**data)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_inventory(path: str | Path) -> Inventory:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read inventory {path}: {e}") from None
    unknown = sorted(set(data) - {"cluster", "hosts", "config"})
    if unknown:
        raise ConfigError(f"inventory: unknown sections {unknown} (known: cluster, hosts, config)")
    inv = Inventory(_typed(Cluster, data.get("cluster", {}), "cluster"),
                    [_typed(Host, h, f"hosts[{i}]") for i, h in enumerate(data.get("hosts", []))],
                    data.get("config", {}))
    names = [h.name for h in inv.hosts]
    if not inv.hosts or len(set(names)) != len(names):
        raise ConfigError("inventory: needs at least one host, with unique names")
    for role in SINGLE:
        count = sum(h.roles.get(role, 0) for h in inv.hosts)
        if count != 1:
            raise ConfigError(f"inventory: exactly one {role} instance per cluster, found {count}")
    for role in ("nats", "prefill", "decode", "router"):
        if not inv.hosts_with(role):
            raise ConfigError(f"inventory: no host runs {role}")
    for role in ("nats", *PER_HOST):
        if any(h.roles.get(role, 0) > 1 for h in inv.hosts):
            raise ConfigError(f"inventory: at most one {role} per host")
    bad = sorted(set(inv.config) - set(CONFIGS))
    if bad:
        raise ConfigError(f"inventory: [config.*] for unknown roles {bad}")
    return inv


@dataclass
class HostPlan:
    host: Host
    instances: list[tuple[str, str, object]] = field(default_factory=list)  # (role, index, config)
    units: list[str] = field(default_factory=list)


def plan(inv: Inventory, nats_password: str, api_keys: list[str]) -> list[HostPlan]:
    counters = {role: 0 for role in ROLES}
    master = inv.hosts_with("master")[0]
    out = []
    for host in inv.hosts:
        hp, port = HostPlan(host), inv.cluster.http_port
        if host.roles.get("nats"):
            hp.units.append("moorage-nats.service")
        for role in ROLES[1:]:
            for _ in range(host.roles.get(role, 0)):
                index = str(counters[role])
                counters[role] += 1
                cfg = instance_config(role, index, inv, host, master, port)
                port += 1
                hp.instances.append((role, index, cfg))
                hp.units.append(unit_name(role, index))
        if host.roles.get("store"):
            hp.units.insert(0, "moorage-hugepages.service")
        hp.units.append("moorage.target")
        out.append(hp)
    return out


def _secret(path: Path, text: str) -> None:
    """Written readable by its owner only, from the first byte."""
    path.unlink(missing_ok=True)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(text)


def render(inventory: str | Path, out: str | Path) -> list[HostPlan]:
    """Write DIR/<host>/{etc/moorage/*.toml, etc/moorage/env, etc/moorage/nats.conf, systemd/*, units}."""
    inv = load_inventory(inventory)
    nats_password = secrets.token_urlsafe(24)
    api_keys = inv.cluster.api_keys or [f"sk-moorage-{secrets.token_urlsafe(24)}"]
    plans = plan(inv, nats_password, api_keys)
    prefix = inv.cluster.prefix.rstrip("/")
    for hp in plans:
        root = Path(out) / hp.host.name
        etc = root / inv.cluster.etc.lstrip("/")
        etc.mkdir(parents=True, exist_ok=True)
        (root / "systemd").mkdir(exist_ok=True)
        for role, index, cfg in hp.instances:
            (etc / config_file(role, index)).write_text(to_toml(cfg))
        hugepages = sum(c.store.segment_bytes for r, _, c in hp.instances if r == "store")
        env = [f"MOORAGE__BUS__USER={inv.cluster.nats_user}", f"MOORAGE__BUS__PASSWORD={nats_password}",
               f"MOORAGE_HUGEPAGES_BYTES={hugepages}"]
        _secret(etc / "env", "\n".join(env) + "\n")
        if any(r == "router" for r, _, _ in hp.instances):
            _secret(etc / "router.env", f"MOORAGE__ROUTER__API_KEYS={json.dumps(api_keys)}\n")
        if hp.host.roles.get("nats"):
            _secret(etc / "nats.conf", nats_conf(inv, hp.host, nats_password))
        for unit in {u.split("@")[0] + ("@.service" if "@" in u else "") for u in hp.units}:
            text = (UNIT_DIR / unit).read_text().replace("/opt/moorage", prefix).replace("/etc/moorage", inv.cluster.etc)
            (root / "systemd" / unit).write_text(text)
        (root / "units").write_text("\n".join(hp.units) + "\n")
    return plans


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="moorage deploy", description="render a cluster's configs and systemd units")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="one inventory in; per host: configs, units to enable, NATS routes, env file")
    r.add_argument("--inventory", required=True, help="cluster.toml (see `moorage deploy render --help`)")
    r.add_argument("--out", required=True, help="output directory (one subdirectory per host)")
    args = p.parse_args(argv)
    try:
        plans = render(args.inventory, args.out)
    except ConfigError as e:
        print(f"moorage deploy: error: {e}", file=sys.stderr)
        return 2
    for hp in plans:
        print(f"{hp.host.name} ({hp.host.address}): {' '.join(hp.units)}")
    print(f"wrote {args.out}/<host>/: copy etc/moorage/ to /etc/moorage/, systemd/ to /etc/systemd/system/, then "
          f"`systemctl enable --now $(cat units)`")
    return 0
