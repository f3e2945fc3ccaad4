"""Shared fixtures: each model is loaded once per test session (SmolLM2 takes seconds to dequantize)."""

from __future__ import annotations

import pytest

from tests.natsbus import nats_url as _nats_url

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
