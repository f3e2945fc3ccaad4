"""The device check (`make test-gpu`): every test module here sets `pytestmark = pytest.mark.gpu`, so it runs only with MOORAGE_GPU_TESTS=1 on
a CUDA machine. Each records its figures with the `report` fixture; the session ends with one line per check
(PASS/FAIL, figures), and MOORAGE_GPU_OUT=<dir> gets them in gpu-checks.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

_FIGURES: dict[str, dict] = {}
_OUTCOMES: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _cuda_only():
    import torch

    if not torch.cuda.is_available():
        pytest.fail("MOORAGE_GPU_TESTS=1 but torch sees no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 identity checks need true fp32 matmuls
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture
def report(request):
    """report(key=value, ...): figures of this check, printed in the summary line and saved as JSON."""
    figures = _FIGURES.setdefault(request.node.nodeid, {})
    return figures.update


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call" or (rep.when == "setup" and rep.failed):
        _OUTCOMES[item.nodeid] = rep.outcome.upper()


def pytest_terminal_summary(terminalreporter):
    if not _OUTCOMES:
        return
    terminalreporter.section("device checks")
    for nodeid, outcome in _OUTCOMES.items():
        figures = " ".join(f"{k}={v}" for k, v in _FIGURES.get(nodeid, {}).items())
        terminalreporter.write_line(f"GPU-CHECK {outcome:6} {nodeid.split('::', 1)[-1]}  {figures}")
    out = os.environ.get("MOORAGE_GPU_OUT")
    if out:
        import torch

        path = Path(out) / "gpu-checks.json"  # several pytest runs add to one file
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = json.loads(path.read_text()) if path.exists() else {
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "checks": []}
        doc["checks"] += [{"check": n, "outcome": o, **_FIGURES.get(n, {})} for n, o in _OUTCOMES.items()]
        path.write_text(json.dumps(doc, indent=1, default=str))
