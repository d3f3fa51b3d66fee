"""No test replaces ``PYTHONPATH``; they prepend to it. An environment that installs the plugin
through ``PYTHONPATH`` (a wheel unpacked into a site directory) loses it in every child process
that gets a replaced one, and the child then rejects the ``--gradref-*`` options."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
NAME = "PYTHONPATH"


def replacements(source: str) -> list[str]:
    """The source of each place in ``source`` (Python, and the Python in its string
    constants, which tests write out as generated files) that sets PYTHONPATH to a value that
    does not keep the previous one: a value keeps it when it joins with ``os.pathsep`` and
    reads the environment, directly or through a function of the same source that does."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []  # a string constant that is not Python
    readers = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and _reads_the_environment(ast.unparse(node))
    }
    found = []
    for node in ast.walk(tree):
        value = _value_set(node)
        if value is not None and not _keeps_the_previous(ast.unparse(value), readers):
            found.append(ast.unparse(node))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME in node.value:
            found += replacements(node.value)
    return found


def _value_set(node: ast.AST) -> ast.expr | None:
    """The value ``node`` gives PYTHONPATH, if it sets it: ``setenv``/``putenv("PYTHONPATH",
    v)``, ``x["PYTHONPATH"] = v``, ``{"PYTHONPATH": v}`` and ``f(..., PYTHONPATH=v)``."""
    if isinstance(node, ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else ""
        if name in ("setenv", "putenv") and len(node.args) > 1 and _is_name(node.args[0]):
            return node.args[1]
        return next((k.value for k in node.keywords if k.arg == NAME), None)
    if isinstance(node, ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Subscript) and _is_name(target.slice):
                return node.value
    if isinstance(node, ast.Dict):
        return next((v for k, v in zip(node.keys, node.values) if _is_name(k)), None)
    return None


def _is_name(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value == NAME


def _reads_the_environment(source: str) -> bool:
    return NAME in source and ("environ" in source or "getenv" in source)


def _keeps_the_previous(value: str, readers: set[str]) -> bool:
    reads = "environ" in value or "getenv" in value or any(f"{r}(" in value for r in readers)
    return "pathsep" in value and reads


@pytest.mark.parametrize(
    ("source", "replaces"),
    [
        ('monkeypatch.setenv("PYTHONPATH", str(path))', True),
        ('os.putenv("PYTHONPATH", "/x")', True),
        ('env["PYTHONPATH"] = str(path)', True),
        ('env = {**os.environ, "PYTHONPATH": str(path)}', True),
        ("subprocess.run(args, env=dict(os.environ, PYTHONPATH=str(path)))", True),
        # Joined, but without the previous value.
        ('env["PYTHONPATH"] = os.pathsep.join([str(a), str(b)])', True),
        # Inside a generated test file.
        ('pytester.makepyfile(\'import os\\nos.environ["PYTHONPATH"] = "/x"\\n\')', True),
        (
            'env["PYTHONPATH"] = os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")])',
            False,
        ),
        (
            "def _pythonpath():\n"
            '    return os.environ.get("PYTHONPATH", "").split(os.pathsep)\n'
            'monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(path), *_pythonpath()]))',
            False,
        ),
        ('old = os.environ.get("PYTHONPATH", "")', False),
    ],
)
def test_the_guard_tells_replacing_from_prepending(source: str, replaces: bool) -> None:
    assert bool(replacements(source)) == replaces


def test_no_test_replaces_pythonpath() -> None:
    files = sorted(TESTS.rglob("*.py"))
    assert Path(__file__) in files
    found = {
        str(path.relative_to(TESTS)): places
        for path in files
        if path != Path(__file__)  # its cases above replace it on purpose
        if (places := replacements(path.read_text()))
    }
    assert found == {}, "prepend to PYTHONPATH (os.pathsep and the previous value) instead"
