"""What an adopting kernel library needs (issue 20): aux outputs compared, tolerances from
the compute dtype, honest goldens, chosen parameters, kernel against kernel."""

from __future__ import annotations

import json
import sys

import pytest
from _pytester_sources import OLD_STYLE_SQUARE

AUX = """
import pytest
import torch
from pytest_gradref import Tolerance


def loss(x):
    return (x * x).sum(), {"rewards": 2 * x, "steps": 3, "pair": (x.sum(), 0.5), "name": "dpo"}


def kernel(x, skew=1.0):
    value, aux = loss(x)
    return value, {**aux, "rewards": aux["rewards"] * skew}


def test_aux_passes(grad_reference):
    x = torch.randn(4, dtype=torch.float64)
    ref = grad_reference(loss, x, has_aux=True)
    value, aux = kernel(x)
    ref.assert_close(value, 2 * x, aux=aux)


def test_aux_item_named(grad_reference):
    x = torch.randn(4, dtype=torch.float64)
    ref = grad_reference(loss, x, has_aux=True)
    value, aux = kernel(x, skew=1.001)
    aux["pair"] = (aux["pair"][0], 0.75)
    aux["steps"] = 4
    ref.assert_close(value, 2 * x, aux=aux)


def test_aux_tolerance_of_its_own(grad_reference):
    x = torch.randn(4, dtype=torch.float64)
    ref = grad_reference(loss, x, has_aux=True)
    value, aux = kernel(x, skew=1.001)
    ref.assert_close(value, 2 * x, aux=aux, aux_tolerances={"rewards": Tolerance(2e-3, 0.0)})


def test_aux_tolerance_unknown_key(grad_reference):
    x = torch.randn(4, dtype=torch.float64)
    ref = grad_reference(loss, x, has_aux=True)
    value, aux = kernel(x)
    unknown = r"aux_tolerances names 'reward', which is not in the aux; .*aux\\['rewards'\\]"
    with pytest.raises(ValueError, match=unknown):
        ref.assert_close(value, 2 * x, aux=aux, aux_tolerances={"reward": Tolerance(1, 1)})


def test_aux_structure(grad_reference):
    x = torch.randn(4, dtype=torch.float64)
    ref = grad_reference(loss, x, has_aux=True)
    value, aux = kernel(x)
    del aux["steps"]
    aux["pair"] = (aux["pair"][0],)
    ref.assert_close(value, 2 * x, aux=aux)
"""


