"""Shared fixtures: each model is loaded once per test session (SmolLM2 takes seconds to dequantize)."""

from __future__ import annotations

import os

import pytest

from tests.natsbus import nats_url as _nats_url

# Triton kernels run under Triton's interpreter in `make test` (tests/test_triton_kernels.py); it must be on
# before any module defines a kernel, and collecting tests/gpu imports kernels/triton_*.py before that file.
# `make test-gpu` (MOORAGE_GPU_TESTS=1) compiles them for the device instead.
if os.environ.get("MOORAGE_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Models are imported lazily: service tests that never touch torch start in milliseconds.


@pytest.fixture(scope="session")
def tiny():
    from shared.engine.models import load_model

    return load_model("tiny")


@pytest.fixture(scope="session")
def smollm2():
    from shared.engine.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture
def model(request):
    """Indirect parametrization: `@pytest.mark.parametrize("model", ["tiny", "smollm2"], indirect=True)`."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def nats_url():
    """A real NATS for this module: NATS_URL, else testcontainers, else the nats-server binary."""
    with _nats_url() as url:
        yield url


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run only under MOORAGE_GPU_TESTS=1 (`make test-gpu`, on a CUDA machine); anywhere
    else they are deselected, so `make test` neither runs nor counts them (not skipped either)."""
    if os.environ.get("MOORAGE_GPU_TESTS") == "1":
        keep = [i for i in items if i.get_closest_marker("gpu")]
    else:
        keep = [i for i in items if not i.get_closest_marker("gpu")]
    kept = {id(i) for i in keep}
    dropped = [i for i in items if id(i) not in kept]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
