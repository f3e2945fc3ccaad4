"""The README documents every configuration key, generated from the code so it cannot drift."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.decode.config import DecodeConfig
from services.gate.config import GateConfig
from services.master.config import MasterConfig
from services.store.config import StoreConfig
from services.prefill.config import PrefillConfig
from services.router.config import RouterConfig
from shared.config import describe
from infra.configdoc import render
from infra.up import UpSettings

README = Path(__file__).resolve().parent.parent / "README.md"


def test_config_reference_is_current():
    text = README.read_text()
    assert render(text) == text, "run: python -m infra.configdoc --write README.md"


@pytest.mark.parametrize("cls", [RouterConfig, GateConfig, PrefillConfig, DecodeConfig, MasterConfig, StoreConfig,
                                 UpSettings])
def test_every_key_is_documented_with_a_meaning(cls):
    text = README.read_text()
    prefix = "up." if cls is UpSettings else ""
    for key, _, _ in describe(cls):
        if "." not in key and cls is not UpSettings:
            assert f"`{key}`" in text, key  # top-level keys: instance, load_interval_s
            continue
        row = re.search(rf"^\| `{re.escape(prefix + key)}` \| .+? \| (.*) \|$", text, re.M)
        assert row, f"{prefix + key} missing from the README"
        assert row.group(1).strip(), f"{prefix + key} has no description"
