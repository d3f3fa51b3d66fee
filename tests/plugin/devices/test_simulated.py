"""The simulated npu (``--gradref-simulate=npu``): the plugin's real npu route, torch_npu probe
and torch.npu calls included, on CPU-only machines.

Installing the simulation renames PyTorch's PrivateUse1 backend for the whole process, so every
run that installs it is a process of its own: forked from one that imported torch already
(_forked_runs.py), or a new interpreter where the order of imports is what a test checks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from _forked_runs import runpytest_forked

from pytest_gradref.devices import simulated, simulated_devices

SIM = ("--gradref-simulate=npu", "--gradref-device=npu", "-rxs")

# The tests that run the simulation skip, with the reason, on a torch too old for it (CI's
# lower-bound environment); test_older_torch_is_a_usage_error checks what such a run gets.
needs_simulation = pytest.mark.skipif(
    simulated.unsupported_reason() is not None, reason=str(simulated.unsupported_reason())
)

NPU_ROUTE = """
import sys
import threading

import pytest
import torch


def test_probe_imports_the_stand_in(gradref_backend, gradref_device):
    import torch_npu

    assert torch_npu.simulated and sys.modules["torch_npu"] is torch_npu
    assert gradref_backend.name == "npu" and gradref_backend.unavailable_reason() is None
    assert gradref_device == torch.device("npu", 0)
    assert torch.npu.is_available() and torch.npu.device_count() == 2
    assert "simulated" in torch.npu.get_device_name(0)
    assert torch.npu.current_device() == 0


def test_tensors_live_on_the_npu(gradref_device):
    x = torch.arange(6.0, device=gradref_device).reshape(2, 3)
    assert x.device == gradref_device and x.is_npu
    on_cpu = x.cpu()
    assert on_cpu.device.type == "cpu"
    on_cpu += 1  # a copy: the npu tensor is unchanged
    assert x.sum().item() == 15.0
    back = on_cpu.to(gradref_device)
    assert back.device == gradref_device and back.sum().item() == 21.0
    assert (x * torch.tensor(2.0)).device == gradref_device  # a 0-dim CPU scalar is fine
    assert x.to("meta").device.type == "meta" and x.double().cpu().dtype == torch.float64
    # An out= operator that resizes its output (torch.eye does) resizes the npu tensor.
    eye = torch.eye(3, dtype=torch.float64, device=gradref_device)
    assert eye.shape == (3, 3) and eye.sum().item() == 3.0
    with pytest.raises(RuntimeError, match="same device.*npu:0.*npu:1|same device.*npu:1"):
        x + x.to("npu:1")


def test_seeding_reproduces_draws(gradref_backend, gradref_device):
    gradref_backend.seed(1234)
    first = torch.randn(4, device=gradref_device).cpu()
    torch.npu.manual_seed_all(1234)
    torch.npu.manual_seed(1234)
    second = torch.randn(4, device=gradref_device).cpu()
    assert torch.equal(first, second)


def test_synchronize_and_memory_statistics(gradref_backend, gradref_device):
    gradref_backend.synchronize(gradref_device)
    torch.npu.synchronize()
    stats = gradref_backend.memory_stats(gradref_device)
    assert stats == {"memory_allocated": 0, "max_memory_allocated": 0, "memory_reserved": 0}
    gradref_backend.reset_peak_memory(gradref_device)
    # Tensors created count per device, as allocations on CUDA and torch_npu do.
    npu1 = torch.device("npu", 1)
    before = [gradref_backend.allocation_count(d) for d in (gradref_device, npu1)]
    x = torch.ones(2, device=gradref_device) + 1
    assert [gradref_backend.allocation_count(d) for d in (gradref_device, npu1)] == [
        before[0] + 2,
        before[1],
    ]
    x.to(npu1)
    assert gradref_backend.allocation_count(npu1) == before[1] + 1


def test_reference_on_npu_tensors(grad_reference, gradref_device):
    x = torch.randn(3, 4, device=gradref_device, requires_grad=True)
    w = torch.randn(4, 2, device=gradref_device)
    ref = grad_reference(lambda x, w: (x @ w).tanh().sum(), x, w, golden=torch.float64)
    assert ref.strategy == "grad_and_value" and ref.grads[0].device == gradref_device
    assert x.grad is None
    value = (x @ w).tanh().sum()
    (grad,) = torch.autograd.grad(value, x)
    ref.assert_close(value, [grad])


