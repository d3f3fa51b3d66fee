"""``-n auto`` in this repository: one worker more than xdist's count for a run that includes
the plugin's tests (the root conftest.py), xdist's own count for one that does not."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from xdist.plugin import pytest_xdist_auto_num_workers as xdist_count

REPO = Path(__file__).resolve().parents[2]


def root_conftest() -> ModuleType:
    spec = importlib.util.spec_from_file_location("root_conftest", REPO / "conftest.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config_of(*args: str, invoked_in: Path = REPO) -> Any:
    """What the hook reads of a run's configuration."""
    return SimpleNamespace(
        args=list(args),
        invocation_params=SimpleNamespace(dir=invoked_in),
        option=SimpleNamespace(numprocesses="auto"),
    )


@pytest.mark.parametrize(
    ("args", "extra"),
    [
        (("tests",), 1),  # the README's test command: testpaths
        ((".",), 1),
        (("tests/plugin/ranks/test_ranks.py::test_a_name",), 1),
        (("tests/kernels", "tests/plugin/config"), 1),
        (("tests/kernels",), 0),  # the README's main job
        (("tests/repo", "README.md"), 0),
        (("tests/pluginlike",), 0),  # a name that only begins like it
    ],
)
def test_a_run_with_the_plugin_tests_gets_one_worker_more(
    monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], extra: int
) -> None:
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    config = config_of(*args)
    count = root_conftest().pytest_xdist_auto_num_workers(config)
    if extra:
        assert count == xdist_count(config) + 1
    else:
        assert count is None  # xdist decides


def test_arguments_are_read_from_where_pytest_was_invoked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    hook = root_conftest().pytest_xdist_auto_num_workers
    assert hook(config_of("plugin", invoked_in=REPO / "tests")) == xdist_count(config_of()) + 1
    assert hook(config_of("kernels", invoked_in=REPO / "tests")) is None


def test_an_explicit_count_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "5")
    assert root_conftest().pytest_xdist_auto_num_workers(config_of("tests")) is None
