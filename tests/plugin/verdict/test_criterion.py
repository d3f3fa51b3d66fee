"""The one choice of criterion (verdict/criterion.py): which golden a reference computes, and
whether its items take a budget or a tolerance, under each policy the plugin builds."""

from __future__ import annotations

import warnings

import pytest
import torch

from pytest_gradref.config.tolerances import (
    DEFAULT_BUDGET,
    CheckPolicy,
    ToleranceOverride,
)
from pytest_gradref.reference.computation import compute_reference
from pytest_gradref.reference.grad_reference import GradReference
from pytest_gradref.verdict.criterion import budget_for, candidate_golden, golden_for

# The policies plugin.py builds: the default verdict, --gradref-verdict=tolerance, and the
# default verdict in a test whose marker gives a tolerance.
DEFAULT = CheckPolicy(backend="cpu", default_golden=torch.float64, default_budget=DEFAULT_BUDGET)
TOLERANCE = CheckPolicy(backend="cpu", golden_off="--gradref-verdict=tolerance from the option")
MARKED = CheckPolicy(
    backend="cpu",
    default_golden=torch.float64,
    default_budget=DEFAULT_BUDGET,
    overrides=(ToleranceOverride(1e-3, 1e-5, "the test's @pytest.mark.gradref"),),
)


@pytest.mark.parametrize(
    ("policy", "asked", "compute", "kernel", "expected"),
    [
        (DEFAULT, None, torch.bfloat16, False, torch.float64),
        (DEFAULT, None, torch.float32, False, torch.float64),
        (DEFAULT, None, torch.float64, False, None),  # nothing more precise to compare with
        (DEFAULT, None, None, False, None),  # no floating input
        (DEFAULT, None, torch.bfloat16, True, None),  # a kernel reference need not run in float64
        (TOLERANCE, None, torch.bfloat16, False, None),
        (MARKED, None, torch.bfloat16, False, None),  # the marker's tolerance needs none
        (TOLERANCE, torch.float64, torch.bfloat16, False, torch.float64),  # asked: always
        (DEFAULT, torch.float32, torch.bfloat16, True, torch.float32),
    ],
    ids=[
        "default-bf16",
        "default-fp32",
        "default-fp64",
        "default-no-float",
        "default-kernel",
        "tolerance-verdict",
        "marker-tolerance",
        "asked-under-tolerance",
        "asked-for-a-kernel",
    ],
)
def test_the_golden_a_reference_computes(
    policy: CheckPolicy,
    asked: torch.dtype | None,
    compute: torch.dtype | None,
    kernel: bool,
    expected: torch.dtype | None,
) -> None:
    assert golden_for(policy, asked, compute, kernel=kernel) == expected
    # Where it goes (the CPU for a dtype the backend cannot compute) is decided by the same
    # rule, before the compute dtype is known: the golden wherever inputs are less precise.
    if expected is not None:
        assert candidate_golden(policy, asked, kernel=kernel) == expected


def test_an_items_budget_follows_the_call_then_the_marker_then_the_verdict() -> None:
    with_budget = CheckPolicy(backend="cpu", budget=3.0, default_budget=DEFAULT_BUDGET)
    assert budget_for(DEFAULT, budget=None, tolerance_given=False, has_golden=True) == 2.0
    assert budget_for(DEFAULT, budget=5.0, tolerance_given=False, has_golden=True) == 5.0
    assert budget_for(with_budget, budget=None, tolerance_given=False, has_golden=True) == 3.0
    # rtol/atol in the call or on the marker: a tolerance, golden or not.
    assert budget_for(DEFAULT, budget=None, tolerance_given=True, has_golden=True) is None
    assert budget_for(MARKED, budget=None, tolerance_given=False, has_golden=True) is None
    # No golden (float64 inputs), or the tolerance verdict: tolerances.
    assert budget_for(DEFAULT, budget=None, tolerance_given=False, has_golden=False) is None
    assert budget_for(TOLERANCE, budget=None, tolerance_given=False, has_golden=True) is None


def test_a_budget_without_a_golden_errors_or_skips_where_the_run_turned_it_off() -> None:
    with pytest.raises(ValueError, match=r"assert_close\(budget=4\) needs a golden reference"):
        budget_for(DEFAULT, budget=4.0, tolerance_given=False, has_golden=False)
    with pytest.raises(pytest.skip.Exception, match="--gradref-verdict=tolerance from the"):
        budget_for(TOLERANCE, budget=4.0, tolerance_given=False, has_golden=False)
    with pytest.raises(ValueError, match="budget"):
        budget_for(DEFAULT, budget=0.0, tolerance_given=False, has_golden=True)


def test_a_default_golden_needs_a_default_budget() -> None:
    with pytest.raises(ValueError, match=r"default_golden=torch.float64\) computes a golden"):
        CheckPolicy(backend="cpu", default_golden=torch.float64)


def _loss(x: torch.Tensor) -> torch.Tensor:
    return x.sin().sum()


def test_the_old_default_golden_arguments_still_work_with_a_deprecation_warning() -> None:
    x = torch.randn(16)
    plain = CheckPolicy(backend="cpu")
    with pytest.warns(DeprecationWarning, match=r"GradReference\(default_golden=...\)"):
        fixture = GradReference(
            strategy="autograd",
            default_strategy="autograd",
            policy=plain,
            default_golden=torch.float64,
        )
    assert fixture.policy.default_golden == torch.float64
    assert fixture.policy.default_budget == DEFAULT_BUDGET
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning was given once, at construction
        ref = fixture(_loss, x)
    assert ref.golden is not None
    assert ref.golden.dtype == torch.float64
    with pytest.warns(DeprecationWarning, match=r"compute_reference\(default_golden=...\)"):
        ref = compute_reference(
            _loss,
            (x,),
            {},
            argnums=0,
            has_aux=False,
            strategy="autograd",
            default_strategy="autograd",
            policy=plain,
            default_golden=torch.float64,
        )
    assert ref.golden is not None
    # The budget, as before: the golden's error budget judges a wrong gradient.
    with pytest.raises(AssertionError, match="greatest error vs the float64 golden"):
        ref.assert_close(x.sin().sum(), x.cos() * 1.01)


def test_a_kernel_reference_computes_no_default_golden() -> None:
    fixture = GradReference(strategy="autograd", default_strategy="autograd", policy=DEFAULT)
    x = torch.randn(16)
    assert fixture(_loss, x).golden is not None
    assert fixture.kernel(_loss, x).golden is None
    assert fixture.kernel(_loss, x, golden=torch.float64).golden is not None
