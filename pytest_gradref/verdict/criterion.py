"""The one choice of criterion: whether a reference computes a golden, and whether an item is
judged by a budget against it or by a tolerance.

Every caller asks here: the fixture's object for where a golden goes, ``compute_reference``
for which golden it computes, ``Reference.assert_close`` for each item's criterion. The rules
follow the test's ``CheckPolicy``: its default verdict (``default_golden`` and
``default_budget``: a float64 golden and a budget of 2, or neither under
``--gradref-verdict=tolerance``), the marker's tolerance or budget, and what the call gives.
"""

from __future__ import annotations

import pytest
import torch

from pytest_gradref.config.number_settings import check_number
from pytest_gradref.config.tolerances import CheckPolicy
from pytest_gradref.verdict.dtypes import epsilon


def candidate_golden(
    policy: CheckPolicy, asked: torch.dtype | None, *, kernel: bool
) -> torch.dtype | None:
    """The golden a reference computes where its inputs are less precise than it: ``asked``
    (the call's or the marker's ``golden=``), else the default verdict's, but for a reference
    that is itself a kernel (which need not run in float64) and a test that gives a tolerance
    (the marker's rtol/atol), which need none."""
    if asked is not None:
        return asked
    if kernel or policy.overrides:
        return None
    return policy.default_golden


def golden_for(
    policy: CheckPolicy,
    asked: torch.dtype | None,
    compute: torch.dtype | None,
    *,
    kernel: bool = False,
) -> torch.dtype | None:
    """The golden a reference computes: ``asked`` always; the policy's default one
    (``candidate_golden``) only where the reference's compute dtype (its least precise
    floating input) is less precise, so a reference of float64 inputs gets none."""
    if asked is not None:
        return asked
    candidate = candidate_golden(policy, None, kernel=kernel)
    if candidate is None or compute is None or not compute.is_floating_point:
        return None
    return candidate if epsilon(compute) > epsilon(candidate) else None


def budget_for(
    policy: CheckPolicy,
    *,
    budget: float | None,
    tolerance_given: bool,
    has_golden: bool,
) -> float | None:
    """The budget an assert_close judges its items with against the golden, or None for
    tolerances: the call's ``budget=``; tolerances where the call gives rtol/atol
    (``tolerance_given``); the marker's budget; and, for a reference with a golden in a test
    that gives no tolerance, the default verdict's budget. (An aux item with a tolerance of
    its own, an ``aux_tolerances`` entry, takes that instead, whatever this says.) A budget
    needs a golden: without one the test is skipped where the run turned the golden off (the
    cheapest verdict; one line in pytest's skip summary), and is an error otherwise.
    """
    __tracebackhide__ = True
    if budget is None and not tolerance_given:
        budget = policy.budget
        if budget is None and has_golden and not policy.overrides:
            budget = policy.default_budget
    if budget is None:
        return None
    check_number(budget, "budget", minimum=0, inclusive=False)
    if not has_golden and policy.golden_off is not None:
        _skip_without_golden(policy.golden_off)
    if not has_golden:
        raise ValueError(
            f"assert_close(budget={budget:g}) needs a golden reference: call "
            "grad_reference(..., golden=torch.float64) or mark the test "
            "@pytest.mark.gradref(golden=torch.float64)"
        )
    return budget


def _skip_without_golden(golden_off: str) -> None:
    """Skips a test whose check asks for a budget in a run that turned the golden off (the
    cheapest verdict). Raised here, in a frame the traceback keeps, so that pytest's skip
    summary (-rs) gives every such test one line, at this location."""
    pytest.skip(
        f"assert_close(budget=...) needs the float64 golden, which {golden_off} turns off; "
        "run without it to check these tests"
    )
