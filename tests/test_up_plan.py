"""What `moorage up` starts for a topology (pure: no process is started here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.up import STOP_WAVES, UpConfig, plan
from shared.config import ConfigError, load_config


def topology(*overrides: str) -> dict[str, tuple[str, object]]:
    cfg = load_config(UpConfig, overrides=list(overrides), env={})
    return {inst: (svc, conf) for inst, svc, conf in plan(cfg, "nats://127.0.0.1:1", Path("/tmp/x"))}


def test_default_is_one_group_with_a_two_store_pool():
    t = topology()
    assert list(t) == ["master-0", "store-0", "store-1", "gate-0", "decode-0", "prefill-0", "router-0"]
    master = t["master-0"][1].master
    assert t["prefill-0"][1].pool.enabled and t["prefill-0"][1].pool.master_addr.endswith(f":{master.rpc_port}")
    assert all(c.bus.url == "nats://127.0.0.1:1" for _, c in t.values())


def test_every_role_stops_in_a_wave_that_follows_start_order_backwards():
    """The launcher stops in STOP_WAVES' waves, in reverse start order: every role has one, and the waves
    never go backwards along that order (a later wave would stop a role that an earlier one had started
    after, e.g. the stores before the prefill that saves to them)."""
    t = topology("up.groups=2", "up.stores=2", "up.prefills=2", "up.pool_mode=split")
    waves = [STOP_WAVES[svc] for svc, _ in reversed(t.values())]
    assert waves == sorted(waves) and waves[0] == STOP_WAVES["router"] < STOP_WAVES["store"] < STOP_WAVES["master"]
    assert STOP_WAVES["prefill"] < STOP_WAVES["store"]  # prefill's last pool saves reach the stores


def test_shared_pool_across_groups():
    t = topology("up.groups=3", "up.stores=1", "up.pool_mode=shared")
    assert [i for i in t if i.startswith("master")] == ["master-0"]
    addrs = {t[f"prefill-{g}"][1].pool.master_addr for g in range(3)}
    stores = {t[f"store-{g}"][1].store.master_addr for g in range(3)}
    assert len(addrs) == 1 and addrs == stores
    assert [i for i in t if i.startswith("decode")] == ["decode-0", "decode-1", "decode-2"]


def test_split_pools_keep_each_group_to_its_own():
    t = topology("up.groups=2", "up.stores=2", "up.prefills=2", "up.pool_mode=split")
    assert [i for i in t if i.startswith("master")] == ["master-0", "master-1"]
    g0 = {t[i][1].pool.master_addr for i in ("prefill-0", "prefill-1")} | {t[i][1].store.master_addr for i in ("store-0", "store-1")}
    g1 = {t[i][1].pool.master_addr for i in ("prefill-2", "prefill-3")} | {t[i][1].store.master_addr for i in ("store-2", "store-3")}
    assert len(g0) == 1 and len(g1) == 1 and g0 != g1


def test_no_pool():
    t = topology("up.pool=false", "up.groups=2")
    assert not any(i.startswith(("master", "store")) for i in t)
    assert not t["prefill-1"][1].pool.enabled


def test_bad_topology_is_a_config_error():
    with pytest.raises(ConfigError, match="pool_mode"):
        topology("up.pool_mode=mirrored")
    with pytest.raises(ConfigError):
        topology("up.groups=0")


def test_every_service_gets_the_run_credential():
    from infra.natsd import NatsCredential

    cfg = load_config(UpConfig, overrides=[], env={})
    cred = NatsCredential.generate()
    with_cred = plan(cfg, "nats://127.0.0.1:1", Path("/tmp/x"), credential=cred)
    assert all((c.bus.user, c.bus.password) == (cred.user, cred.password) for _, _, c in with_cred)
    assert all(c.bus.url == "nats://127.0.0.1:1" for _, _, c in with_cred)  # the credential is not in the URL
    assert all(c.bus.user == "" for _, _, c in plan(cfg, "nats://127.0.0.1:1", Path("/tmp/x")))


def test_restart_settings_are_validated():
    assert load_config(UpConfig, overrides=["up.restart=no"], env={}).up.restart == "no"
    for bad in ("up.restart=always", "up.restart_backoff_s=0", "up.restart_backoff_max_s=0.1"):
        with pytest.raises(ConfigError, match="restart"):
            load_config(UpConfig, overrides=[bad], env={})


def test_the_router_serves_the_launchers_socket_when_given_one():
    cfg = load_config(UpConfig, overrides=["up.port=0"], env={})
    given = {i: c for i, _, c in plan(cfg, "nats://127.0.0.1:1", Path("/tmp/x"), router_fd=7)}
    assert given["router-0"].router.listen_fd == 7 and given["router-0"].router.port == 0
    alone = {i: c for i, _, c in plan(cfg, "nats://127.0.0.1:1", Path("/tmp/x"))}
    assert alone["router-0"].router.listen_fd == -1  # compose / systemd: the router binds host:port itself
