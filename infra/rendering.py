"""What `moorage deploy render` writes for one instance or one NATS server: real config objects (the
same classes every service loads), pointed at the cluster's addresses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from services.decode.config import DecodeConfig
from services.gate.config import GateConfig
from services.master.config import MasterConfig
from services.prefill.config import PrefillConfig
from services.router.config import RouterConfig
from services.store.config import StoreConfig
from shared.config import apply_dict

if TYPE_CHECKING:
    from infra.deploy import Host, Inventory

CONFIGS = {"master": MasterConfig, "store": StoreConfig, "gate": GateConfig, "prefill": PrefillConfig,
           "decode": DecodeConfig, "router": RouterConfig}
SINGLE = ("master", "gate")               # exactly one per cluster
PER_HOST = ("master", "gate", "router")   # at most one per host: a plain unit reading /etc/moorage/<role>.toml
UNIT_DIR = Path(__file__).resolve().parent / "systemd"


def unit_name(role: str, index: str) -> str:
    return f"moorage-{role}.service" if role in PER_HOST else f"moorage-{role}@{index}.service"


def config_file(role: str, index: str) -> str:
    return f"{role}.toml" if role in PER_HOST else f"{role}-{index}.toml"


def nats_urls(inv: "Inventory", host: "Host") -> str:
    """Every NATS server of the cluster, this host's own first."""
    servers = sorted(inv.hosts_with("nats"), key=lambda h: h is not host)
    return ",".join(f"nats://{h.address}:{inv.cluster.nats_port}" for h in servers)


def _mooncake(inv: "Inventory", host: "Host") -> dict:
    return {"hostname": host.address, "protocol": inv.cluster.protocol,
            "device_name": ",".join(host.rdma_devices), "metadata_server": inv.cluster.metadata_server}


def instance_config(role: str, index: str, inv: "Inventory", host: "Host", master: "Host", http_port: int):
    c = inv.cluster
    master_addr = f"{master.address}:{c.master_port}"
    data: dict = {"instance": f"{role}-{index}", "bus": {"url": nats_urls(inv, host)},
                  "http": {"host": host.address, "port": http_port},
                  "tracing": {"path": "/var/log/moorage/traces.jsonl"}}
    if role == "master":
        data["master"] = {"host": master.address, "rpc_port": c.master_port}
    elif role == "store":
        data["store"] = {**_mooncake(inv, host), "master_addr": master_addr, "segment_bytes": c.store_bytes,
                         **({"disk_path": f"/var/lib/moorage/disk/store-{index}", "disk_bytes": c.disk_bytes}
                            if c.disk_bytes else {})}
    elif role in ("prefill", "decode"):
        data["engine"] = {"model": c.model}
        data["transfer"] = _mooncake(inv, host)
        if role == "prefill":
            data["pool"] = {**_mooncake(inv, host), "enabled": True, "master_addr": master_addr}
    elif role == "router":
        data["http"] = {"port": -1}  # its /health and /metrics are on the API port
        data["router"] = {"host": host.address, "port": c.router_port, "model": c.model}
    cfg = apply_dict(CONFIGS[role](), data, "")
    return apply_dict(cfg, inv.config.get(role, {}), f"config.{role}.")


def nats_conf(inv: "Inventory", host: "Host", password: str) -> str:
    c, q = inv.cluster, json.dumps
    lines = [f"# moorage: NATS on {host.name}, rendered by `moorage deploy render`",
             f"listen: {q(f'{host.address}:{c.nats_port}')}", 'http: "127.0.0.1:8222"', "max_payload: 8388608",
             f"authorization {{ user: {q(c.nats_user)}, password: {q(password)} }}"]
    peers = [h for h in inv.hosts_with("nats") if h is not host]
    if peers:
        routes = ", ".join(q(f"nats-route://{c.nats_user}:{password}@{h.address}:{c.nats_cluster_port}")
                           for h in peers)
        lines += ["cluster {", '  name: "moorage"', f"  listen: {q(f'{host.address}:{c.nats_cluster_port}')}",
                  f"  authorization {{ user: {q(c.nats_user)}, password: {q(password)} }}",
                  f"  routes: [{routes}]", "}"]
    return "\n".join(lines) + "\n"
