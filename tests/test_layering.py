"""The import arrows: shared/ is the library every service imports, so it imports nothing from services/, bench/
or infra/ (the composition root: CLI, launcher, deploy), and no service imports another service. kernels/ sits
below shared/ (shared/ imports it): at run time it imports nothing from shared/, services/, bench/ or infra/;
an import under `if TYPE_CHECKING:` (for annotations: a layout is duck-typed) is allowed."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_at_run_time(tree: ast.AST):
    """ast.walk, leaving out the bodies of `if TYPE_CHECKING:` (their `else:` does run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def _imports(path: Path, run_time_only: bool = False) -> set[str]:
    return _imports_of(ast.parse(path.read_text(), str(path)), run_time_only)


def _imports_of(tree: ast.AST, run_time_only: bool = False) -> set[str]:
    out = set()
    for node in (_walk_at_run_time(tree) if run_time_only else ast.walk(tree)):
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


KERNELS = sorted((ROOT / "kernels").rglob("*.py"))  # whatever exists when the tests run (kernels/triton_*.py too)


def test_kernels_modules_are_all_checked():
    names = {p.relative_to(ROOT).as_posix() for p in KERNELS}
    assert {"kernels/__init__.py", "kernels/registry.py", "kernels/reference.py", "kernels/cpu_kv.py"} <= names


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: str(p.relative_to(ROOT)))
def test_kernels_import_nothing_above_them_at_run_time(path):
    bad = {m for m in _imports(path, run_time_only=True)
           if m.split(".")[0] in ("shared", "services", "bench", "infra")}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)} (outside `if TYPE_CHECKING:`)"


def test_only_type_checking_imports_are_left_out():
    """The kernels' check sees every run-time import: a function's, a try's, an `else:` of TYPE_CHECKING."""
    tree = ast.parse(
        "import typing\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from shared.kv_layout import KVLayout\n"
        "if typing.TYPE_CHECKING:\n"
        "    import services.decode\n"
        "else:\n"
        "    import shared.config\n"
        "def f():\n"
        "    from shared.engine import model\n"
        "try:\n"
        "    import infra.cli\n"
        "except ImportError:\n"
        "    pass\n"
        "if DEBUG:\n"
        "    import bench.engine\n")
    assert _imports_of(tree, run_time_only=True) == {"typing", "shared.config", "shared.engine", "infra.cli",
                                                     "bench.engine"}
    assert {"shared.kv_layout", "services.decode"} <= _imports_of(tree)


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: Path) -> set[str]:
    """Every module an import may name: `from a.b import c` names a.b and a.b.c (c may be a module)."""
    out = _imports(path)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_shared_holds_only_what_the_services_import():
    """shared/ is the services' library: each of its modules is imported by a service, or by a shared module a
    service imports. Launcher, CLI and trace tooling live in infra/."""
    files = {_module_of(p): p for p in (ROOT / "shared").rglob("*.py")}
    todo = [p for p in (ROOT / "services").rglob("*.py")]
    reached: set[str] = set()
    while todo:
        for name in _imported_names(todo.pop()):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ too
                m = ".".join(parts[:i])
                if m in files and m not in reached:
                    reached.add(m)
                    todo.append(files[m])
    assert not set(files) - reached, f"no service imports {sorted(set(files) - reached)}: move them to infra/"
