"""Which sockets `moorage up` listens on, and where: loopback wherever the bind address is ours to set, and a
record (not a hiding) of what Mooncake does.

Mooncake's Transfer Engine (0.3.x up to its main branch, read in its source) binds its P2P handshake
listener and its TCP transport listener to the wildcard address (INADDR_ANY / `::` dual stack) on a port
in 15000-17000 (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT); `local_hostname` and MC_TCP_BIND_ADDRESS only set the
address it advertises. So every store, prefill and decode process has such listeners. The table is
printed (run with -s) and kept as listeners.txt in the run directory."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from infra.listeners import comm, descendants, listeners
from infra.up import NATS_CHILD, UpConfig, launched
from shared.config import load_config

MOONCAKE_USERS = ("store", "prefill", "decode")  # processes that run a Mooncake Transfer Engine
MOONCAKE_PORTS = range(15000, 17001)             # its default MC_MIN_RPC_PORT..MC_MAX_RPC_PORT


@pytest.fixture(scope="module")
def sockets(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("binds")
    cfg = load_config(UpConfig, overrides=[
        "up.model=tiny", "up.port=0", f"up.run_dir={run_dir}", "up.ready_timeout_s=180",
        "up.kv_memory=256MiB", "up.store_bytes=67108864"], env={})
    with launched(cfg) as (launcher, _):
        procs = dict(launcher.supervisor.pids())
        for name, pid in list(procs.items()):
            for child in descendants(pid):  # mooncake_master under the master service
                procs[f"{name}/{comm(child)}"] = child
        found = listeners(procs)
        (run_dir / "listeners.txt").write_text("\n".join(map(str, found)) + "\n")
        print("\n" + "\n".join(map(str, found)))
        yield launcher, found


def role(name: str) -> str:
    return name.split("/")[0].rsplit("-", 1)[0]


def test_everything_we_bind_is_loopback(sockets):
    launcher, found = sockets
    ours = [s for s in found if role(s.name) not in MOONCAKE_USERS]
    assert {role(s.name) for s in ours} >= {NATS_CHILD.rsplit("-", 1)[0], "router", "master"}
    assert [str(s) for s in ours if not s.loopback] == []
    router = [s for s in ours if role(s.name) == "router"]
    assert any(s.port == urlsplit(launcher.router_url).port and s.address == "127.0.0.1" for s in router)
    nats = [s for s in ours if s.name == NATS_CHILD]
    assert [s.address for s in nats] == ["127.0.0.1"]
    master = [s for s in ours if s.name.endswith("/mooncake_master")]
    assert len(master) >= 2 and all(s.address == "127.0.0.1" for s in master)  # --rpc_address, --metrics_host


def test_mooncake_listeners_are_recorded_as_they_are(sockets):
    """Mooncake binds the wildcard address; if this fails because it no longer does, update the README's
    security section (and bind it to the configured hostname)."""
    _, found = sockets
    for name in ("store-0", "store-1", "decode-0", "prefill-0"):
        theirs = [s for s in found if s.name == name]
        wild = [s for s in theirs if s.wildcard]
        assert wild, f"{name}: no wildcard listener any more: {theirs}"
        # every listener of an engine process that is not loopback is Mooncake's, in its port range
        assert all(s.port in MOONCAKE_PORTS for s in theirs if not s.loopback), theirs
    # prefill runs two engines (KV handoff + pool client), so two handshake and two transport listeners
    assert len([s for s in found if s.name == "prefill-0" and s.wildcard]) == 4
