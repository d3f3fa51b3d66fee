"""The package's layout: the face over six wings, imports at load running one way between the
wings, and no import circle among the package's modules.

"At load" is what scripts/module_table.py counts for the contributing page's table: a module's
top-level imports, those under ``if TYPE_CHECKING:`` left out. Imports inside functions (the
crossings into the torch layer) are tests/plugin/test_process.py's concern.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The wings, each importing at load only the wings before it. The face (plugin.py,
# __init__.py, __main__.py, hookspecs.py, warning_types.py) may import any wing; a wing imports
# from the face only its leaf of warnings.
WINGS = ("config", "devices", "verdict", "reference", "report", "ranks")
FACE_LEAVES = frozenset({"warning_types"})


@pytest.fixture(scope="module")
def module_table() -> ModuleType:
    scripts = str(ROOT / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    path = ROOT / "scripts" / "module_table.py"
    spec = importlib.util.spec_from_file_location("_layout_module_table", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def imports_at_load(module_table: ModuleType, package: str) -> dict[str, set[str]]:
    """Each module's package modules imported at load (a submodule's packages included)."""
    return {name: internal for name, (_, internal) in module_table.loads_heavy(package).items()}


def circles(imports: Mapping[str, set[str]]) -> list[list[str]]:
    """Import circles, each as the path that closes it (a, b, a)."""
    found: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(path: list[str]) -> None:
        state[path[-1]] = "open"
        for other in sorted(imports.get(path[-1], ())):
            if state.get(other) == "open":
                found.append([*path[path.index(other) :], other])
            elif other not in state:
                visit([*path, other])
        state[path[-1]] = "done"

    for name in sorted(imports):
        if name not in state:
            visit([name])
    return found


def _wing(name: str, wings: Sequence[str]) -> str:
    """The wing of a module or wing package, "" for the face and the package itself."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in wings else ""


def out_of_order(imports: Mapping[str, set[str]], wings: Sequence[str]) -> list[str]:
    """Imports at load from a wing to a later wing, or to the face beyond its leaves."""
    wrong = []
    for name, targets in sorted(imports.items()):
        here = _wing(name, wings)
        if not here:
            continue  # the face imports any wing
        for target in sorted(targets):
            there = _wing(target, wings)
            if there and wings.index(there) > wings.index(here):
                wrong.append(f"{name} imports {target}, of the later wing {there}")
            elif not there and "." in target and target.split(".")[1] not in FACE_LEAVES:
                wrong.append(f"{name} imports {target}, of the face")
    return wrong


def test_no_import_circle_among_the_package_modules(module_table: ModuleType) -> None:
    assert circles(imports_at_load(module_table, "pytest_gradref")) == []


def test_a_wing_imports_only_the_wings_before_it(module_table: ModuleType) -> None:
    assert out_of_order(imports_at_load(module_table, "pytest_gradref"), WINGS) == []


def test_the_wings_are_the_subpackages_and_their_docstrings_alone() -> None:
    # A wing's __init__ says what it holds and what it may import, and imports nothing, so
    # that importing one module of a wing loads none of its others.
    package = ROOT / "pytest_gradref"
    found = {path.parent.name for path in package.glob("*/__init__.py")}
    assert found == set(WINGS)
    for wing in WINGS:
        tree = ast.parse((package / wing / "__init__.py").read_text(encoding="utf-8"))
        assert ast.get_docstring(tree), wing
        assert len(tree.body) == 1, f"{wing}/__init__.py holds more than its docstring"


def test_the_module_table_orders_the_wings_as_tested(module_table: ModuleType) -> None:
    assert module_table.WINGS["pytest_gradref"] == WINGS


def test_the_checks_catch_a_circle_and_a_wing_out_of_order(
    module_table: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "pkg"
    for wing in ("low", "high"):
        (package / wing).mkdir(parents=True)
        (package / wing / "__init__.py").write_text(f'"""The {wing} wing."""\n')
    (package / "__init__.py").write_text('"""The package."""\n')
    (package / "plugin.py").write_text('"""The face."""\nfrom pkg.high import b\n')
    (package / "low" / "a.py").write_text('"""A."""\nfrom pkg.high.b import x\n')
    (package / "high" / "b.py").write_text('"""B."""\nfrom pkg.low import a\nx = 1\n')
    (package / "high" / "c.py").write_text(
        '"""C: under TYPE_CHECKING, no circle."""\nfrom typing import TYPE_CHECKING\n\n'
        "if TYPE_CHECKING:\n    from pkg.high import d\n"
    )
    (package / "high" / "d.py").write_text('"""D."""\nfrom pkg.high import c\n')
    monkeypatch.setitem(module_table.PACKAGES, "pkg", package)
    imports = imports_at_load(module_table, "pkg")
    assert circles(imports) == [["pkg.high.b", "pkg.low.a", "pkg.high.b"]]
    assert out_of_order(imports, ("low", "high")) == [
        "pkg.low.a imports pkg.high.b, of the later wing high"
    ]
    assert out_of_order(imports, ("high", "low")) == [
        "pkg.high.b imports pkg.low, of the later wing low",
        "pkg.high.b imports pkg.low.a, of the later wing low",
    ]
