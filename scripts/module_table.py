"""Writes the contributing page's table of modules: one line per module and its import layer.

For each module of ``pytest_gradref`` and ``gradref_kernels``, subpackages included: the first
sentence of its docstring (the concern it holds), whether importing it loads torch, and the
package modules it imports at load. A package with subpackages (``pytest_gradref``: its face
over six wings) gets a wing column, its face first and then the wings in the order they import
one another (``WINGS``). "At load" means the module's top-level imports (those under
``if TYPE_CHECKING:`` excluded), followed through the package's own modules: a module loads
torch when it, or a package module it imports at load, imports torch, triton or numpy at the
top level. Blocks between ``<!-- module-table: PACKAGE -->`` and ``<!-- /module-table -->`` in
docs/contributing.md are written.

    python scripts/module_table.py            # rewrite the blocks
    python scripts/module_table.py --check    # fail where a block is stale (CI)
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docblocks import ROOT, main

PAGES = (ROOT / "docs" / "contributing.md",)
PACKAGES = {
    "pytest_gradref": ROOT / "pytest_gradref",
    "gradref_kernels": ROOT / "kernels" / "gradref_kernels",
}
HEAVY = ("torch", "triton", "numpy")
# The subpackages (wings) of a package, in the order they import one another at load
# (tests/repo/test_layout.py holds it: a wing imports only the wings before it).
WINGS = {"pytest_gradref": ("config", "devices", "verdict", "reference", "report", "ranks")}


def modules(package: str) -> dict[str, Path]:
    """Every module of a package and its subpackages, by dotted name."""
    found = {}
    for path in sorted(PACKAGES[package].rglob("*.py")):
        parts = path.relative_to(PACKAGES[package]).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((package, *parts))] = path
    return found


def wing(package: str, name: str) -> str:
    """The subpackage a module belongs to, or "" for the package's own modules."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and _is_package(package, name)) else ""


def _is_package(package: str, name: str) -> bool:
    return modules(package)[name].name == "__init__.py"


def wing_order(package: str, layers: dict[str, tuple[bool, set[str]]]) -> list[str]:
    """The package's own modules ("") first, then its wings in WINGS's order."""
    order = ["", *WINGS.get(package, ())]
    unknown = sorted({wing(package, name) for name in layers} - set(order))
    if unknown:
        raise SystemExit(f"{package}: wings missing from WINGS: {', '.join(unknown)}")
    return order


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it loads: its body's, and those of top-level try/if
    blocks, but not those under ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _top_level(block)
            for handler in node.handlers:
                yield from _top_level(handler.body)


def imports_at_load(name: str, path: Path, known: set[str]) -> tuple[set[str], set[str]]:
    """The package modules and the third-party top-level packages a module imports at load."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    internal: set[str] = set()
    external: set[str] = set()
    for node in _top_level(tree.body):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            if target in known:
                internal.add(target)
            elif target.split(".")[0] not in PACKAGES:
                external.add(target.split(".")[0])
            elif target.split(".")[0] in known:  # importing a submodule loads the package
                internal.add(target.split(".")[0])
    internal.discard(name)
    if name != package and package in known:
        internal.add(package)  # a submodule's package is imported first
    return internal, external


def loads_heavy(package: str) -> dict[str, tuple[bool, set[str]]]:
    """Per module: whether it loads torch (or triton, numpy) at import, and the package
    modules it imports at load."""
    paths = modules(package)
    known = set(paths)
    direct = {name: imports_at_load(name, path, known) for name, path in paths.items()}

    def heavy(name: str, seen: frozenset[str] = frozenset()) -> bool:
        internal, external = direct[name]
        if any(module in HEAVY for module in external):
            return True
        return any(heavy(other, seen | {name}) for other in internal if other not in seen)

    return {name: (heavy(name), direct[name][0]) for name in paths}


def concern(path: Path) -> str:
    """The first sentence of the module's docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    match = re.match(r"(.+?\.)(?:\s|$)", paragraph)
    sentence = (match.group(1) if match else paragraph).replace("``", "`")
    return sentence.rstrip(":.") + "." if sentence else "(no docstring)"


def render(package: str) -> str:
    if package not in PACKAGES:
        raise SystemExit(f"unknown package {package!r}: {', '.join(PACKAGES)}")
    paths = modules(package)
    layers = loads_heavy(package)
    wings = wing_order(package, layers)
    columns = ["module", "loads torch at import", "package modules imported at load", "concern"]
    if len(wings) > 1:
        columns.insert(0, "wing")
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for name, path in sorted(paths.items(), key=lambda item: wings.index(wing(package, item[0]))):
        heavy, internal = layers[name]
        # Every module loads its packages' __init__ first: listed for the packages alone.
        shown = ", ".join(
            f"`{other.partition('.')[2]}`"
            for other in sorted(internal)
            if not _is_package(package, other)
        )
        where = path.relative_to(ROOT).as_posix()
        text = concern(path).replace("|", "\\|")
        cells = [f"`{where}`", "yes" if heavy else "no", shown or "—", text]
        if len(wings) > 1:
            cells.insert(0, wing(package, name) or "face")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(argv: Sequence[str]) -> int:
    return main("module-table", render, PAGES, argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