@pytest.mark.gradref_xfail("npu", reason="fails on npu only", raises=AssertionError)
def test_npu_xfail(gradref_device):
    assert gradref_device.type != "npu"


def test_backward_on_the_second_device():
    x = torch.arange(3.0, device="npu:1", requires_grad=True)
    (x * x * x).sum().backward()
    assert x.grad.device == torch.device("npu", 1)
    assert torch.equal(x.grad.cpu(), torch.tensor([0.0, 3.0, 12.0]))


def test_grad_and_value_on_the_second_device():
    x = torch.arange(3.0, device="npu:1")
    grad, value = torch.func.grad_and_value(lambda t: (t * t * t).sum())(x)
    assert grad.device == value.device == torch.device("npu", 1)
    assert torch.equal(grad.cpu(), torch.tensor([0.0, 3.0, 12.0])) and value.item() == 9.0


@pytest.mark.xfail(
    raises=RuntimeError,
    strict=True,
    reason="torch 2.13's Python device guard reports one PrivateUse1 device, so the autograd "
    "engine has no device queue for npu:1 (torch/csrc/acc/Module.cpp, "
    "PythonDeviceGuard::deviceCount); the simulation runs backward on the thread that runs "
    "the tests, and a thread the test starts takes the device queues",
)
def test_backward_from_another_thread_on_the_second_device():
    x = torch.ones(3, device="npu:1", requires_grad=True)
    errors = []

    def backward():
        try:
            (x * x).sum().backward()
        except RuntimeError as error:
            errors.append(error)

    thread = threading.Thread(target=backward)
    thread.start()
    thread.join()
    if errors:  # the engine's assert on its device queues, and no other error
        assert "device_ready_queues_" in str(errors[0]), errors[0]
        raise errors[0]
    assert torch.equal(x.grad.cpu(), torch.full((3,), 2.0))


def test_forgot_to_move_a_tensor(gradref_device):
    x = torch.randn(3, device=gradref_device)
    bias = torch.randn(3)  # left on the CPU
    x + bias
"""


def _run_route(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makepyfile(NPU_ROUTE)
    return runpytest_forked(pytester, *args)


@needs_simulation
def test_the_npu_route_runs_on_the_simulated_device(pytester: pytest.Pytester) -> None:
    result = _run_route(pytester, *SIM, "--gradref-report=report.json")
    result.stdout.fnmatch_lines(
        [
            "gradref: device=npu:0 (simulated on CPU; from the --gradref-device option) "
            "strategy=grad_and_value (npu default) *",
        ]
    )
    result.assert_outcomes(passed=7, failed=1, xfailed=2)
    # The test that forgot to move a tensor fails with the error real hardware gives.
    result.stdout.fnmatch_lines(
        [
            "*test_forgot_to_move_a_tensor*",
            "E * Expected all tensors to be on the same device, but found at least two "
            "devices, cpu and npu:0!*",
        ]
    )
    report = json.loads((pytester.path / "report.json").read_text())
    assert report["simulated"] is True
    assert [(t["device"], t["simulated"]) for t in report["tests"]] == [("npu:0", True)]


@needs_simulation
def test_crosscheck_on_npu_tensors_from_the_environment(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADREF_SIMULATE", "npu")
    pytester.makepyfile(NPU_ROUTE)
    result = runpytest_forked(
        pytester, "--gradref-device=npu", "--gradref-strategy=crosscheck", "-k", "reference"
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "gradref: device=npu:0 (simulated on CPU; *) strategy=crosscheck *",
            "crosscheck: * items received grad_and_value results, checked against autograd; "
            "0 differ beyond tolerance",
        ]
    )


def test_command_line_none_overrides_the_ini_key(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ngradref_simulate = npu\n")
    pytester.makepyfile(
        """
import sys

def test_real_device(gradref_device):
    # auto takes the first real device: cuda where there is one, else the cpu
    assert gradref_device.type in ("cuda", "cpu") and "torch_npu" not in sys.modules
"""
    )
    result = runpytest_forked(pytester, "--gradref-simulate=none", "--gradref-device=auto")
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*simulated*")


@needs_simulation
def test_visible_devices_limit_the_count(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "1")
    pytester.makepyfile(
        """
import torch

def test_one_visible():
    assert torch.npu.device_count() == 1
