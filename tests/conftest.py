"""Shared fixtures: each model is loaded once per test session (SmolLM2 takes seconds to dequantize)."""

from __future__ import annotations

import pytest

from shared.engine.models import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture
def model(request) -> LoadedModel:
    """Indirect parametrization: `@pytest.mark.parametrize("model", ["tiny", "smollm2"], indirect=True)`."""
    return request.getfixturevalue(request.param)
