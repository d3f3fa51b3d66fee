"""Repo-wide test configuration."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The plugin's own tests, most of which start processes (generated pytest runs, ranks,
# torchrun jobs) and wait on them.
PLUGIN_TESTS = Path(__file__).parent / "tests" / "plugin"

# The suite's processes share the cores: the xdist workers and the ranks, torchrun jobs and
# pytester runs they start. A torch thread that waits for another one spins on its core by
# default (OpenMP's active wait), burning the time another process needs; waiting passively
# changes no result, only whose core it is. Set before any process loads torch (this module
# loads first), and inherited by every process the tests start; a value already set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Triton runs kernels on CPU tensors only through its interpreter, which it picks when a
    # kernel is defined: choose it before any test imports Triton, on machines without CUDA.
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a run may leave out
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` for a run that includes the plugin's tests: xdist's count plus one.

    Those tests wait: on the processes they start, on rank timeouts, and at the end on the
    other workers' last tests. A worker more than cores keeps the cores busy meanwhile: run
    alternately on a 2-core machine, the README's test command took less time with three
    workers than with two (the figures: benchmarks/results/cpu/readme_commands.txt). The
    kernel suite computes throughout, so a run of it alone keeps xdist's count, where a third
    worker only added its start. PYTEST_XDIST_AUTO_NUM_WORKERS, where set, wins."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") or not _includes_plugin_tests(config):
        return None
    from xdist.plugin import pytest_xdist_auto_num_workers as xdist_count

    return int(xdist_count(config)) + 1


def _includes_plugin_tests(config: pytest.Config) -> bool:
    """Whether the run's paths (its arguments, or testpaths without them) reach tests/plugin."""
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if path == PLUGIN_TESTS or path in PLUGIN_TESTS.parents or PLUGIN_TESTS in path.parents:
            return True
    return False