"""
    )
    result = runpytest_forked(pytester, "--gradref-simulate=npu", "--gradref-device=npu:1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: gradref device 'npu:1' from the --gradref-device option is out of range: "
            "1 npu device(s) visible with ASCEND_RT_VISIBLE_DEVICES='1', so the index must be 0..0"
        ]
    )
    runpytest_forked(pytester, "--gradref-simulate=npu", "--gradref-device=npu:0").assert_outcomes(
        passed=1
    )


@needs_simulation
def test_workers_take_simulated_devices(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest
import torch

@pytest.mark.parametrize("i", range(4))
def test_on_worker_device(i, gradref_device, worker_id, grad_reference):
    assert gradref_device == torch.device("npu", int(worker_id[2:]))
    assert torch.npu.current_device() == gradref_device.index
    assert torch.ones(1, device="npu").device == gradref_device
    # Gradients on the worker's device: autograd, and grad_and_value in the reference.
    x = torch.arange(3.0, device=gradref_device, requires_grad=True)
    ref = grad_reference(lambda x: (x * x * x).sum(), x, golden=torch.float64)
    value = (x * x * x).sum()
    value.backward()
    assert x.grad.device == ref.grads[0].device == gradref_device
    assert torch.equal(x.grad.cpu(), torch.tensor([0.0, 3.0, 12.0]))
    ref.assert_close(value, [x.grad])
"""
    )
    result = runpytest_forked(pytester, "-n", "2", "-v", *SIM)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["[[]gw1[]] * PASSED *test_on_worker_device*"])
    result.stdout.fnmatch_lines(
        [
            "*= gradref workers =*",
            "gw0 -> npu:0 (simulated on CPU; current device npu:0)",
            "gw1 -> npu:1 (simulated on CPU; current device npu:1)",
        ]
    )


KERNEL_TESTS = Path(__file__).resolve().parents[2] / "kernels" / "test_fused_linear_jsd.py"


@needs_simulation
def test_kernel_tests_on_both_simulated_workers(pytester: pytest.Pytester) -> None:
    # A slice of the kernel suite itself (its conftest and the repository's ini included):
    # backward through the fused loss and grad_and_value references, on npu:0 and npu:1.
    result = runpytest_forked(
        pytester,
        str(KERNEL_TESTS),
        "-k",
        "test_grad_output or test_non_contiguous_inputs",
        "-n",
        "2",
        "-v",
        "-p",
        "no:cacheprovider",
        *SIM,
    )
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(["[[]gw1[]] * PASSED *test_fused_linear_jsd.py::*"])
    result.stdout.fnmatch_lines(["gw1 -> npu:1 (simulated on CPU; current device npu:1*"])


# An importable torch_npu stands for a real one, whether or not it sees a device.
REAL_TORCH_NPU = """
import types

import torch

npu = types.ModuleType("torch.npu")
npu.is_available = lambda: {count} > 0
npu.device_count = lambda: {count}
torch.npu = npu
"""


