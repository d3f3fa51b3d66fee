"""Runs in fresh processes: loading the plugin stays cheap, and gradref tests pass under
pytest-xdist (``-n 2``), markers and strategies included."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import pytest_gradref

RECORD_TORCH = """
import json
import os
import sys


def test_no_torch(pytestconfig):
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("pytest_gradref"))
    with open(os.path.join(str(pytestconfig.rootpath), "loaded.json"), "w") as handle:
        json.dump(loaded, handle)
    assert pytestconfig.pluginmanager.hasplugin("gradref")
    assert "torch" not in sys.modules
"""

IMPORT_PLUGIN = """
import json, sys
import pytest
before = set(sys.modules)
import pytest_gradref.plugin
print(json.dumps(sorted(set(sys.modules) - before)))
"""


# The configure-time layer: what importing the plugin may load. None of these imports torch at
# load (docs/contributing.md's module table says so of each); they import one another at the
# top. The torch layer (torch itself, the reference and comparison code, the simulated device)
# is imported inside the functions that cross into it, once a test needs it.
CONFIGURE_LAYER = {
    f"pytest_gradref{suffix}"
    for suffix in (
        "",
        ".config",
        ".config.header",
        ".config.markers",
        ".config.number_settings",
        ".config.resolution",
        ".config.settings",
        ".config.state",
        ".config.strategies",
        ".config.threads",
        ".config.thresholds",
        ".config.tolerances",
        ".devices",
        ".devices.backends",
        ".devices.xdist",
        ".hookspecs",
        ".plugin",
        ".ranks",
        ".ranks.launcher",
        ".ranks.pytest_side",
        ".reference",
        ".reference.inputs",
        ".report",
        ".report.device_coverage",
        ".report.diff",
        ".report.writer",
        ".warning_types",
    )
}

# Torch-free too, but loaded on demand, where their feature is used: the baseline gate (and
# the comparison output it prints) in a gated run, the rank processes in a multi-rank test.
ON_DEMAND = {
    f"pytest_gradref.{name}"
    for name in ("report.baseline", "report.diff_output", "ranks.processes", "ranks.worker")
}


def test_importing_the_plugin_loads_only_torch_free_modules() -> None:
    # What pytest does when it loads the plugin, in a fresh interpreter: import the entry
    # point after pytest. The configure-time layer loads with it; the reference and comparison
    # code, the simulated device and torch load when a hook or fixture first needs them.
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_PLUGIN], capture_output=True, text=True, check=True
    )
    loaded = set(json.loads(done.stdout))
    assert "torch" not in loaded
    assert {m for m in loaded if m.startswith("pytest_gradref")} <= CONFIGURE_LAYER
    assert not loaded & ON_DEMAND


def _function_level_imports(path: Path) -> Iterator[tuple[str, int]]:
    """The package modules a module imports inside its functions, with the line."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(node):
            if isinstance(inner, ast.Import):
                yield from ((alias.name, inner.lineno) for alias in inner.names)
            elif isinstance(inner, ast.ImportFrom) and inner.module:
                yield inner.module, inner.lineno
                for alias in inner.names:  # from pytest_gradref.devices import simulated
                    yield f"{inner.module}.{alias.name}", inner.lineno


def _source(name: str) -> Path:
    """The file of a package module (a wing's ``__init__.py`` for the wing)."""
    path = Path(pytest_gradref.__file__).parent.joinpath(*name.split(".")[1:])
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def test_the_configure_layer_imports_itself_at_the_top() -> None:
    # Only a crossing into the torch layer waits inside a function: a module of the
    # configure-time layer that another imports lazily is an import cost hidden, not saved.
    # The on-demand modules are imported inside the function that starts their feature.
    # The packages (the root, the wings) are left out: ``from pytest_gradref.devices import
    # simulated`` names the wing, but imports the module.
    modules = {name for name in CONFIGURE_LAYER if _source(name).name != "__init__.py"}
    lazy = [
        f"{name}:{line} imports {target} inside a function"
        for name in sorted(modules)
        for target, line in _function_level_imports(_source(name))
        if target in modules
    ]
    assert not lazy


