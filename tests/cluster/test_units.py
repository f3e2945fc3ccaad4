"""How the cluster test reads a rendered unit (pure parsing, no namespaces): what systemd would start."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.deploy import render
from tests.cluster.launch import HostFS
from tests.cluster.units import UnitError, read_env_file, service_spec

INVENTORY = """
[cluster]
prefix = "/srv/moorage"
api_keys = ["sk-a", "sk-b"]
[[hosts]]
name = "h1"
address = "10.9.0.1"
roles = {nats = 1, master = 1, gate = 1, router = 1, store = 1, prefill = 1}
[[hosts]]
name = "h2"
address = "10.9.0.2"
roles = {store = 1, prefill = 1, decode = 1}
"""


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("render")
    (out / "cluster.toml").write_text(INVENTORY)
    render(out / "cluster.toml", out / "out")
    return out / "out"


def test_template_unit_becomes_its_instance(rendered):
    fs = HostFS(rendered / "h2")
    spec = service_spec(rendered / "h2" / "systemd", "moorage-prefill@1.service", fs.local)
    assert spec.argv == ["/srv/moorage/.venv/bin/moorage", "serve", "prefill",
                         "--config", "/etc/moorage/prefill-1.toml"]
    assert spec.notify and spec.working_directory == "/var/lib/moorage"
    assert spec.env_files == ["/etc/moorage/env"]
    assert spec.environment["MOORAGE__BUS__USER"] == "moorage" and len(spec.environment["MOORAGE__BUS__PASSWORD"]) >= 24
    assert spec.environment["MOORAGE_KERNEL_CACHE"] == "/var/cache/moorage/kernels"
    assert (spec.role, spec.name) == ("prefill", "prefill-1")


def test_router_reads_both_env_files_and_nats_is_simple(rendered):
    fs = HostFS(rendered / "h1")
    router = service_spec(rendered / "h1" / "systemd", "moorage-router.service", fs.local)
    assert router.env_files == ["/etc/moorage/env", "/etc/moorage/router.env"]
    assert router.environment["MOORAGE__ROUTER__API_KEYS"] == '["sk-a", "sk-b"]'  # quotes inside stay
    assert router.name == "router"
    nats = service_spec(rendered / "h1" / "systemd", "moorage-nats.service", fs.local)
    assert not nats.notify and nats.argv[-2:] == ["-c", "/etc/moorage/nats.conf"] and nats.name == "nats"


def test_env_file_format(tmp_path):
    f = tmp_path / "env"
    f.write_text('# comment\n; also\n\nA=1\nB = "two words" \nC=\'x\'\nD=[\"k\"]\n')
    assert read_env_file(f) == {"A": "1", "B": "two words", "C": "x", "D": '["k"]'}
    f.write_text("not a line\n")
    with pytest.raises(UnitError, match="KEY=VALUE"):
        read_env_file(f)


def test_what_is_not_understood_is_refused(tmp_path):
    (tmp_path / "x@.service").write_text("[Service]\nExecStart=/bin/x %n\n")
    with pytest.raises(UnitError, match="%n"):
        service_spec(tmp_path, "x@1.service")
    (tmp_path / "y.service").write_text("[Service]\nExecStart=-/bin/y\n")
    with pytest.raises(UnitError, match="prefix"):
        service_spec(tmp_path, "y.service")
    (tmp_path / "z.service").write_text("[Service]\nExecStart=/bin/z\nEnvironmentFile=/nonexistent/env\n")
    with pytest.raises(UnitError, match="missing"):
        service_spec(tmp_path, "z.service")
    (tmp_path / "w.service").write_text("[Service]\nExecStart=/bin/w\nEnvironmentFile=-/nonexistent/env\n")
    assert service_spec(tmp_path, "w.service").environment == {}