def _torch_npu_on_the_path(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    package = pytester.mkpydir("torch_npu")
    (package / "__init__.py").write_text(source)
    # Prepended: an environment that installs the plugin through PYTHONPATH keeps it.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pytester.path), *_pythonpath()]))


@pytest.mark.parametrize("count", [1, 0])
def test_a_real_torch_npu_is_never_shadowed(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, count: int
) -> None:
    _torch_npu_on_the_path(pytester, monkeypatch, REAL_TORCH_NPU.format(count=count))
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = runpytest_forked(pytester, "--gradref-simulate=npu")
    # The message first: a usage error of another kind (the plugin lost, an unknown option)
    # has the same exit status.
    result.stderr.fnmatch_lines(
        [
            "ERROR: --gradref-simulate=npu refused: a real torch_npu is installed and imports "
            f"({count} NPU device(s) visible)*"
        ]
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR


@needs_simulation
def test_a_torch_npu_that_cannot_import_is_simulated(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A broken installation has nothing real to shadow: the simulation installs over it.
    _torch_npu_on_the_path(pytester, monkeypatch, "raise ImportError('libascendcl.so missing')\n")
    pytester.makepyfile(
        """
import sys


def test_simulated(gradref_device):
    assert gradref_device.type == "npu" and sys.modules["torch_npu"].simulated
"""
    )
    result = runpytest_forked(pytester, *SIM)
    result.assert_outcomes(passed=1)


def _pythonpath() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def test_older_torch_is_a_usage_error(pytester: pytest.Pytester) -> None:
    # A plugin loaded before gradref's configure hides the API that torch < 2.10 lacks, so
    # this runs on every torch (on an old one the API is missing already).
    pytester.makepyfile(
        hide_api="import torch.utils.backend_registration as registration\n"
        "vars(registration).pop('_setup_privateuseone_for_python_backend', None)\n",
        test_nothing="def test_nothing():\n    pass\n",
    )
    result = runpytest_forked(pytester, "-p", "hide_api", "--gradref-simulate=npu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --gradref-simulate=npu: the simulated npu needs torch 2.10 or later (a "
            f"Python-registered PrivateUse1 device guard), this is torch {torch.__version__}. "
            "Install torch>=2.10, or run without --gradref-simulate (and unset GRADREF_SIMULATE)."
        ]
    )


@pytest.mark.parametrize("source", ["cli", "env", "ini"])
def test_unknown_simulate_value(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    # Rejected before anything is installed, so an in-process run is safe.
    pytester.makepyfile("def test_nothing():\n    pass\n")
    args: list[str] = []
    if source == "cli":
        args, where = ["--gradref-simulate=cuda"], "the --gradref-simulate option"
    elif source == "env":
        monkeypatch.setenv("GRADREF_SIMULATE", "cuda")
        where = "the GRADREF_SIMULATE environment variable"
    else:
        pytester.makeini("[pytest]\ngradref_simulate = cuda\n")
        where = "the gradref_simulate ini key in tox.ini"
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: Invalid gradref simulate value 'cuda' from {where}; valid values are npu or none"]
    )


def test_device_count_follows_ascend_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    # The count alone, without installing anything in this process.
    monkeypatch.setitem(simulated_devices._installed, "count", 4)
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    assert simulated_devices.device_count() == 4
    for visible, count in (("2,3", 2), ("3", 1), ("", 0), ("1,7,2", 1), ("0,1,2,3", 4)):
        monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", visible)
        assert simulated_devices.device_count() == count, visible


OTHER_LIBRARIES = """
import pytest
import torch
import torch_npu
import transformers
from pytest_gradref.devices.simulated_devices import SimulatedDeviceError
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import is_torch_npu_available


def test_transformers_sees_an_npu_and_imports_its_npu_branch():
    assert is_torch_npu_available() and is_torch_npu_available(check_device=True)
    # Imported only where transformers sees an npu: `from torch_npu import npu_fusion_attention`.
    from transformers.integrations import npu_flash_attention

    with pytest.raises(SimulatedDeviceError, match="npu_fusion_attention is not simulated"):
        npu_flash_attention.npu_fusion_attention(None)
    with pytest.raises(AttributeError, match="has no attribute 'contrib'"):
        torch_npu.contrib


def test_a_transformers_model_trains_on_the_second_device():
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).to("npu:1")
    ids = torch.randint(0, 64, (2, 6)).to("npu:1")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert loss.device == model.model.embed_tokens.weight.grad.device == torch.device("npu", 1)


def test_cpu_indices_where_cuda_takes_them(gradref_device):
    x = torch.arange(12.0, device=gradref_device).reshape(3, 4)
    rows, mask = torch.tensor([0, 2]), torch.tensor([True, False, True])
    assert x[rows].device == x[mask].device == gradref_device
    assert x[rows, rows].cpu().tolist() == [0.0, 10.0]
    x[rows] = 5.0
    x.index_put_((rows,), torch.ones(2, 4, device=gradref_device), accumulate=True)
    assert x.cpu()[:, 0].tolist() == [6.0, 4.0, 6.0]
    # Where CUDA checks the index's device, the simulation refuses a CPU index too.
    for refused in (
        lambda: torch.index_select(x, 0, rows),
        lambda: x.gather(0, torch.zeros(1, 4, dtype=torch.long)),
        lambda: x.masked_fill(mask[:, None], 0.0),
        lambda: x.index_put_((rows,), torch.ones(2, 4)),  # values on the CPU
    ):
        with pytest.raises(SimulatedDeviceError, match="same device"):
            refused()


def test_compiled_code_runs_eagerly(gradref_device):
    from torch._dynamo.utils import counters

    compiled = torch.compile(lambda x: (x * 2).relu().sum())
    for rows in range(1, 12):  # more shapes than Dynamo's recompile limit (8)
        out = compiled(torch.randn(rows, 3, device=gradref_device))
    assert out.device == gradref_device
    # The frame was skipped once, as a whole, and the simulation's own code never traced.
    assert counters["frames"]["total"] == 1
    assert not any("simulated.py" in reason for reason in counters["unimplemented"])
"""


@needs_simulation
def test_other_libraries_live_with_the_simulation(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(OTHER_LIBRARIES)
    result = runpytest_forked(pytester, *SIM)
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        [
            "gradref: device=npu:0 (simulated on CPU; *) * | simulated: torch.compile runs "
            "simulated tensors eagerly (Dynamo cannot trace them; fullgraph=True raises)"
        ]
    )
    result.stdout.no_fnmatch_line("*recompile_limit*")


# Test utilities that a conftest imports and that probe for the device at import time, as a
# kernel library's do (transformers caches is_torch_npu_available() on its first call).
PROBE_AT_IMPORT = """
import importlib.util

import torch
from transformers.utils import is_torch_npu_available

if importlib.util.find_spec("torch_npu") is not None:
    import torch_npu  # noqa: F401

SEEN = {"torch.npu": hasattr(torch, "npu") and torch.npu.is_available(),
        "transformers": is_torch_npu_available()}
"""


@needs_simulation
@pytest.mark.parametrize(
    ("source", "xdist", "expected"),
    [("option", False, True), ("env", False, True), ("env", True, True), ("none", False, False)],
)
def test_conftest_imports_see_the_simulated_npu(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    source: str,
    xdist: bool,
    expected: bool,
) -> None:
    pytester.makepyfile(
        probe_utils=PROBE_AT_IMPORT,
        conftest="import probe_utils\n\nSEEN_BY_CONFTEST = dict(probe_utils.SEEN)\n",
        test_probe=f"""
import pytest
from transformers.utils import is_torch_npu_available

from conftest import SEEN_BY_CONFTEST


@pytest.mark.parametrize("i", range(2))
def test_the_conftest_saw_the_device(i):
    assert SEEN_BY_CONFTEST == {{"torch.npu": {expected}, "transformers": {expected}}}
    assert is_torch_npu_available() is {expected}
""",
    )
    args = ["-p", "no:randomly", *(("-n", "2") if xdist else ())]
    monkeypatch.delenv("GRADREF_SIMULATE", raising=False)
    if source == "option":
        args.append("--gradref-simulate=npu")
    else:  # the environment variable, which --gradref-simulate=none overrides
        monkeypatch.setenv("GRADREF_SIMULATE", "npu")
        args += ["--gradref-simulate=none"] if source == "none" else []
    result = runpytest_forked(pytester, *args)
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*installed after*")


# A plugin loaded before gradref's hooks run, which imports torch and probes at import time.
EARLY_PLUGIN = """
import torch
from transformers.utils import is_torch_npu_available

FIRST_ANSWER = is_torch_npu_available()
"""


@needs_simulation
def test_a_probe_before_the_install_is_named_at_the_start(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        early_plugin=EARLY_PLUGIN,
        test_probe="""
import early_plugin
from transformers.utils import is_torch_npu_available


def test_the_cached_probe_was_cleared():
    assert early_plugin.FIRST_ANSWER is False and is_torch_npu_available() is True
""",
    )
    # A new interpreter: what this checks is the order of imports in one.
    result = pytester.runpytest_subprocess("-p", "early_plugin", "-p", "no:randomly", *SIM)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "gradref: torch was imported (by early_plugin) before the simulated npu was "
            "installed: an npu probe that ran then (import torch_npu, torch.npu.is_available()) "
            "saw none; --gradref-strict-device fails a run whose tests never used the npu",
            "gradref: transformers.utils.import_utils.is_torch_npu_available() had run before "
            "the simulated npu was installed and was cleared: later calls see it, values "
            "computed from the first call do not",
            "collected 1 item",
            "test_probe.py .*",
        ]
    )


@needs_simulation
def test_a_plugin_loaded_by_a_conftest_says_it_came_late(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        conftest='pytest_plugins = ["pytest_gradref.plugin"]\n',
        test_late="import torch\n\n\ndef test_npu():\n    assert torch.npu.is_available()\n",
    )
    # A new interpreter: what this checks is the order of imports in one.
    result = pytester.runpytest_subprocess("-p", "no:gradref", "-p", "no:randomly", *SIM)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "gradref: the simulated npu was installed after the initial conftests had been "
            "imported (the gradref plugin was loaded late, from a conftest's pytest_plugins?): "
            "an npu probe they ran saw none",
            "collected 1 item",
        ]
    )
