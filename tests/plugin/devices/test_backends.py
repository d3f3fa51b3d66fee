"""Backend policies: the strategy each one picks, third-party backends through the hook, and
overriding a built-in just by registering its name.

On CPU both strategies give bit-identical numbers, so which one ran is asserted on
``Reference.strategy`` in the generated tests.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

STRATEGY_PROBE = """
import pytest
import torch


def loss(x, w):
    return torch.tanh(x @ w).square().sum()


def test_strategy(grad_reference, gradref_backend, gradref_device):
    x = torch.randn(4, 3, device=gradref_device)
    w = torch.randn(3, 2, device=gradref_device)
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    assert ref.backend == gradref_backend.name == "{backend}"
    assert ref.strategy == "{strategy}"
    assert ref.crosscheck is None
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = loss(xx, ww)
    out.backward()
    ref.assert_close(out, (xx.grad, ww.grad))


@pytest.mark.gradref(strategy="crosscheck")
def test_crosscheck_reports_the_backend_default(grad_reference, gradref_device):
    x = torch.randn(4, 3, device=gradref_device)
    w = torch.randn(3, 2, device=gradref_device)
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    assert ref.strategy == "{strategy}"
    assert [d.label for d in ref.crosscheck] == [
        "value", "gradient of argument 0 (x)", "gradient of argument 1 (w)"
    ]
"""


def test_cpu_policy_uses_autograd(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(STRATEGY_PROBE.format(backend="cpu", strategy="autograd"))
    result = pytester.runpytest("--gradref-device=cpu")
    result.stdout.fnmatch_lines(["gradref: device=cpu (*) strategy=autograd (cpu default)*"])
    result.assert_outcomes(passed=2)


def test_npu_policy_on_cpu_tensors_uses_grad_and_value(
    pytester: pytest.Pytester, npu_on_cpu: Callable[[str], None]
) -> None:
    npu_on_cpu("")
    pytester.makepyfile(STRATEGY_PROBE.format(backend="npu", strategy="grad_and_value"))
    pytester.makepyfile(
        test_policy="""
import torch

def test_policy(gradref_backend, gradref_device):
    assert gradref_backend.name == "npu"
    assert gradref_backend.default_strategy == "grad_and_value"
    assert gradref_backend.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert gradref_device == torch.device("cpu")
"""
    )
    result = pytester.runpytest("--gradref-device=npu")
    result.stdout.fnmatch_lines(
        ["gradref: device=npu:0 on cpu (*) strategy=grad_and_value (npu default)*"]
    )
    result.assert_outcomes(passed=3)


THIRD_PARTY = """
from pytest_gradref import Backend, Tolerance

def pytest_gradref_register_backends(registry):
    registry.register(
        Backend(
            name="gizmo",
            device_type="cpu",
            default_strategy="grad_and_value",
            tolerances={"float32": Tolerance(rtol=1e-4, atol=1e-5)},
            auto_rank=0,
        )
    )
"""


def test_third_party_backend_with_a_new_name(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(THIRD_PARTY)
    pytester.makepyfile(STRATEGY_PROBE.format(backend="gizmo", strategy="grad_and_value"))
    pytester.makepyfile(
        test_marks="""
import pytest

@pytest.mark.gradref_xfail("gizmo", reason="gizmo rounding")
def test_marked(grad_reference):
    assert False
"""
    )
    # auto_rank=0 puts it ahead of every built-in, so auto picks it on any machine.
    result = pytester.runpytest("-rx")
    result.stdout.fnmatch_lines(
        [
            "gradref: device=gizmo:0 on cpu (*; auto: first available) "
            "strategy=grad_and_value (gizmo default)*",
        ]
    )
    result.stdout.fnmatch_lines(["XFAIL *::test_marked - [[]gradref gizmo[]] gizmo rounding"])
    result.assert_outcomes(passed=2, xfailed=1)
    # The built-ins are still there next to it.
    cpu = pytester.runpytest("--gradref-device=cpu", "-k", "test_strategy")
    cpu.assert_outcomes(failed=1)
    cpu.stdout.fnmatch_lines(["*assert 'cpu' == 'gizmo'*"])


def test_registering_a_builtin_name_overrides_the_builtin(pytester: pytest.Pytester) -> None:
    # No replace=True: the built-ins arrive last (trylast) and only fill names still free.
    pytester.makeconftest(
        """
from pytest_gradref import Tolerance, builtin_backend

def pytest_gradref_register_backends(registry):
    registry.register(
        builtin_backend("cpu").replace(
            default_strategy="grad_and_value",
            tolerances={"float32": Tolerance(rtol=0.25, atol=0.0)},
        )
    )
"""
    )
    pytester.makepyfile(
        """
import torch

def test_overridden(grad_reference, gradref_backend):
    assert gradref_backend.name == "cpu"
    assert gradref_backend.default_strategy == "grad_and_value"
    x = torch.ones(3)
    ref = grad_reference(lambda t: (t * t).sum(), x)
    assert ref.strategy == "grad_and_value"
    # The overriding policy's tolerance table is the one in force (the tolerance verdict):
    # 20% off passes.
    ref.assert_close(torch.tensor(3.0), 2 * x * 1.2)
"""
    )
    result = pytester.runpytest("--gradref-device=cpu", "--gradref-verdict=tolerance")
    result.stdout.fnmatch_lines(["gradref: device=cpu (*) strategy=grad_and_value (cpu default)*"])
    result.assert_outcomes(passed=1)


def test_installed_plugin_overrides_the_builtin_npu(pytester: pytest.Pytester) -> None:
    # A third-party plugin module (as if installed) rather than a conftest.
    pytester.makepyfile(
        npu_vendor="""
from pytest_gradref import builtin_backend

def pytest_gradref_register_backends(registry):
    registry.register(
        builtin_backend("npu").replace(device_type="cpu", probe=lambda: None, auto_rank=0)
    )
"""
    )
    pytester.syspathinsert()
    pytester.makepyfile(STRATEGY_PROBE.format(backend="npu", strategy="grad_and_value"))
    result = pytester.runpytest("-p", "npu_vendor")
    result.stdout.fnmatch_lines(
        ["gradref: device=npu:0 on cpu (*; auto: first available) strategy=grad_and_value*"]
    )
    result.assert_outcomes(passed=2)


def test_registering_a_name_twice_needs_replace(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        """
from pytest_gradref import Backend

def pytest_gradref_register_backends(registry):
    registry.register(Backend(name="gizmo", device_type="cpu"))
    registry.register(Backend(name="gizmo", device_type="cpu", default_strategy="grad_and_value"))
"""
    )
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest()
    assert result.ret != pytest.ExitCode.OK
    result.stderr.fnmatch_lines(
        [
            "*A gradref backend named 'gizmo' is already registered; pass replace=True to "
            "override it.*"
        ]
    )


def test_backend_policy_rejects_an_unknown_default_strategy(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest
from pytest_gradref import Backend, builtin_backend

def test_policy():
    with pytest.raises(ValueError, match="default_strategy must be one of"):
        Backend(name="x", device_type="cpu", default_strategy="crosscheck")
    with pytest.raises(KeyError, match="no built-in gradref backend named 'tpu'"):
        builtin_backend("tpu")
    assert builtin_backend("npu").default_strategy == "grad_and_value"
    for name in ("cpu", "cuda", "xpu", "mps"):
        assert builtin_backend(name).default_strategy == "autograd"
    assert builtin_backend("cuda").visible_devices_env == "CUDA_VISIBLE_DEVICES"
"""
    )
    pytester.runpytest().assert_outcomes(passed=1)
