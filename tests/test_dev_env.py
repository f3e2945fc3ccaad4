"""infra/dev-env.sh picks torch per flavour and stops, with the reason, where the flavour's torch is missing
(rather than installing the project over a CPU torch that would silently run a GPU deployment on CPU)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _dev_env(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "infra/dev-env.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MOORAGE_VENV": str(tmp_path / "venv"), **env})


def test_unknown_flavour_is_refused(tmp_path):
    r = _dev_env(tmp_path, MOORAGE_FLAVOR="tpu")
    assert r.returncode == 2 and "expected cpu, cuda or rocm" in r.stderr
    assert not (tmp_path / "venv").exists()


def test_rocm_without_a_rocm_torch_stops_before_installing(tmp_path):
    """No ROCm PyTorch base image (this host's python3 has no ROCm torch) and no index: a clear stop, and
    nothing installed into the new venv."""
    r = _dev_env(tmp_path, MOORAGE_FLAVOR="rocm")
    if r.returncode == 0:
        pytest.fail(f"rocm flavour installed without a ROCm torch: {r.stdout}")
    assert r.returncode == 1 and "no ROCm torch in the base image" in r.stderr, r.stderr
    site = list((tmp_path / "venv").glob("lib/python*/site-packages"))
    assert site and not any((s / "moorage.egg-link").exists() or list(s.glob("__editable__*moorage*")) for s in site)
