"""The batched pass of ``judge.check_items`` computes a budget item's statistics as the
one-by-one route (``BudgetItem.check_alone``, which tensor subclasses take) does: sides
stacked into one tensor, a scalar's differences taken on the host, the greatest relative
error left to a failure's message where no statistics are asked for. Each case is judged
both ways and must agree, edge values (equal infinities, NaN, a zero or infinite golden)
included."""

from __future__ import annotations

import math

import pytest
import torch

from pytest_gradref.verdict.budget_item import BudgetItem
from pytest_gradref.verdict.judge import check_items

INF, NAN = math.inf, math.nan

# (actual, reference, golden) of a scalar item; the golden in float64, the rest in float32.
SCALARS = {
    "close": (1.0 + 2**-22, 1.0 - 2**-23, 1.0),
    "equal infinities": (INF, INF, INF),
    "infinity against a finite golden": (INF, 1.0, 1.0),
    "finite against an infinite golden": (1.0, INF, INF),
    "NaN actual": (NAN, 1.0, 1.0),
    "NaN golden": (1.0, 1.0, NAN),
    "zero golden, exact": (0.0, 0.0, 0.0),
    "zero golden, off": (1e-30, 0.0, 0.0),
    "negative, far": (-2.0, -1.0, -1.0),
}


def _fields(check: object) -> list[object]:
    names = ("passed", "max_abs", "max_rel", "norm_rel", "scale", "reference_error", "headroom")
    return [getattr(check, name) for name in names]


def _same(batched: list[object], alone: list[object]) -> bool:
    return all(
        (isinstance(b, float) and isinstance(a, float) and math.isnan(b) and math.isnan(a))
        or b == pytest.approx(a, rel=1e-12, abs=0)
        for b, a in zip(batched, alone)
    )


@pytest.mark.parametrize("case", SCALARS)
@pytest.mark.parametrize("condition", [None, (3.0, 0.5)], ids=["plain", "conditioned"])
def test_a_scalar_is_judged_as_the_one_by_one_route_judges_it(case, condition):
    actual, reference, golden = SCALARS[case]
    item = BudgetItem(
        "value",
        torch.tensor(actual, dtype=torch.float32),
        torch.tensor(reference, dtype=torch.float32),
        torch.tensor(golden, dtype=torch.float64),
        budget=2.0,
        condition=None if condition is None else torch.tensor(condition, dtype=torch.float64),
    )
    (batched,) = check_items([item])
    assert _same(_fields(batched), _fields(item.check_alone())), (batched, item.check_alone())


@pytest.mark.parametrize("shape", [(3,), (64, 5)], ids=["short", "systematic"])
@pytest.mark.parametrize("edge", ["none", "equal infinities", "NaN golden", "zero golden"])
def test_a_tensor_is_judged_as_the_one_by_one_route_judges_it(shape, edge):
    gen = torch.Generator().manual_seed(1)
    golden = torch.randn(shape, generator=gen, dtype=torch.float64)
    if edge == "equal infinities":
        golden.view(-1)[0] = INF
    elif edge == "NaN golden":
        golden.view(-1)[1] = NAN
    elif edge == "zero golden":
        golden.view(-1)[2] = 0.0
    reference = golden.float()
    actual = (golden * (1 + 1e-7 * torch.randn(shape, generator=gen, dtype=torch.float64))).float()
    rounded = (golden + 1e-7 * torch.randn(shape, generator=gen, dtype=torch.float64)).float()
    for rounded_side in (None, rounded):
        item = BudgetItem("gradient", actual, reference, golden, budget=2.0, rounded=rounded_side)
        (batched,) = check_items([item])
        alone = item.check_alone()
        assert _same(_fields(batched), _fields(alone)), (batched, alone)
        assert batched.scale_error == pytest.approx(alone.scale_error, rel=1e-9, abs=1e-15) or (
            math.isnan(batched.scale_error) and math.isnan(alone.scale_error)
        )


def test_without_statistics_a_failure_still_names_the_greatest_relative_error():
    golden = torch.linspace(1.0, 2.0, 100, dtype=torch.float64)
    reference = golden.float()
    actual = reference.clone()
    actual[7] *= 1.5  # relative error 0.5 at index 7
    item = BudgetItem("gradient", actual, reference, golden, budget=2.0)
    (quiet,) = check_items([item], statistics=False)
    (full,) = check_items([item], statistics=True)
    assert not quiet.passed
    assert not full.passed
    assert math.isnan(quiet.max_rel)
    assert full.max_rel == pytest.approx(0.5, rel=1e-6)
    assert "at index (7,) (greatest relative 0.5)" in quiet.detail
    assert "at index (7,) (greatest relative 0.5)" in full.detail
