"""Golden references and error budgets (issue: precision you can trust)."""

from __future__ import annotations

import pytest

KERNELS = """
import pytest
import torch


def reference_loss(x, w):
    # Plain PyTorch in the inputs' dtype: in bf16 its log_softmax rounds at every step.
    return torch.log_softmax(x @ w.T, dim=-1).square().mean()


def careful_kernel(x, w):
    # What a good fused kernel does: bf16 inputs, fp32 math, bf16 gradients.
    x32 = x.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    loss = torch.log_softmax(x32 @ w32.T, dim=-1).square().mean()
    loss.backward()
    return loss, x32.grad.to(x.dtype), w32.grad.to(w.dtype)


def inputs(device):
    x = torch.randn(64, 96, device=device, dtype=torch.bfloat16)
    w = torch.randn(200, 96, device=device, dtype=torch.bfloat16) / 4
    return x, w
"""


def test_careful_kernel_fails_plain_tolerance_but_passes_budget(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        KERNELS
        + """
def test_plain_tolerance_is_too_tight(grad_reference, gradref_device):
    x, w = inputs(gradref_device)
    ref = grad_reference(reference_loss, x, w, argnums=(0, 1))
    value, gx, gw = careful_kernel(x, w)
    with pytest.raises(AssertionError, match="bfloat16") as failure:
        ref.assert_close(value, (gx, gw))
    assert "gradient of argument" in str(failure.value)


def test_budget_two_passes(grad_reference, gradref_device):
    x, w = inputs(gradref_device)
    ref = grad_reference(reference_loss, x, w, argnums=(0, 1), golden=torch.float64)
    assert ref.golden is not None and ref.golden.dtype == torch.float64
    assert ref.golden.value.dtype == torch.float64
    value, gx, gw = careful_kernel(x, w)
    ref.assert_close(value, (gx, gw), budget=2)


@pytest.mark.gradref(golden=torch.float64, budget=2)
def test_budget_from_marker(grad_reference, gradref_device):
    x, w = inputs(gradref_device)
    ref = grad_reference(reference_loss, x, w, argnums=(0, 1))
    value, gx, gw = careful_kernel(x, w)
    ref.assert_close(value, (gx, gw))
"""
    )
    # The plain tolerance is the tolerance verdict's; the default verdict's budget of 2 passes
    # the careful kernel with no argument (test_verdict.py).
    result = pytester.runpytest("-p", "no:randomly", "--gradref-verdict=tolerance")
    result.assert_outcomes(passed=3)


def test_five_percent_gradient_error_fails_the_budget(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        KERNELS
        + """
def test_buggy(grad_reference, gradref_device):
    x, w = inputs(gradref_device)
    ref = grad_reference(reference_loss, x, w, argnums=(0, 1), golden=torch.float64)
    value, gx, gw = careful_kernel(x, w)
    ref.assert_close(value, (gx, gw * 1.05), budget=2)
"""
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*1 of 3 items differ*",
            "*gradient of argument 1 (w)*",
            "*greatest error vs the float64 golden:*x the bfloat16 reference's own *"
            "allowed: budget 2 x*+ floor*",
            "*normwise error vs the float64 golden:*x the bfloat16 reference's own *"
            "allowed: budget 2 x*+ floor*",
        ]
    )
    result.stdout.no_fnmatch_line("*gradient of argument 0 (x):*")


def test_budget_needs_a_golden(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest
import torch

def test_no_golden(grad_reference):
    x = torch.randn(4, dtype=torch.float64)
    ref = grad_reference(lambda t: t.sin().sum(), x)
    needs_golden = r"budget=2\\) needs a golden reference.*golden=torch.float64"
    with pytest.raises(ValueError, match=needs_golden):
        ref.assert_close(x.sin().sum(), x.cos(), budget=2)
    with pytest.raises(ValueError, match="either budget= or rtol="):
        ref.assert_close(x.sin().sum(), x.cos(), budget=2, rtol=1e-3)
    with pytest.raises(ValueError, match="budget must be a number > 0"):
        grad_reference(lambda t: t.sin().sum(), x, golden=torch.float64).assert_close(
            x.sin().sum(), x.cos(), budget=0
        )

def test_golden_must_be_more_precise(grad_reference):
    x = torch.randn(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="less precise than argument 0"):
        grad_reference(lambda t: t.sum(), x, golden=torch.float32)
    with pytest.raises(TypeError, match="floating torch.dtype"):
        grad_reference(lambda t: t.sum(), x, golden="float64")
"""
    )
    pytester.runpytest().assert_outcomes(passed=2)


def test_a_budget_under_the_tolerance_verdict_skips_with_one_reason(
    pytester: pytest.Pytester,
) -> None:
    """--gradref-verdict=tolerance turns the default golden off, so a check that asks for a
    budget cannot be made: its test is skipped, every such test with the same reason (one line
    under -rs), where it used to error test by test; the default verdict runs them all."""
    budget_test = """
def test_budget_{name}(grad_reference):
    x = torch.randn(8)
    ref = grad_reference(lambda t: t.sin().sum(), x)
    ref.assert_close(x.sin().sum(), x.cos(), budget=4)
"""
    pytester.makepyfile(
        "import torch\n"
        + budget_test.format(name="a")
        + budget_test.format(name="b")
        + """
def test_tolerance(grad_reference):
    x = torch.randn(8)
    ref = grad_reference(lambda t: t.sin().sum(), x)
    ref.assert_close(x.sin().sum(), x.cos())
"""
    )
    result = pytester.runpytest("-rs", "--gradref-verdict=tolerance")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED [[]2[]] *verdict?criterion.py:*: assert_close(budget=...) needs the float64 "
            "golden, which --gradref-verdict=tolerance from the --gradref-verdict option turns "
            "off; run without it to check these tests"
        ]
    )
    pytester.runpytest().assert_outcomes(passed=3)


def test_marker_budget_without_golden_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gradref(budget=2)
def test_x(grad_reference):
    pass
"""
    )
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_x*budget= without golden=*golden=torch.float64*"])


