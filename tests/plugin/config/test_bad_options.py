"""Bad settings are usage errors (exit code 4) that name their source and say what is valid;
a device that cannot be used is an error with the reason, never a silent fall-back."""

from __future__ import annotations

import importlib.util

import pytest
from _forked_runs import runpytest_forked

NO_TORCH_TEST = "def test_nothing():\n    pass\n"
VALID_DEVICES = "auto, cuda, npu, xpu, mps, cpu, or NAME:INDEX such as cuda:1"
VALID_STRATEGIES = "auto, autograd, grad_and_value, crosscheck"


def _set(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str, key: str, value: str
) -> tuple[list[str], str]:
    """Set gradref_<key> from one source; return (command-line args, the source's name)."""
    if source == "cli":
        return [f"--gradref-{key}={value}"], f"the --gradref-{key} option"
    if source == "env":
        monkeypatch.setenv(f"GRADREF_{key.upper()}", value)
        return [], f"the GRADREF_{key.upper()} environment variable"
    pytester.makeini(f"[pytest]\ngradref_{key} = {value}\n")
    return [], f"the gradref_{key} ini key in tox.ini"


def _usage_error(result: pytest.RunResult, *lines: str) -> None:
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(list(lines))
    result.stdout.no_fnmatch_line("*passed*")


