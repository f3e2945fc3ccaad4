"""The import arrows: shared/ is the library every service imports, so it imports nothing from services/, bench/
or infra/ (the composition root: CLI, launcher, deploy), and no service imports another service."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args \
                and isinstance(node.args[0], (ast.Constant, ast.JoinedStr)):
            first = node.args[0]
            text = first.value if isinstance(first, ast.Constant) else "".join(
                v.value for v in first.values if isinstance(v, ast.Constant))
            out.add(str(text))
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "shared").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_shared_imports_nothing_above_it(path):
    bad = {m for m in _imports(path) if m.split(".")[0] in ("services", "bench", "infra")}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", sorted((ROOT / "services").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_service_imports_only_itself_and_shared(path):
    own = path.relative_to(ROOT / "services").parts[0]
    bad = {m for m in _imports(path)
           if m.split(".")[0] in ("bench", "infra") or (m.startswith("services.") and m.split(".")[1] != own)}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