def test_golden_goes_to_cpu_where_the_backend_cannot_compute_it(pytester: pytest.Pytester) -> None:
    # A policy that lists float64 as CPU-only: its golden lands on the CPU, and the budget
    # check still compares across devices (here all CPU, but the golden's device is asserted).
    pytester.makeconftest(
        """
from pytest_gradref import builtin_backend

def pytest_gradref_register_backends(registry):
    npu = builtin_backend("npu").replace(device_type="cpu", probe=lambda: None)
    registry.register(npu)
"""
    )
    pytester.makepyfile(
        """
import torch

def test_golden_on_cpu(grad_reference, gradref_backend):
    assert "float64" in gradref_backend.cpu_only_dtypes
    x = torch.randn(8, dtype=torch.float32)
    ref = grad_reference(lambda t: (t * t).sum(), x, golden=torch.float64)
    assert ref.strategy == "grad_and_value"
    assert ref.golden.device == torch.device("cpu")
    assert torch.equal(ref.golden.arg_grads[0], 2 * x.double())
    ref.assert_close((x * x).sum(), 2 * x, budget=1)
"""
    )
    pytester.runpytest("--gradref-device=npu").assert_outcomes(passed=1)


def test_golden_for_modules_upcasts_parameters(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_scalar="""
import torch

class Loss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.layer(x).square().mean()

def test_module(grad_reference):
    net = Loss().to(torch.bfloat16)
    x = torch.randn(5, 6, dtype=torch.bfloat16)
    ref = grad_reference(net, x, argnums=0, golden=torch.float64)
    assert ref.golden.param_grads["layer.weight"].dtype == torch.float64
    assert net.layer.weight.dtype == torch.bfloat16 and net.layer.weight.grad is None
    out = net(x.requires_grad_())
    out.backward()
    ref.assert_close(out, x.grad, param_grads=net, budget=4)
"""
    )
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)


INFINITIES = """
import math

import pytest
import torch


def log_loss(x):
    return torch.log(x).sum()


def kernel(x):
    # The same loss in float32 math: -inf where x is 0, and an infinite gradient there.
    x32 = x.detach().float().requires_grad_()
    loss = torch.log(x32).sum()
    loss.backward()
    return loss, x32.grad.to(x.dtype)


def inputs(device):
    x = torch.rand(40, device=device, dtype=torch.bfloat16) + 0.5
    x[7] = 0.0
    return x
"""


def test_infinities_matching_the_golden_are_exact(pytester: pytest.Pytester) -> None:
    # log(0) is -inf in the kernel, the reference and the float64 golden, its gradient +inf:
    # matching infinities are exact (as torch.testing has them), not an inf - inf = NaN.
    pytester.makepyfile(
        INFINITIES
        + """
def test_matching(grad_reference, gradref_device):
    x = inputs(gradref_device)
    ref = grad_reference(log_loss, x, golden=torch.float64)
    value, grad = kernel(x)
    assert value == -math.inf and grad[7] == math.inf
    ref.assert_close(value, grad, budget=2)


def test_wrong_sign_fails(grad_reference, gradref_device):
    x = inputs(gradref_device)
    ref = grad_reference(log_loss, x, golden=torch.float64)
    value, grad = kernel(x)
    grad[7] = -math.inf
    with pytest.raises(AssertionError, match=r"error vs the float64 golden: inf at index \\(7,\\)"):
        ref.assert_close(value, grad, budget=2)


def test_nan_names_its_side(grad_reference, gradref_device):
    x = inputs(gradref_device)
    ref = grad_reference(log_loss, x, golden=torch.float64)
    value, grad = kernel(x)
    grad[3] = math.nan
    with pytest.raises(AssertionError) as failure:
        ref.assert_close(value, grad, budget=2)
    message = str(failure.value)
    assert "(the actual result has NaN)" in message
    assert "reference has NaN" not in message and "golden has NaN" not in message
    assert "floor inf" not in message and "x nan" not in message
"""
    )
    pytester.runpytest("-p", "no:randomly").assert_outcomes(passed=3)