# fnmatch reads "[" as a character class: "[[]" matches the bracket itself.
def test_aux_compared_item_by_item(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(AUX)
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(
        [
            "E * 3 of 6 items differ",
            "E * - aux[[]'rewards']:",
            "E * tolerance rtol=1e-07, atol=1e-07 from torch.testing's default for float64",
            "E * - aux[[]'steps']:",
            "E * - aux[[]'pair'][[]1]:",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "E * 2 of 5 items differ",
            "E * - aux:",
            "E * keys differ: the actual lacks 'steps'",
            "E * - aux[[]'pair']:",
            "E * the actual has 1 elements, the reference's 2",
        ]
    )


AUX_LEFT_OUT = """
import copy
import pickle

import pytest
import torch
from pytest_gradref import UNCHECKED, Tolerance


def loss(x):
    return (x * x).sum(), {"rewards": 2 * x, "steps": 3}


def test_aux_left_out(grad_reference):
    x = torch.randn(4, dtype=torch.float64)
    ref = grad_reference(loss, x, has_aux=True)
    ref.assert_close((x * x).sum(), 2 * x)


def test_aux_unchecked(grad_reference):
    x = torch.randn(4, dtype=torch.float64)
    ref = grad_reference(loss, x, has_aux=True)
    ref.assert_close((x * x).sum(), 2 * x, aux=UNCHECKED)


def test_aux_compared(grad_reference):
    x = torch.randn(4, dtype=torch.float64)
    ref = grad_reference(loss, x, has_aux=True)
    value, aux = loss(x)
    ref.assert_close(value, 2 * x, aux=aux)


def test_unchecked_where_it_means_nothing(grad_reference):
    x = torch.randn(4, dtype=torch.float64)
    without = grad_reference(lambda t: (t * t).sum(), x)
    with pytest.raises(TypeError, match="this reference has no aux to leave unchecked"):
        without.assert_close((x * x).sum(), 2 * x, aux=UNCHECKED)
    ref = grad_reference(loss, x, has_aux=True)
    with pytest.raises(ValueError, match="aux_tolerances= has nothing to apply to"):
        ref.assert_close(
            (x * x).sum(), 2 * x, aux=UNCHECKED, aux_tolerances={"steps": Tolerance(1, 1)}
        )


def test_unchecked_is_one_object():
    # Under xdist a test's arguments may be pickled; the sentinel stays itself.
    assert pickle.loads(pickle.dumps(UNCHECKED)) is UNCHECKED
    assert copy.deepcopy(UNCHECKED) is UNCHECKED
    assert repr(UNCHECKED) == "pytest_gradref.UNCHECKED"
"""


def test_aux_left_out_fails_and_unchecked_is_recorded(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(AUX_LEFT_OUT)
    result = pytester.runpytest("-p", "no:randomly", "-v", "--gradref-report=r.json")
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(
        [
            "E * TypeError: assert_close(): this reference has an aux (grad_reference(..., "
            "has_aux=True): aux[[]'rewards'], aux[[]'steps']) but no aux= was given, so it "
            "would go unchecked. Pass the kernel's aux as aux= to compare it item by item, or "
            "aux=pytest_gradref.UNCHECKED to leave it uncompared on purpose (the report "
            "records it as unchecked)",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "aux left unchecked (assert_close(aux=pytest_gradref.UNCHECKED)) in 1 test:",
            "  *::test_aux_unchecked: aux[[]'rewards'], aux[[]'steps']",
        ]
    )
    records = json.loads((pytester.path / "r.json").read_text())["tests"]
    by_name = {r["nodeid"].split("::")[1]: r for r in records}
    assert by_name["test_aux_unchecked"]["aux_unchecked"] == ["aux['rewards']", "aux['steps']"]
    assert [i["label"] for i in by_name["test_aux_unchecked"]["items"]] == [
        "value",
        "gradient of argument 0 (x)",
    ]
    assert by_name["test_aux_compared"]["aux_unchecked"] == []
    assert [i["label"] for i in by_name["test_aux_compared"]["items"]] == [
        "value",
        "gradient of argument 0 (x)",
        "aux['rewards']",
        "aux['steps']",
    ]
    # Without -v the summary leaves the list to the report.
    quiet = pytester.runpytest("-p", "no:randomly")
    quiet.stdout.no_fnmatch_line("*aux left unchecked*")


COMPUTE_DTYPE = """
import pytest
import torch


def reference(x, w):
    # bf16 matmul, float32 loss: what a library's plain reference does
    return (x @ w.T).float().square().mean()


def kernel(x, w):
    # float32 math from bf16 inputs: more accurate than the reference
    return (x.float() @ w.float().T).square().mean()


def inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, generator=gen).bfloat16()
    w = torch.randn(24, 32, generator=gen).bfloat16()
    return x, w


def test_float32_loss_of_bf16_inputs(grad_reference):
    x, w = inputs()
    ref = grad_reference(reference, x, w, argnums=(0, 1))
    assert ref.compute.dtype == torch.bfloat16 and ref.value.dtype == torch.float32
    ref.assert_close(kernel(x, w), (ref.grads[0], ref.grads[1]))


def test_failure_says_where_the_tolerance_came_from(grad_reference):
    x, w = inputs()
    ref = grad_reference(reference, x, w, argnums=(0, 1))
    ref.assert_close(kernel(x, w) * 1.05, ref.grads)


# The plain bf16 matmul's loss is 1.7e-4 off: beyond 16 float32 steps of |loss| (6.4e-5), within
# 16 steps of the sum of its first-order terms, 4x the loss for a square of a bilinear (2.6e-4).
@pytest.mark.gradref(golden=torch.float64, budget=2)
def test_budget_floor_at_the_value_condition(grad_reference):
    x, w = inputs()
    ref = grad_reference(kernel, x, w, argnums=(0, 1))
    ref.assert_close(reference(x, w), ref.grads)


def distance(x, teacher):
    return (x - teacher.float()).square().mean()


def test_an_input_not_differentiated_counts_too(grad_reference):
    gen = torch.Generator().manual_seed(1)
    x, teacher = torch.randn(16, generator=gen), torch.randn(16, generator=gen).bfloat16()
    ref = grad_reference(distance, x, teacher, argnums=0)
    assert (ref.compute.dtype, ref.compute.source) == (torch.bfloat16, "argument 1 (teacher)")


def mixture(x, teachers, scales):
    return sum(s * (x - t.float()).square().mean() for t, s in zip(teachers, scales["w"]))


def test_tensors_nested_in_arguments_count_too(grad_reference):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, generator=gen)
    teachers = [torch.randn(16, generator=gen), torch.randn(16, generator=gen).half()]
    ref = grad_reference(mixture, x, teachers, {"w": [1.0, 0.5]}, argnums=0)
    assert (ref.compute.dtype, ref.compute.source) == (torch.float16, "argument 1 (teachers)")
    ref = grad_reference(mixture, x, teachers[:1], scales={"w": torch.ones(1).bfloat16()})
    assert (ref.compute.dtype, ref.compute.source) == (torch.bfloat16, "keyword argument 'scales'")
"""


def test_tolerance_follows_the_compute_dtype(pytester: pytest.Pytester) -> None:
    # The tolerance of the compute dtype: the tolerance verdict's (the default's golden needs none).
    pytester.makepyfile(COMPUTE_DTYPE)
    result = pytester.runpytest("-p", "no:randomly", "--gradref-verdict=tolerance")
    result.assert_outcomes(passed=4, failed=1)
    result.stdout.fnmatch_lines(
        [
            "E * 1 of 3 items differ",
            "E * - value:",
            "E * tolerance rtol=0.016, atol=1e-05 from torch.testing's default for bfloat16, the "
            "compute dtype (argument 0 (x) is bfloat16; the item is float32)",
        ]
    )


GOLDEN = """
import pytest
import torch


def casting_reference(x):
    # Through Python numbers: no float64 tensor reaches the result, so the golden's promotion
    # of casts and dtype= arguments cannot make it float64.
    return torch.tensor(x.detach().tolist()).square().sum()


@pytest.mark.gradref(golden=torch.float64, budget=2)
def test_golden_cast_down(grad_reference):
    x = torch.randn(8, dtype=torch.bfloat16)
    ref = grad_reference(casting_reference, x)
    ref = grad_reference(casting_reference, x)  # warned once per test
    assert ref.golden.obtained == torch.float32
    ref.assert_close(ref.value, ref.grads)
"""


def test_golden_less_precise_than_requested(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(GOLDEN)
    result = pytester.runpytest("-p", "no:randomly", "--gradref-report=report.json")
    # Two warnings: the golden's precision, and the reference's gradient, zero everywhere
    # (through Python numbers, x reaches the result undifferentiated).
    result.assert_outcomes(passed=1, warnings=2)
    result.stdout.fnmatch_lines(
        [
            "*GoldenPrecisionWarning: golden=torch.float64 was requested, but casting_reference "
            "returned torch.float32 even with its casts and dtype= arguments promoted to "
            "float64*",
            "*ZeroGradientWarning: the reference's gradient of argument 0 (x) is zero everywhere*",
        ]
    )
    report = json.loads((pytester.path / "report.json").read_text())
    (record,) = report["tests"]
    assert record["golden_obtained"] == {"requested": "float64", "obtained": "float32"}
    # The interpreter running the tests, not a console script on the PATH, which CI's
    # lower-bound environment does not put there.
    diff = pytester.run(
        sys.executable, "-m", "pytest_gradref", "diff", "report.json", "report.json"
    )
    assert diff.ret == 0, diff.stdout.str()


WARNED_AT = """
import inspect

import pytest
import torch
from pytest_gradref import GoldenPrecisionWarning


def casting_reference(x):
    return torch.tensor(x.detach().tolist()).square().sum()


@pytest.mark.parametrize("kind", ["fixture", "kernel"])
def test_warned_at_the_call(grad_reference, kind):
    compute = grad_reference if kind == "fixture" else grad_reference.kernel
    x = torch.randn(8, dtype=torch.bfloat16)
    with pytest.warns(GoldenPrecisionWarning) as caught:
        line = inspect.currentframe().f_lineno + 1
        compute(casting_reference, x, golden=torch.float64)
    (warning,) = caught
    assert (warning.filename, warning.lineno) == (__file__, line)
"""


def test_golden_warning_points_at_the_test_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(WARNED_AT)
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=2)


def test_user_stacklevel_skips_the_plugin_frames() -> None:
    from pytest_gradref.warning_types import user_stacklevel

    # Called here, outside the package: the frame that warns is the user's own.
    assert user_stacklevel() == 1


PARAMS = """
import pytest
import torch


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.ref_lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        with torch.no_grad():
            base = self.ref_lin(x)
        return (self.lin(x) - base).square().sum()


def run(head, x):
    head(x).backward()
    return head


def test_no_gradient_names_the_option(grad_reference):
    head, x = Head(), torch.randn(4, 3)
    ref = grad_reference(head, x, argnums=())
    ref.assert_close(head(x), param_grads=run(head, x))


@pytest.mark.parametrize(
    "params", [["lin.weight", "lin.bias"], lambda name, p: name.startswith("lin.")]
)
def test_chosen_parameters(grad_reference, params):
    head, x = Head(), torch.randn(4, 3)
    ref = grad_reference(head, x, argnums=(), params=params)
    assert sorted(ref.param_grads) == ["lin.bias", "lin.weight"]
    ref.assert_close(head(x), param_grads=run(head, x))


def test_unknown_parameter(grad_reference):
    unknown = (
        "params= names 'lin.w', not parameters of Head; its parameters are lin.weight, "
        "lin.bias, ref_lin.weight, ref_lin.bias"
    )
    with pytest.raises(ValueError, match=unknown):
        grad_reference(Head(), torch.randn(4, 3), argnums=(), params="lin.w")
"""


def test_parameters_checked_are_chosen(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(PARAMS)
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(
        [
            "E * 2 of 5 items differ",
            "E * - gradient of parameter 'ref_lin.weight':",
            "E * None: backward() did not reach parameter 'ref_lin.weight'. If the kernel "
            "leaves it untrained (a frozen reference model, say), check only the others: "
            "grad_reference(..., params=lambda name, p: not name.startswith('ref_lin.')) "
            "or params=[[]...names...]",
        ]
    )


KERNELS = (
    OLD_STYLE_SQUARE
    + """


def kernel_a(x):
    return Square.apply(x).sum()


def kernel_b(x):
    return (x * x).sum()


def test_kernel_against_kernel(grad_reference):
    x = torch.randn(5, dtype=torch.float64)
    ref = grad_reference.kernel(kernel_a, x)
    assert ref.strategy == "autograd"
    leaf = x.clone().requires_grad_()
    value = kernel_b(leaf)
    value.backward()
    ref.assert_close(value, leaf.grad)


@pytest.mark.gradref(strategy="autograd")
def test_fixed_by_marker(grad_reference):
    x = torch.randn(5, dtype=torch.float64)
    grad_reference(kernel_a, x).assert_close(kernel_b(x), 2 * x)


def test_crosschecked(grad_reference):
    x = torch.randn(5, dtype=torch.float64)
    grad_reference(kernel_b, x).assert_close(kernel_b(x), 2 * x)


def test_kernel_beside_a_crosschecked_reference(grad_reference):
    x = torch.randn(5, dtype=torch.float64)
    grad_reference.kernel(kernel_a, x).assert_close(kernel_b(x), 2 * x)
    grad_reference(kernel_b, x).assert_close(kernel_b(x), 2 * x)
"""
)


@pytest.mark.parametrize("strategy", ["crosscheck", "grad_and_value"])
def test_kernel_against_kernel_and_opt_outs(pytester: pytest.Pytester, strategy: str) -> None:
    pytester.makepyfile(KERNELS)
    result = pytester.runpytest(
        "-p", "no:randomly", f"--gradref-strategy={strategy}", "--gradref-report=r.json"
    )
    result.assert_outcomes(passed=4)
    records = json.loads((pytester.path / "r.json").read_text())["tests"]
    opt_outs = {r["nodeid"].split("::")[1]: r["crosscheck_opt_out"] for r in records}
    if strategy == "grad_and_value":
        assert set(opt_outs.values()) == {None}
        result.stdout.no_fnmatch_line("*opted out*")
        return
    assert opt_outs == {
        "test_kernel_against_kernel": "a kernel reference (grad_reference.kernel)",
        "test_fixed_by_marker": "@pytest.mark.gradref(strategy='autograd')",
        "test_crosschecked": None,
        "test_kernel_beside_a_crosschecked_reference": "a kernel reference (grad_reference.kernel)",
    }
    # The test with a crosschecked reference beside its kernel reference is no opt-out.
    result.stdout.fnmatch_lines(
        [
            "crosscheck: 4 items received autograd results, checked against grad_and_value; "
            "0 differ beyond tolerance",
            "crosscheck: 2 tests opted out, not crosschecked: 1 by "
            "@pytest.mark.gradref(strategy='autograd'); 1 by a kernel reference "
            "(grad_reference.kernel)",
            "crosscheck: 1 test crosschecked in part, some references not: 1 by a kernel "
            "reference (grad_reference.kernel)",
        ]
    )