def test_the_tolerance_tables_load_without_torch() -> None:
    # The markers parse a test's tolerances at collection, and a conftest builds a backend's
    # table from pytest_gradref.Tolerance before any test runs: config/tolerances.py loads no
    # torch (verdict/dtypes.py, the precision of dtypes, and the comparison do).
    code = "import sys, pytest_gradref.config.tolerances; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_public_names_load_on_first_access() -> None:
    from pytest_gradref import Reference, Tolerance

    assert Reference.__module__ == "pytest_gradref.reference.result"
    assert Tolerance(rtol=0.0, atol=0.0).rtol == 0.0
    assert set(pytest_gradref.__all__) <= set(dir(pytest_gradref))
    for name in pytest_gradref.__all__:
        assert getattr(pytest_gradref, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        pytest_gradref.nothing  # noqa: B018


def test_plugin_loads_without_importing_torch(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No conftest, no gradient test: only the plugin, installed. Settings that need no device
    # (a strategy, an explicit auto) are parsed without torch too.
    assert not list(pytester.path.glob("conftest.py"))
    pytester.makepyfile(RECORD_TORCH)
    monkeypatch.setenv("GRADREF_STRATEGY", "grad_and_value")
    result = pytester.runpytest_subprocess("--gradref-device=auto")
    result.stdout.fnmatch_lines(["plugins:*gradref-*"])
    result.stdout.no_fnmatch_line("gradref: *")  # no device was resolved, so no header
    result.assert_outcomes(passed=1)
    loaded = json.loads((pytester.path / "loaded.json").read_text())
    assert "torch" not in loaded
    # A session without gradient tests never loads the reference and comparison code.
    for module in (
        "reference.grad_reference",
        "reference.computation",
        "reference.result",
        "reference.recording",
        "verdict.judge",
        "verdict.checks",
        "verdict.dtypes",
    ):
        assert f"pytest_gradref.{module}" not in loaded, module


XDIST_TESTS = """
import pytest
import torch


def loss(x, w):
    return torch.tanh(x @ w).square().sum()


@pytest.mark.parametrize("n", range(4))
def test_reference(grad_reference, gradref_backend, gradref_device, n):
    x = torch.randn(n + 2, 3, device=gradref_device)
    w = torch.randn(3, 2, device=gradref_device)
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    assert ref.strategy == gradref_backend.default_strategy
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = loss(xx, ww)
    out.backward()
    ref.assert_close(out, (xx.grad, ww.grad))


@pytest.mark.gradref(strategy="crosscheck")
def test_crosscheck(grad_reference, gradref_backend, gradref_device):
    ref = grad_reference(lambda t: t.exp().sum(), torch.randn(5, device=gradref_device))
    assert ref.strategy == gradref_backend.default_strategy
    assert ref.crosscheck is not None


@pytest.mark.gradref_xfail("cpu", "cuda", "npu", "xpu", "mps", reason="fails everywhere")
def test_xfail(grad_reference):
    assert False


@pytest.mark.gradref_skip("cpu", "cuda", "npu", "xpu", "mps", reason="skipped everywhere")
def test_skip(grad_reference):
    assert False
"""


def test_under_xdist(pytester: pytest.Pytester) -> None:
    # One run, as each costs a torch import per process.
    pytester.makepyfile(XDIST_TESTS)
    result = pytester.runpytest("-n", "2", "-rsx")
    result.assert_outcomes(passed=5, xfailed=1, skipped=1)
    result.stdout.fnmatch_lines_random(
        [
            "XFAIL *::test_xfail - [[]gradref *[]] fails everywhere",
            "SKIPPED [[]1[]] *: [[]gradref *[]] skipped everywhere",
        ]
    )
    # The controller chooses the device for its workers, so it can and must say which one in
    # the header, as a serial run does.
    result.stdout.fnmatch_lines(["gradref: device=* (*; auto: first available) strategy=*"])