@pytest.mark.parametrize("source", ["cli", "env", "ini"])
def test_unknown_device(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    # Rejected even in a project without a single gradient test: the value is simply wrong.
    pytester.makepyfile(NO_TORCH_TEST)
    args, where = _set(pytester, monkeypatch, source, "device", "tpu")
    result = pytester.runpytest(*args)
    _usage_error(
        result,
        f"ERROR: Invalid gradref device 'tpu' from {where}; valid values are {VALID_DEVICES}",
    )


@pytest.mark.parametrize("source", ["cli", "env", "ini"])
def test_unknown_strategy(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    pytester.makepyfile(NO_TORCH_TEST)
    args, where = _set(pytester, monkeypatch, source, "strategy", "backward")
    result = pytester.runpytest(*args)
    _usage_error(
        result,
        f"ERROR: Invalid gradref strategy 'backward' from {where}; "
        f"valid values are {VALID_STRATEGIES}",
    )


@pytest.mark.parametrize("value", ["cpu:x", "cpu:-1", "cpu:"])
def test_malformed_device_index(pytester: pytest.Pytester, value: str) -> None:
    pytester.makepyfile(NO_TORCH_TEST)
    result = pytester.runpytest(f"--gradref-device={value}")
    _usage_error(
        result,
        f"ERROR: Invalid gradref device '{value}' from the --gradref-device option: the index "
        f"after ':' must be a non-negative integer; valid values are {VALID_DEVICES}",
    )


def test_device_index_out_of_range(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(NO_TORCH_TEST)
    result = pytester.runpytest("--gradref-device=cpu:1")
    _usage_error(
        result,
        "ERROR: gradref device 'cpu:1' from the --gradref-device option is out of range: "
        "1 cpu device(s) visible, so the index must be 0..0",
    )
    pytester.runpytest("--gradref-device=cpu:0").assert_outcomes(passed=1)


BOARD = """
from pytest_gradref import Backend

def pytest_gradref_register_backends(registry):
    registry.register(
        Backend(
            name="board",
            device_type="cpu",
            count_devices=lambda: 2,
            visible_devices_env="BOARD_VISIBLE_DEVICES",
        )
    )
"""


def test_device_index_out_of_range_names_the_visible_devices_variable(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makeconftest(BOARD)
    pytester.makepyfile(
        """
import torch

def test_index(gradref_backend, gradref_device):
    assert gradref_backend.name == "board"
    assert gradref_device == torch.device("cpu")
"""
    )
    monkeypatch.setenv("BOARD_VISIBLE_DEVICES", "4,5")
    monkeypatch.setenv("GRADREF_DEVICE", "board:2")
    result = pytester.runpytest()
    _usage_error(
        result,
        "ERROR: gradref device 'board:2' from the GRADREF_DEVICE environment variable is out of "
        "range: 2 board device(s) visible with BOARD_VISIBLE_DEVICES='4,5', so the index must "
        "be 0..1",
    )
    result = pytester.runpytest("--gradref-device=board:1")
    result.stdout.fnmatch_lines(["gradref: device=board:1 on cpu (*; from the --gradref-device *"])
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize("value", ["cuda", "cuda:0"])
def test_unavailable_cuda(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    # No visible CUDA device, in a fresh process: a CPU-only build or a hidden GPU alike.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile(NO_TORCH_TEST)
    result = runpytest_forked(pytester, f"--gradref-device={value}")
    _usage_error(
        result,
        f"ERROR: gradref device '{value}' from the --gradref-device option is unavailable: "
        "* Install or expose that device, or use --gradref-device=auto to take the first "
        "available one.",
    )
    # The reason itself, as the cuda probe gives it for this torch build.
    import torch

    result.stderr.no_fnmatch_line("*--gradref-simulate*")  # cuda cannot be simulated
    if torch.version.cuda is None and torch.version.hip is None:
        result.stderr.fnmatch_lines(["*unavailable: torch * is a CPU-only build.*"])
    else:
        result.stderr.fnmatch_lines(["*unavailable: no CUDA device visible*"])


def test_unavailable_npu_without_torch_npu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    pytester.makepyfile(NO_TORCH_TEST)
    monkeypatch.setenv("GRADREF_DEVICE", "npu")
    result = pytester.runpytest()
    _usage_error(
        result,
        "ERROR: gradref device 'npu' from the GRADREF_DEVICE environment variable is "
        "unavailable: torch_npu not installed. Install or expose that device, run its code "
        "path without the hardware with --gradref-simulate=npu (a simulated npu backed by the "
        "CPU: it proves the code path, not the device's numerics), or use --gradref-device=auto "
        "to take the first available one.",
    )


def test_unavailable_third_party_backend(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
from pytest_gradref import Backend

def pytest_gradref_register_backends(registry):
    registry.register(
        Backend(name="widget", device_type="cpu", probe=lambda: "no widget plugged in")
    )
"""
    )
    pytester.makepyfile(NO_TORCH_TEST)
    pytester.makeini("[pytest]\ngradref_device = widget\n")
    result = pytester.runpytest()
    _usage_error(
        result,
        "ERROR: gradref device 'widget' from the gradref_device ini key in tox.ini is "
        "unavailable: no widget plugged in. Install or expose that device*",
    )


# A torch_npu that cannot be imported, as on a machine with the wheel but no Ascend toolkit.
BROKEN_TORCH_NPU = """
import os

with open(os.path.join(os.path.dirname(__file__), "torch_npu_was_imported"), "w"):
    pass
raise RuntimeError("libascendcl.so: cannot open shared object file")
"""

# cuda is hidden so that auto reaches npu on every machine, GPU or not.
HIDE_CUDA = """
from pytest_gradref import builtin_backend

def pytest_gradref_register_backends(registry):
    registry.register(builtin_backend("cuda").replace(probe=lambda: "hidden by the test"))
"""


def test_broken_torch_npu_makes_npu_unavailable_never_a_crash(pytester: pytest.Pytester) -> None:
    pytester.syspathinsert()
    pytester.makepyfile(torch_npu=BROKEN_TORCH_NPU)
    pytester.makeconftest(HIDE_CUDA)
    pytester.makepyfile(
        test_it="""
import torch

def test_on_cpu(grad_reference, gradref_backend):
    assert gradref_backend.name != "npu"
    grad_reference(lambda x: x.sum(), torch.ones(2))
"""
    )
    marker = pytester.path / "torch_npu_was_imported"
    # Not requested, and auto not asked for: torch_npu is never imported.
    pytester.runpytest("--gradref-device=cpu").assert_outcomes(passed=1)
    assert not marker.exists()
    # Requested: an error with the import failure as the reason.
    result = pytester.runpytest("--gradref-device=npu")
    _usage_error(
        result,
        "ERROR: gradref device 'npu' from the --gradref-device option is unavailable: "
        "torch_npu failed to import: RuntimeError: libascendcl.so: cannot open shared object "
        "file. Install or expose that device*",
    )
    assert marker.exists()
    # Reached by auto: reported in the header, and the run goes on.
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(
        [
            "gradref: device=* (*; auto: first available) *| cuda unavailable: hidden by the "
            "test; npu unavailable: torch_npu failed to import: RuntimeError: libascendcl.so*"
        ]
    )
    result.assert_outcomes(passed=1)


def test_auto_with_nothing_available(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
from pytest_gradref import builtin_backend

def pytest_gradref_register_backends(registry):
    for name in ("cuda", "npu", "xpu", "mps", "cpu"):
        registry.register(builtin_backend(name).replace(probe=lambda name=name: f"{name} off"))
"""
    )
    pytester.makepyfile("def test_x(gradref_device):\n    pass\n")
    result = pytester.runpytest()
    _usage_error(
        result,
        "ERROR: gradref found no available device for auto (cuda: cuda off; npu: npu off; "
        "xpu: xpu off; mps: mps off; cpu: cpu off)",
    )


def test_a_probe_that_raises_makes_its_backend_unavailable(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
from pytest_gradref import Backend

def crash():
    raise OSError("driver crashed")

def pytest_gradref_register_backends(registry):
    registry.register(Backend(name="widget", device_type="cpu", probe=crash, auto_rank=0))
"""
    )
    pytester.makepyfile(
        "def test_x(gradref_backend):\n    assert gradref_backend.name != 'widget'\n"
    )
    # auto moves on, and says why.
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(
        ["gradref: *| widget unavailable: its probe failed: OSError: driver crashed*"]
    )
    result.assert_outcomes(passed=1)
    # Requested, it is a usage error with the same reason.
    result = pytester.runpytest("--gradref-device=widget")
    _usage_error(
        result,
        "ERROR: gradref device 'widget' from the --gradref-device option is unavailable: its "
        "probe failed: OSError: driver crashed. Install or expose that device*",
    )
