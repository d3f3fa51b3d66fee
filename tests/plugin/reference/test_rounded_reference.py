"""The rounded reference: a budget that counts from the reference rounded to the compute dtype.

A reference that computes in float32 from bf16 inputs is far more accurate than a bf16 kernel
that rounds like plain bf16 PyTorch; with ``rounded=True`` the budget counts from the larger
of its error and that of the same computation rounded to bf16 after every operation.
"""

from __future__ import annotations

import json

import pytest
import torch

from pytest_gradref.verdict.budget_item import BudgetItem
from pytest_gradref.verdict.judge import check_items

STRATEGIES = ["autograd", "grad_and_value"]

FUNCTIONS = """
import pytest
import torch


def up(t):
    # float32 inside, as library references compute (promote_types, not .float(): a float64
    # golden stays float64)
    return t.to(torch.promote_types(t.dtype, torch.float32))


def same(t):
    return t


def elementwise(x, w, up=up):
    return (up(x).exp() * up(w).sin().square() + 1).log().sum()


def in_place(x, w, up=up):
    # In-place operations on the result and through views of it (a slice, a transpose and a
    # row), then a split into views.
    y = up(x) * 3
    y[:, 1:].mul_(up(w)[:, 1:].sin().square())
    y.t()[0].add_(1.1)
    first, second = y.split([2, 3], dim=1)
    return first.exp().sum() + (second.square() + 1).log().sum()


def kl(x, w, t, up=up):
    # KL(teacher || student) with the softmax in float32: far more accurate than in bf16.
    student = torch.log_softmax(up(x) @ up(w).T, -1)
    teacher = torch.log_softmax(up(t), -1)
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


def kl_bf16(x, w, t):
    # The same, carried out in the inputs' dtype: a kernel that keeps its logits in bf16.
    return kl(x, w, t, up=same)


def run(fn, *args, trained=2):
    leaves = [a.detach().requires_grad_() for a in args[:trained]]
    value = fn(*leaves, *args[trained:])
    return value, torch.autograd.grad(value, leaves)


def small_inputs():
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(3, 5, generator=gen).bfloat16() for _ in range(2))


def kl_inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=gen)
    w = torch.randn(200, 96, generator=gen) / 4
    teacher = x @ w.T + 0.1 * torch.randn(64, 200, generator=gen)  # close to the student
    return x.bfloat16(), w.bfloat16(), teacher.bfloat16()
"""


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_rounded_reference_is_the_computation_carried_out_in_bf16(
    pytester: pytest.Pytester, strategy: str
) -> None:
    # On this small example, rounding every float32 result to bf16 gives what the same
    # operations give in bf16, bit for bit; the float32 reference's gradients differ.
    pytester.makepyfile(
        FUNCTIONS
        + """
@pytest.mark.parametrize("fn", [elementwise, in_place])
def test_bits(grad_reference, fn):
    x, w = small_inputs()
    ref = grad_reference(fn, x, w, argnums=(0, 1), golden=torch.float64, rounded=True)
    value, grads = run(lambda a, b: fn(a, b, up=same), x, w)
    assert ref.rounded.dtype == torch.bfloat16
    assert ref.rounded.value.dtype == torch.float32  # the reference's dtype, bf16 values
    assert torch.equal(ref.rounded.value, value.float())
    for rounded, plain, bf16 in zip(ref.rounded.arg_grads, ref.grads, grads):
        assert torch.equal(rounded, bf16)
        assert not torch.equal(plain, bf16)
"""
    )
    result = pytester.runpytest("-p", "no:randomly", f"--gradref-strategy={strategy}")
    result.assert_outcomes(passed=2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_bf16_kernel_fails_the_plain_budget_and_passes_the_rounded_one(
    pytester: pytest.Pytester, strategy: str
) -> None:
    pytester.makepyfile(
        FUNCTIONS
        + """
# kl_bf16 returns its loss in bf16, kl in float32: the kernel's lower precision is on purpose.
@pytest.mark.gradref(golden=torch.float64, budget=2, check_dtype=False)
def test_plain(grad_reference):
    x, w, t = kl_inputs()
    ref = grad_reference(kl, x, w, t, argnums=(0, 1))
    assert ref.rounded is None
    value, grads = run(kl_bf16, x, w, t)
    with pytest.raises(AssertionError, match="2 of 3 items differ") as failure:
        ref.assert_close(value, grads)
    # Both gradients; the bf16 loss is within its own rounding of the float32 reference's.
    assert "- value:" not in str(failure.value)


@pytest.mark.gradref(golden=torch.float64, budget=2, rounded=True, check_dtype=False)
def test_rounded_by_marker(grad_reference):
    x, w, t = kl_inputs()
    ref = grad_reference(kl, x, w, t, argnums=(0, 1))
    value, grads = run(kl_bf16, x, w, t)
    ref.assert_close(value, grads)


def test_rounded_by_argument(grad_reference):
    x, w, t = kl_inputs()
    ref = grad_reference(kl, x, w, t, argnums=(0, 1), golden=torch.float64, rounded=True)
    value, grads = run(kl_bf16, x, w, t)
    ref.assert_close(value, grads, budget=2, check_dtype=False)
"""
    )
    result = pytester.runpytest(
        "-p", "no:randomly", f"--gradref-strategy={strategy}", "--gradref-report=report.json"
    )
    result.assert_outcomes(passed=3)
    report = json.loads((pytester.path / "report.json").read_text())
    tests = {t["nodeid"].split("::")[1]: t["items"] for t in report["tests"]}
    assert all("rounded_error" not in item for item in tests["test_plain"])
    for item in tests["test_rounded_by_marker"]:
        # The rounded reference's error set the allowance, and both errors are named.
        assert item["rounded_error"] > 0
        assert item["criterion"].startswith(
            "budget 2x the bfloat16-rounded reference's error vs the float64 golden, greatest "
            f"and normwise ({item['rounded_error']:.3g} and "
        )
    assert [i["max_abs"] for i in tests["test_rounded_by_argument"]] == [
        i["max_abs"] for i in tests["test_rounded_by_marker"]
    ]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_kernel_four_times_worse_than_the_rounded_reference_fails(
    pytester: pytest.Pytester, strategy: str
) -> None:
    pytester.makepyfile(
        FUNCTIONS
        + """
@pytest.mark.gradref(golden=torch.float64, budget=2, rounded=True, check_dtype=False)
def test_worse(grad_reference):
    x, w, t = kl_inputs()
    ref = grad_reference(kl, x, w, t, argnums=(0, 1))
    golden = ref.golden.arg_grads[1]
    # The rounded reference's error on the weight gradient, four times over.
    worse = golden + 4 * (ref.rounded.arg_grads[1].double() - golden)
    value, (grad_x, _) = run(kl_bf16, x, w, t)
    ref.assert_close(value, (grad_x, worse.to(torch.bfloat16)))
"""
    )
    result = pytester.runpytest(
        "-p", "no:randomly", f"--gradref-strategy={strategy}", "--gradref-report=report.json"
    )
    result.assert_outcomes(failed=1)
    # The normwise error is what four times the rounded reference's error cannot hide in:
    # 0.0139 against the rounding spread's 2 x rms 0.0039. The greatest error, one element's,
    # is 2.3 times the spread runs' typical greatest error (0.00059 +- 0.00016 over 48 runs),
    # so whether it also exceeds the spread's allowance depends on the runs' draw.
    result.stdout.fnmatch_lines(
        [
            "*1 of 3 items differ*",
            "*- gradient of argument 1 (w):",
            "*normwise error vs the float64 golden: * (relative *), *x the bfloat16-rounded "
            "reference's own *; allowed: budget 2 x * + floor *",
        ]
    )
    (record,) = json.loads((pytester.path / "report.json").read_text())["tests"]
    weight = record["items"][2]
    # Four times the rounded reference's error, up to the bf16 rounding of the result.
    assert 3.9 < weight["max_abs"] / weight["rounded_error"] < 4.1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_module_parameters_and_aux_are_rounded_and_budgeted(
    pytester: pytest.Pytester, strategy: str
) -> None:
    pytester.makepyfile(
        FUNCTIONS
        + """
class Scaled(torch.nn.Module):
    def __init__(self, cast=up):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(-1, 1, 5, dtype=torch.bfloat16))
        self.cast = cast

    def forward(self, x):
        rows = (self.cast(x).exp() * self.cast(self.weight).sin().square() + 1).log().sum(-1)
        return rows.sum(), {"rows": rows, "count": x.shape[0]}


def twin_run(x):
    # The same module computing in bf16.
    twin = Scaled(cast=same)
    leaf = x.detach().requires_grad_()
    value, aux = twin(leaf)
    value.backward()
    return twin, value, leaf.grad, aux


# The twin computes in bf16 and returns its value and rows in bf16, on purpose.
@pytest.mark.gradref(golden=torch.float64, budget=2, rounded=True, check_dtype=False)
def test_module(grad_reference):
    x, _ = small_inputs()
    ref = grad_reference(Scaled(), x, has_aux=True)
    twin, value, grad_x, aux = twin_run(x)
    assert torch.equal(ref.rounded.param_grads["weight"], twin.weight.grad)
    assert torch.equal(ref.rounded.aux["rows"], aux["rows"].float())
    ref.assert_close(value, grad_x, param_grads=twin, aux=aux)


@pytest.mark.gradref(golden=torch.float64, budget=2, rounded=True, check_dtype=False)
def test_aux_four_times_worse(grad_reference):
    x, _ = small_inputs()
    ref = grad_reference(Scaled(), x, has_aux=True)
    twin, value, grad_x, aux = twin_run(x)
    golden = ref.golden.aux["rows"]
    # Twenty times the rounded reference's error: here that error is half a bf16 step of the
    # rows' scale, the floor is a whole step, and the rounding spread (randomly rounded runs of
    # the reference in bf16) lets four rows of a few bf16 operations err by a few steps.
    worse = golden + 20 * (ref.rounded.aux["rows"].double() - golden)
    ref.assert_close(value, grad_x, param_grads=twin, aux={**aux, "rows": worse.float()})
"""
    )
    result = pytester.runpytest(
        "-p", "no:randomly", f"--gradref-strategy={strategy}", "--gradref-report=report.json"
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*1 of 5 items differ*", "*- aux?'rows'?:", "*x the bfloat16-rounded reference's own*"]
    )
    records = json.loads((pytester.path / "report.json").read_text())["tests"]
    passing = next(r for r in records if r["nodeid"].endswith("test_module"))
    labels = [i["label"] for i in passing["items"] if "rounded_error" in i]
    # aux['count'] is an integer: compared exactly, not by a budget.
    assert labels == [
        "value",
        "gradient of argument 0 (x)",
        "gradient of parameter 'weight'",
        "aux['rows']",
    ]


def test_a_kernel_reference_can_be_rounded(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        FUNCTIONS
        + """
class Kernel(torch.autograd.Function):
    # The KL with a backward of its own, computing in float32 as kl does.
    @staticmethod
    def forward(ctx, x, w, t):
        with torch.enable_grad():
            leaves = [a.detach().requires_grad_() for a in (x, w)]
            value = kl(*leaves, t)
            grads = torch.autograd.grad(value, leaves)
        ctx.save_for_backward(*grads)
        return value.detach()

    @staticmethod
    def backward(ctx, grad_value):
        grad_x, grad_w = ctx.saved_tensors
        return grad_x * grad_value, grad_w * grad_value, None


@pytest.mark.gradref(golden=torch.float64, budget=2, rounded=True, check_dtype=False)
def test_kernel(grad_reference):
    x, w, t = kl_inputs()
    ref = grad_reference.kernel(Kernel.apply, x, w, t, argnums=(0, 1))
    value, grads = run(kl_bf16, x, w, t)
    ref.assert_close(value, grads)
"""
    )
    pytester.runpytest("-p", "no:randomly").assert_outcomes(passed=1)


def test_rounded_needs_a_golden_and_a_budget(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import pytest
import torch


def loss(t):
    return t.sin().sum()


def test_call_errors(grad_reference):
    x = torch.randn(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"rounded=True needs a golden reference: .* Add "
                       r"golden=torch.float64"):
        grad_reference(loss, x, rounded=True)
    with pytest.raises(TypeError, match="rounded must be True or False, got 'yes'"):
        grad_reference(loss, x, golden=torch.float64, rounded="yes")
    ref = grad_reference(loss, x, golden=torch.float64, rounded=True)
    without = r"computed with rounded=True, which only widens an error budget, and "
    with pytest.raises(ValueError, match=without + "assert_close\\\\(\\\\) compares without one"):
        ref.assert_close(loss(x), x.cos())
    with pytest.raises(ValueError, match=without + ".* compares with rtol=/atol=: pass budget"):
        ref.assert_close(loss(x), x.cos(), rtol=0.1)
    z = torch.randn(4, dtype=torch.complex64)
    complex_input = r"the compute dtype, a floating dtype: .* argument 0 \\(t\\), torch.complex64"
    with pytest.raises(ValueError, match=complex_input):
        grad_reference(lambda t: t.abs().sum(), z, golden=torch.float64, rounded=True)

"""
    )
    # The tolerance verdict's errors: the default verdict gives a bf16 reference a float64
    # golden and a budget of its own (test_verdict.py).
    result = pytester.runpytest("-p", "no:randomly", "--gradref-verdict=tolerance")
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize(
    ("marker", "message"),
    [
        (
            "golden=torch.float64, rounded=True",
            "rounded=True without budget=: *golden=torch.float64, budget=2, rounded=True)",
        ),
        ("rounded=True", "rounded=True without golden= and budget=*"),
        ("golden=torch.float64, budget=2, rounded=1", "rounded=1; it must be True or False"),
    ],
)
def test_a_marker_with_rounded_needs_a_golden_and_a_budget(
    pytester: pytest.Pytester, marker: str, message: str
) -> None:
    pytester.makepyfile(
        f"""
import pytest
import torch

@pytest.mark.gradref({marker})
def test_marked(grad_reference):
    pass
"""
    )
    result = pytester.runpytest("-p", "no:randomly")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*test_marked*{message}*"])


def _item(actual: list[float], rounded: list[float] | None) -> BudgetItem:
    """A bf16 computation's float32 results, 1 and 2 in the float64 golden, a float32
    reference that errs by 0.01 on the first: with a rounded reference (which says the kernel
    computes in bf16) the floor is one bf16 step of 2, 0.0156; without, 16 float32 steps."""
    golden = torch.tensor([1.0, 2.0], dtype=torch.float64)
    return BudgetItem(
        label="value",
        actual=golden.float() + torch.tensor(actual),
        reference=golden.float() + torch.tensor([0.01, 0.0]),
        golden=golden,
        budget=2,
        compute_dtype=torch.bfloat16,
        rounded=None if rounded is None else golden.float() + torch.tensor(rounded),
    )


def test_the_larger_of_the_two_errors_sets_the_allowance() -> None:
    plain, by_rounded, beyond, by_reference = check_items(
        [
            _item([0.0, 0.2], None),
            _item([0.0, 0.2], [0.0, 0.1]),
            _item([0.0, 0.25], [0.0, 0.1]),
            _item([0.0, 0.03], [0.0, 0.005]),
        ]
    )
    assert not plain.passed  # 0.2 > 2 x 0.01 + 3.81e-06
    assert plain.rounded_error is None
    assert plain.criterion.endswith("+ floor 3.81e-06 (16 float32 steps at the item's scale 2)")
    assert by_rounded.passed
    assert by_rounded.rounded_error == pytest.approx(0.1)
    assert by_rounded.criterion == (
        "budget 2x the bfloat16-rounded reference's error vs the float64 golden, greatest and "
        "normwise (0.1 and 0.1, the larger: the float32 reference's is 0.01) + floor 0.0156 "
        "(1 bfloat16 steps at the item's scale 2)"
    )
    assert not beyond.passed  # 0.25 > 2 x 0.1 + 0.0156
    assert beyond.detail.startswith(
        "greatest error vs the float64 golden: 0.25 at index (1,) (greatest relative 0.125), "
        "2.5x the bfloat16-rounded reference's own 0.1 (the float32 reference's is 0.01); "
        "allowed: budget 2 x 0.1 + floor 0.0156 = 0.216\n"
        "normwise error vs the float64 golden: 0.25 (relative 0.112), 2.5x the "
        "bfloat16-rounded reference's own 0.1; allowed: budget 2 x 0.1 + floor"
    )
    assert by_reference.passed  # 0.03 <= 2 x 0.01 + 0.0156
    assert by_reference.criterion.startswith(
        "budget 2x the float32 reference's error vs the float64 golden, greatest and normwise "
        "(0.01 and 0.01, the larger: the bfloat16-rounded reference's is 0.005)"
    )


def test_a_nan_in_the_rounded_reference_fails_the_item() -> None:
    (check,) = check_items([_item([0.0, 0.0], [0.0, float("nan")])])
    assert not check.passed
    assert check.detail.endswith("(the rounded reference has NaN)")
