"""The default verdict (``--gradref-verdict=golden``): a float64 golden for every reference of
less precise inputs, a budget of 2 judged greatest and normwise, a floor at the value's
conditioning, and the dtype check; and the tolerance verdict it replaces as the default.

The numerical cases call ``compute_reference`` as the ``grad_reference`` fixture does under
each verdict (``_verdict_calls.reference``); the settings, the marker and the report go through a
pytest run.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch
from _verdict_calls import failure, reference

from pytest_gradref.verdict.budget_item import BudgetItem
from pytest_gradref.verdict.judge import check_items

VERDICTS = ("golden", "tolerance")
F32_EPS = torch.finfo(torch.float32).eps


# --- a systematic error spread thinly over a low-precision gradient -------------------------


def tanh_loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ w.T).sum()


def float32_kernel(
    x: torch.Tensor, w: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tanh_loss in float32 math, each gradient rounded once to the inputs' dtype; ``scale``
    multiplies the weight gradient (in float32, before the rounding)."""
    x32 = x.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    value = tanh_loss(x32, w32)
    value.backward()
    assert x32.grad is not None
    assert w32.grad is not None
    return value, x32.grad.to(x.dtype), (w32.grad * scale).to(w.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_one_percent_scale_error_of_a_weight_gradient_fails(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 48, generator=gen).to(dtype)
    w = (torch.randn(80, 48, generator=gen) / 8).to(dtype)  # 3840 weights
    ref = reference(tanh_loss, x, w, argnums=(0, 1))
    assert ref.golden is not None
    assert ref.golden.dtype == torch.float64
    # More accurate than the plain reference in the inputs' dtype: passes, no tolerance given.
    ref.assert_close(*float32_kernel(x, w)[:1], float32_kernel(x, w)[1:])
    value, grad_x, grad_w = float32_kernel(x, w, scale=1.01)
    message = failure(ref, value, (grad_x, grad_w))
    assert "1 of 3 items differ" in message
    assert "- gradient of argument 1 (w):" in message
    # bf16: every element within a step or two of the golden, as the reference's own are, but
    # the norm of the error 3.4x the reference's (10x in fp16, whose steps are 8x finer).
    assert "normwise error vs the float64 golden" in message
    assert "budget 2 x" in message
    if dtype == torch.bfloat16:
        assert "greatest error vs" not in message


# --- the dtype check ----------------------------------------------------------------------


def float32_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(32, 64, generator=gen), torch.randn(96, 64, generator=gen) / 4


@pytest.mark.parametrize("verdict", VERDICTS)
@pytest.mark.parametrize(
    ("item", "dtype", "label"),
    [(2, torch.bfloat16, "gradient of argument 1 (w)"), (0, torch.float16, "value")],
    ids=["bf16-gradient", "fp16-value"],
)
def test_a_result_less_precise_than_its_reference_fails_on_its_dtype(
    verdict: str, item: int, dtype: torch.dtype, label: str
) -> None:
    x, w = float32_inputs()
    ref = reference(tanh_loss, x, w, argnums=(0, 1), verdict=verdict)
    actual = [ref.value, *ref.grads]
    actual[item] = actual[item].to(dtype)  # the reference's own result, rounded once
    message = failure(ref, actual[0], tuple(actual[1:]))
    name = str(dtype).replace("torch.", "")
    assert (
        f"- {label}:\n    dtype: the result is {name}, less precise than the reference's "
        "float32. A kernel that returns a lower precision on purpose says so with "
        "check_dtype=False"
    ) in message
    assert "1 of 3 items differ" in message


def bf16_gradient_of(
    fn: Callable[..., torch.Tensor], *args: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """fn's gradients computed in bf16 throughout: a deliberately lower-precision kernel."""
    leaves = [a.detach().bfloat16().requires_grad_() for a in args]
    return torch.autograd.grad(fn(*leaves), leaves)


def test_check_dtype_false_judges_at_the_reference_precision() -> None:
    x, w = float32_inputs()
    # The tolerance verdict: float32's tolerance, which a bf16 gradient is far outside.
    ref = reference(tanh_loss, x, w, argnums=(0, 1), verdict="tolerance")
    grad_x, grad_w = ref.grads
    message = failure(ref, ref.value, (grad_x, grad_w.bfloat16()), check_dtype=False)
    assert "- gradient of argument 1 (w):\n    Tensor-likes are not close!" in message
    assert "tolerance rtol=1.3e-06, atol=1e-05 from torch.testing's default for float32" in message
    # The default verdict: the float32 budget, with a floor of the result's own rounding (no
    # bf16 result is nearer than half a step): the float32 gradient rounded once to bf16 is
    # within it, a gradient computed in bf16 is not.
    ref = reference(tanh_loss, x, w, argnums=(0, 1))
    grad_x, grad_w = ref.grads
    ref.assert_close(ref.value, (grad_x, grad_w.bfloat16()), check_dtype=False)
    _, bf16_grad_w = bf16_gradient_of(tanh_loss, x, w)
    message = failure(ref, ref.value, (grad_x, bf16_grad_w), check_dtype=False)
    assert "- gradient of argument 1 (w):\n    greatest error vs the float64 golden" in message
    assert "the float32 reference's own" in message
    assert "the bfloat16 result's own rounding" in message
    with pytest.raises(TypeError, match="check_dtype must be True or False, got 0"):
        ref.assert_close(ref.value, ref.grads, check_dtype=0)  # type: ignore[arg-type]


# --- sums in other orders: the floor at the value's conditioning ----------------------------


def blocked_sum(t: torch.Tensor, block: int) -> torch.Tensor:
    """A sum of partial sums of ``block`` consecutive terms (zero-padded)."""
    padded = torch.cat([t, t.new_zeros((-t.numel()) % block)])
    return padded.view(-1, block).sum(1).sum()


def summed(t: torch.Tensor) -> torch.Tensor:
    return t.sum()


def sum_terms(n: int, kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    if kind == "positive":
        return torch.rand(n, generator=gen)
    # Mixed signs that cancel: pairs of terms of about +-1000 whose sum is of order one.
    big = torch.randn(n // 2, generator=gen) * 1000
    pairs = torch.cat([big, -big + torch.randn(n // 2, generator=gen)])
    return pairs[torch.randperm(n, generator=gen)]


SUMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "blocks-of-7": lambda t: blocked_sum(t, 7),
    "blocks-of-64": lambda t: blocked_sum(t, 64),
    "blocks-of-4096": lambda t: blocked_sum(t, 4096),
    "reversed": lambda t: t.flip(0).sum(),
}


@pytest.mark.parametrize("kind", ["positive", "cancelling"])
@pytest.mark.parametrize("n", [10**4, 10**5, 10**6])
def test_float32_sums_in_other_blockings_pass(n: int, kind: str) -> None:
    x = sum_terms(n, kind)
    ref = reference(summed, x)
    assert ref.golden is not None
    for name, kernel in SUMS.items():
        try:
            ref.assert_close(kernel(x), torch.ones_like(x))
        except AssertionError as error:
            raise AssertionError(f"the sum {name}: {error}") from None


# Inductor's first import loads torch modules that still define TorchScript methods.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_compiled_sum_passes() -> None:
    x = sum_terms(10**6, "positive")
    ref = reference(summed, x)
    compiled = torch.compile(summed, dynamic=False)
    ref.assert_close(compiled(x), torch.ones_like(x))


@pytest.mark.parametrize("n", [10**4, 10**6])
def test_a_relative_error_of_1e_4_on_a_sum_fails(n: int) -> None:
    x = sum_terms(n, "positive")
    ref = reference(summed, x)
    message = failure(ref, blocked_sum(x, 64) * (1 + 1e-4), torch.ones_like(x))
    assert "1 of 2 items differ" in message
    assert "- value:\n    greatest error vs the float64 golden" in message


def paired_loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum(x * w) with the terms of each +-pair added first: the accurate order."""
    return (x * w).view(2, -1).sum(0).sum()


def halves_kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same sum in another order: all the positive terms, then all the negative ones."""
    terms = x * w
    half = terms.numel() // 2
    return terms[:half].sum() + terms[half:].sum()


def test_a_loss_whose_terms_cancel_passes_on_the_conditioning_floor() -> None:
    # 2048 pairs of terms of about +-1000 that cancel to a loss of 66.58 (float64). The
    # reference adds each pair first and errs by 5e-7; the kernel adds each sign's 2048 terms,
    # of about 45000 in all, then the two: it errs by 7.6e-3, a float32 rounding of the
    # partial sums. A floor at |golden| would allow 2 x 5e-7 + 16 x 1.19e-7 x 66.58 = 1.3e-4,
    # 60 times too little; the floor at the value's first-order terms, sum |x * w| = 3.3e6,
    # allows 2 x 5e-7 + 16 x 1.19e-7 x 3.3e6 = 6.3.
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(2048, generator=gen) * 1000
    x = torch.cat([big, big + torch.randn(2048, generator=gen)])
    w = torch.cat([torch.ones(2048), -torch.ones(2048)])
    ref = reference(paired_loss, x, w)
    assert ref.golden is not None
    golden = float(ref.golden.value)
    condition = float((x.double() * w.double()).abs().sum())  # the first-order terms
    value = halves_kernel(x, w)
    error = abs(float(value.double()) - golden)
    reference_error = abs(float(ref.value.double()) - golden)
    assert error > 10 * (2 * reference_error + 16 * F32_EPS * abs(golden))
    assert error < 2 * reference_error + 16 * F32_EPS * condition
    ref.assert_close(value, w)
    # The same item with no condition: the floor at |golden| fails it.
    (check,) = check_items([BudgetItem("value", value, ref.value, ref.golden.value, 2.0)])
    assert not check.passed


def sqrt_below(t: torch.Tensor) -> torch.Tensor:
    return (t - 1).sqrt().sum()


@pytest.mark.parametrize(
    ("fn", "x"),
    [
        (sqrt_below, torch.tensor([1.0, 2.0, 3.0, 5.0])),  # x * dvalue/dx = 1 * inf = inf
        (lambda t: t.sqrt().sum(), torch.tensor([0.0, 1.0, 4.0])),  # 0 * inf = NaN
    ],
    ids=["inf", "nan"],
)
def test_a_non_finite_first_order_term_sets_no_scale(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> None:
    # A finite value with an infinite derivative somewhere: its term may make the value's floor
    # neither infinite (any value would pass) nor NaN (none would).
    ref = reference(fn, x)
    assert ref.golden is not None
    assert ref.golden.value_condition is not None
    assert bool(torch.isfinite(ref.golden.value_condition).all())
    message = failure(ref, ref.value * 1.1, ref.grads)
    assert "- value:" in message
    assert "- gradient" not in message


# --- which references get a golden, and which rule judges them ----------------------------


def test_the_tolerance_verdict_computes_no_golden() -> None:
    x = torch.randn(8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    ref = reference(lambda t: t.float().sin().sum(), x, verdict="tolerance")
    assert ref.golden is None
    message = failure(ref, ref.value * 1.1, ref.grads)
    assert "tolerance rtol=0.016, atol=1e-05 from torch.testing's default for bfloat16" in message


@pytest.mark.parametrize("verdict", VERDICTS)
def test_float64_inputs_get_no_golden(verdict: str) -> None:
    x = torch.randn(8, dtype=torch.float64)
    ref = reference(lambda t: t.sin().sum(), x, verdict=verdict)
    assert ref.golden is None
    message = failure(ref, ref.value + 1e-3, ref.grads)
    assert "from torch.testing's default for float64" in message


def test_an_explicit_tolerance_is_used_beside_the_default_golden() -> None:
    x = torch.randn(8, generator=torch.Generator().manual_seed(3))
    ref = reference(lambda t: t.sin().sum(), x)
    assert ref.golden is not None
    ref.assert_close(ref.value, ref.grads * 1.001, rtol=2e-3, atol=0.0)
    message = failure(ref, ref.value, ref.grads * 1.01, rtol=2e-3, atol=0.0)
    assert "tolerance rtol=0.002, atol=0 from the assert_close() arguments" in message


def upcast_exp(t: torch.Tensor) -> torch.Tensor:
    # float32 inside, float64 for the golden (promote_types, not .float())
    return t.to(torch.promote_types(t.dtype, torch.float32)).exp().sum()


def test_the_default_golden_serves_a_rounded_reference() -> None:
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(4)).bfloat16()
    ref = reference(upcast_exp, x, rounded=True)
    assert ref.golden is not None
    assert ref.golden.value.dtype == torch.float64
    assert ref.rounded is not None
    ref.assert_close(ref.value, ref.grads)
    with pytest.raises(ValueError, match="rounded=True needs a golden reference"):
        reference(upcast_exp, x, verdict="tolerance", rounded=True)


@pytest.mark.parametrize("verdict", VERDICTS)
def test_a_reference_that_detaches_its_input_is_named(verdict: str) -> None:
    def detaching(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.detach() * w).square().sum() + w.sum()

    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(8, generator=gen), torch.randn(8, generator=gen)
    ref = reference(detaching, x, w, argnums=(0, 1), verdict=verdict)
    assert not torch.any(ref.grads[0] != 0)
    message = failure(ref, ref.value, (2 * x * w * w, 2 * x * x * w + 1))
    assert "1 of 3 items differ" in message
    assert "- gradient of argument 0 (x):" in message
    assert (
        "the reference is all zero: does the reference function use this input "
        "differentiably (no .detach(), .item(), .numpy() or integer casts on its path)?"
    ) in message


# --- through pytest: the setting, the marker, the report -----------------------------------

EXPECTING = """
import os

import pytest
import torch

TOLERANCE = os.environ["EXPECT_VERDICT"] == "tolerance"


def test_bf16_and_float32_inputs(grad_reference):
    for dtype in (torch.bfloat16, torch.float32):
        ref = grad_reference(lambda t: t.sin().sum(), torch.randn(4, dtype=dtype))
        assert (ref.golden is None) == TOLERANCE
        assert TOLERANCE or ref.golden.dtype == torch.float64


def test_float64_inputs(grad_reference):
    assert grad_reference(lambda t: t.sin().sum(), torch.randn(4).double()).golden is None


@pytest.mark.gradref(rtol=1e-3)
def test_a_marker_tolerance_needs_no_golden(grad_reference):
    assert grad_reference(lambda t: t.sin().sum(), torch.randn(4)).golden is None
"""


@pytest.mark.parametrize(
    ("cli", "env", "ini", "verdict"),
    [
        pytest.param(None, None, None, "golden", id="default"),
        pytest.param("tolerance", None, None, "tolerance", id="cli"),
        pytest.param(None, "tolerance", None, "tolerance", id="env"),
        pytest.param(None, None, "tolerance", "tolerance", id="ini"),
        pytest.param("golden", "tolerance", "tolerance", "golden", id="cli-over-env-and-ini"),
        pytest.param(None, "golden", "tolerance", "golden", id="env-over-ini"),
    ],
)
def test_the_verdict_from_each_source(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    cli: str | None,
    env: str | None,
    ini: str | None,
    verdict: str,
) -> None:
    pytester.makepyfile(EXPECTING)
    if ini is not None:
        pytester.makeini(f"[pytest]\ngradref_verdict = {ini}\n")
    if env is not None:
        monkeypatch.setenv("GRADREF_VERDICT", env)
    monkeypatch.setenv("EXPECT_VERDICT", verdict)
    args = [] if cli is None else [f"--gradref-verdict={cli}"]
    result = pytester.runpytest("--gradref-device=cpu", "-p", "no:randomly", *args)
    result.assert_outcomes(passed=3)


@pytest.mark.parametrize(
    ("source", "where"),
    [
        ("cli", "the --gradref-verdict option"),
        ("env", "the GRADREF_VERDICT environment variable"),
        ("ini", "the gradref_verdict ini key in tox.ini"),
    ],
)
def test_an_invalid_verdict_is_a_usage_error_naming_its_source(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str, where: str
) -> None:
    pytester.makepyfile("def test_nothing():\n    pass\n")
    args = []
    if source == "cli":
        args = ["--gradref-verdict=loose"]
    elif source == "env":
        monkeypatch.setenv("GRADREF_VERDICT", "loose")
    else:
        pytester.makeini("[pytest]\ngradref_verdict = loose\n")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: Invalid gradref verdict 'loose' from {where}; valid values are golden, tolerance"]
    )


LOWER_PRECISION = """
import pytest
import torch


def loss(x, w):
    return torch.tanh(x @ w.T).sum()


def rounding_kernel(x, w):
    # float32 math from float32 inputs, its gradients returned in bf16 (rounded once), on
    # purpose: half the memory.
    leaves = [t.detach().requires_grad_() for t in (x, w)]
    value = loss(*leaves)
    value.backward()
    return value, leaves[0].grad.bfloat16(), leaves[1].grad.bfloat16()


def bf16_kernel(x, w):
    # Computes in bf16 throughout, on purpose; returns its loss in float32.
    leaves = [t.detach().bfloat16().requires_grad_() for t in (x, w)]
    value = loss(*leaves)
    value.backward()
    return value.float(), leaves[0].grad, leaves[1].grad


def inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(32, 64, generator=gen), torch.randn(96, 64, generator=gen) / 4


def test_fails_on_its_dtype(grad_reference):
    x, w = inputs()
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    value, grad_x, grad_w = rounding_kernel(x, w)
    ref.assert_close(value, (grad_x, grad_w))


@pytest.mark.gradref(check_dtype=False)
def test_judged_at_float32(grad_reference):
    x, w = inputs()
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    value, grad_x, grad_w = bf16_kernel(x, w)
    ref.assert_close(value, (grad_x, grad_w))


@pytest.mark.gradref(rtol=1e-2, atol=1e-5, check_dtype=False)
def test_judged_by_its_own_tolerance(grad_reference):
    x, w = inputs()
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    assert ref.golden is None
    value, grad_x, grad_w = rounding_kernel(x, w)
    ref.assert_close(value, (grad_x, grad_w))
"""

BAD_MARKER = """
import pytest


@pytest.mark.gradref(check_dtype="no")
def test_bad_marker(grad_reference):
    pass
"""


def test_the_marker_check_dtype(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_lower=LOWER_PRECISION, test_bad=BAD_MARKER)
    result = pytester.runpytest("--gradref-device=cpu", "-p", "no:randomly", "test_lower.py")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*_ test_fails_on_its_dtype _*",
            "E * 2 of 3 items differ",
            "E * - gradient of argument 0 (x):",
            "E * dtype: the result is bfloat16, less precise than the reference's float32.*",
            "*_ test_judged_at_float32 _*",
            "E * - gradient of argument 0 (x):",
            "E * greatest error vs the float64 golden: *the float32 reference's own*",
        ]
    )
    result = pytester.runpytest("--gradref-device=cpu", "test_bad.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*check_dtype='no'; it must be True or False*"])


REPORTED = """
import pytest
import torch


def test_budget_items(grad_reference):
    x = torch.linspace(-1.0, 2.0, 64)
    ref = grad_reference(lambda t: t.square().sum(), x)
    ref.assert_close(ref.value, 2 * x * 1.01)
"""


def test_the_report_records_the_normwise_error_and_the_scale(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(REPORTED)
    result = pytester.runpytest("--gradref-device=cpu", "--gradref-report=report.json")
    result.assert_outcomes(failed=1)
    (record,) = json.loads((pytester.path / "report.json").read_text())["tests"]
    value, gradient = record["items"]
    x = torch.linspace(-1.0, 2.0, 64).double()
    # The value's scale: the larger of |golden| and its first-order terms sum |x * 2x|.
    assert value["scale"] == pytest.approx(float(2 * x.square().sum()), rel=1e-6)
    assert value["passed"]
    assert 0 <= value["norm_rel"] < 1e-6
    # The gradient 1% off everywhere: ||a - g|| / ||g|| = 0.01; scale max |2x| = 4.
    assert not gradient["passed"]
    assert gradient["norm_rel"] == pytest.approx(0.01, rel=1e-4)
    assert gradient["scale"] == pytest.approx(4.0)
    assert all(i["criterion"].startswith("budget 2x") for i in (value, gradient))
