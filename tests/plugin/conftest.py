"""Shared set-up for the pytester-driven tests of pytest-gradref.

pytester itself is enabled with ``-p pytester`` in pyproject's addopts (a ``pytest_plugins``
line is not allowed in a conftest below the rootdir).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing.forkserver  # held for the whole session: see the note below
import multiprocessing.util
import socket
from collections.abc import Callable

import pytest
import torch
import torch._dynamo  # see the note below
from _forked_python import forked_popen_args, forked_spawnv_passfds
from _forked_runs import zygote

from pytest_gradref.config.settings import OPTIONS

# In-process pytester runs drop every module a run imported once the run ends. The first
# torch.func transform imports torch._dynamo, which imports Triton when it is installed and
# wraps torch.manual_seed so that its next call re-imports torch._dynamo; a second in-process
# run would then import Triton's nanobind extension again, which aborts the interpreter.
# Importing torch._dynamo here, once, keeps all of it loaded across runs.

# The same holds for the hundreds of modules the first grad_and_value call loads, some of which
# register operator libraries that refuse a second registration: load them once, here too.
torch.func.grad_and_value(lambda x: x.sum())(torch.ones(2))

# multiprocessing.forkserver, imported above, holds the fork server that the plugin's ranks
# fork from; the first pool imports it. Dropped with an in-process run's modules, it left that
# run's server running and had every later run start one of its own (an interpreter importing
# torch). Imported once, for the whole session, the runs of this process share one server, as
# the pools of one session do. That server starts as a fork of the zygote, as the generated
# runs' servers do: it has imported torch and torch._dynamo already, where a new interpreter
# would import them (_forked_python.py).
if hasattr(socket, "send_fds"):
    multiprocessing.util.spawnv_passfds = forked_spawnv_passfds(
        multiprocessing.util.spawnv_passfds, zygote.socket_path
    )

# Hypothesis's pytest plugin imports hypothesis at the end of every run that loads it; where
# this process has not, each in-process run imported its 75 modules again (and dropped them).
with contextlib.suppress(ModuleNotFoundError):
    import hypothesis  # noqa: F401

# Every in-process run ends with pytest's garbage collection (twice: the run's cleanup and its
# unconfigure), over all of this process's objects, torch and torch._dynamo's included, for
# hundreds of runs. What is loaded by now stays
# loaded, so it is frozen out of the collector's reach; it is unfrozen at exit, where the
# interpreter's teardown collects it (frozen, Triton's bindings report their objects as leaked).
gc.freeze()
atexit.register(gc.unfreeze)

# importlib_metadata (the backport that pytest-randomly imports on Python 3.9) disables the
# standard library's distribution finder and appends its own to sys.meta_path when first
# imported. A run that imports it first ends with sys.meta_path restored and the module dropped,
# the standard finder still disabled: no distribution is found, so the next run loads no
# pytest11 entry point and rejects --gradref-* as unrecognized arguments. Imported here, once,
# its finder stays for the whole session. Where it is not installed nothing disables the finder.
with contextlib.suppress(ModuleNotFoundError):
    import importlib_metadata  # noqa: F401

# Every gradref environment variable, from the settings' one declaration, and the simulated
# npu's visible-devices variable: cleared for each generated project's run.
GRADREF_ENV = (
    *(spec.env for spec in OPTIONS if spec.env is not None),
    "ASCEND_RT_VISIBLE_DEVICES",
)

# A conftest for the generated projects: the npu *policy* (grad_and_value by default) placed on
# CPU tensors, so the NPU code path runs on machines without an NPU. Registering the built-in
# name is enough to override the built-in: no replace=True, because the built-ins come last.
NPU_ON_CPU = """
from pytest_gradref import builtin_backend

def pytest_gradref_register_backends(registry):
    registry.register(builtin_backend("npu").replace(device_type="cpu", probe=lambda: None))
"""


@pytest.fixture(autouse=True)
def _clean_gradref_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings from the outer environment must not leak into the generated runs."""
    for name in GRADREF_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _no_rerunfailures_in_generated_runs(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generated runs load pytest-rerunfailures only where a test asks for it
    (test_beside_plugins.py removes this again).

    Wherever xdist is installed, rerunfailures starts a socket server thread in every run that
    never shuts down; under coverage (CI's lower-bound job runs with --cov, which follows
    subprocesses) and -n, such a subprocess run hung at exit for the whole 600 s timeout.
    """
    if "pytester" not in request.fixturenames:
        return
    request.getfixturevalue("pytester")  # it clears PYTEST_ADDOPTS when it starts: set it after
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p no:rerunfailures")


@pytest.fixture
def npu_on_cpu(pytester: pytest.Pytester) -> Callable[[str], None]:
    """Write the npu-on-CPU conftest, plus any extra conftest source."""

    def write(extra: str = "") -> None:
        pytester.makeconftest(NPU_ON_CPU + extra)

    return write


@pytest.fixture(autouse=True)
def _forked_xdist_workers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pytest-xdist workers of in-process runs start as forks of the zygote
    (_forked_python.py), without an import of torch each. A test that checks a worker's own
    start runs its workers in a subprocess run (runpytest_subprocess)."""
    if "pytester" not in request.fixturenames or not hasattr(socket, "send_fds"):
        return
    try:
        from execnet import gateway_io
    except ModuleNotFoundError:  # no xdist here: no workers to start, nothing to skip
        return
    patched = forked_popen_args(gateway_io.popen_args, zygote.socket_path)
    monkeypatch.setattr(gateway_io, "popen_args", patched)
