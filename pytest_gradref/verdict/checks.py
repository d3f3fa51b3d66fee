"""What a compared item's check holds (``ItemCheck``), the failures every kind of item shares
(a missing or misshapen result, a less precise dtype), and the failure message of a set of
checks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pytest_gradref.config.tolerances import dtype_name
from pytest_gradref.verdict.dtypes import epsilon, is_inexact


@dataclass(frozen=True)
class ItemCheck:
    """One compared item: its statistics, the criterion applied, and the verdict.

    ``headroom`` is 1 minus the share of the allowance used by the worst element: 1 for an
    exact match, 0 at the limit, negative when the item fails. A tolerance check made without
    statistics (``check_items(..., statistics=False)``) has NaN for max_abs, max_rel and
    headroom. ``rounded_error`` is the rounded reference's greatest error vs the golden, for a
    budget with a rounded reference (None otherwise).
    """

    label: str
    dtype: str
    max_abs: float
    max_rel: float
    criterion: str
    headroom: float
    passed: bool
    detail: str = ""
    rounded_error: float | None = None
    # ||actual - golden|| / ||golden|| (2-norms) for a budget, ||actual - expected|| /
    # ||expected|| for a tolerance with statistics; NaN where not computed.
    norm_rel: float = math.nan
    # The item's magnitude, in which its error is read in units of its dtype (the gate's
    # noise model, diff.py): the golden's greatest finite magnitude (or, for a scalar value,
    # the sum of its first-order terms where larger), else the expected's; NaN where unknown.
    scale: float = math.nan
    # For a budget: the same-dtype reference's own greatest and normwise relative error vs the
    # golden, the rounding noise of a plain computation of the item in its dtype (the gate
    # counts a float32 item's errors below them as noise); NaN otherwise.
    reference_error: float = math.nan
    reference_norm_rel: float = math.nan
    # How many elements the item has: the gate's rounding statistics of a half-precision
    # item's normwise error depend on it (diff.py's drift band); 0 where unknown.
    numel: int = 0
    # For a budget of SYSTEMATIC_MIN_NUMEL elements or more: the systematic part of the
    # actual's error vs the golden, a scale (relative) and a bias (relative to the golden's
    # mean magnitude); NaN otherwise.
    scale_error: float = math.nan
    bias_error: float = math.nan
    # How many of the rounding spread's runs (spread.py) the verdict consulted (0: none).
    spread_runs: int = 0


# What a failure says of an item whose actual result is None.
MISSING_HINT = "was the input a leaf with requires_grad=True, and did backward() reach it?"


def unmatched(
    label: str,
    actual: object,
    expected: torch.Tensor,
    missing: str = MISSING_HINT,
    check_dtype: bool = True,
) -> ItemCheck | None:
    """The failed check of an actual result that cannot be judged against ``expected`` (the
    reference's): None or no tensor (``missing`` says what None may mean), another shape, or,
    with ``check_dtype``, a less precise dtype. None where it can be judged."""
    if not isinstance(actual, torch.Tensor):
        what = f"None: {missing}" if actual is None else type(actual).__name__
        return ItemCheck(label, "-", math.nan, math.nan, "-", -math.inf, False, what)
    name = dtype_name(expected.dtype)
    if actual.shape != expected.shape:
        detail = f"shape {tuple(actual.shape)} differs from the reference's {tuple(expected.shape)}"
        return ItemCheck(label, name, math.nan, math.nan, "-", -math.inf, False, detail)
    if not check_dtype or not (is_inexact(actual.dtype) and is_inexact(expected.dtype)):
        return None
    if epsilon(actual.dtype) <= epsilon(expected.dtype):
        return None
    # Judged at its own dtype's tolerance, a bf16 result would pass a float32 test.
    detail = (
        f"dtype: the result is {dtype_name(actual.dtype)}, less precise than the reference's "
        f"{name}. A kernel that returns a lower precision on purpose says so with "
        "check_dtype=False (on assert_close or @pytest.mark.gradref); the item is then judged "
        f"at the reference's precision, {name}"
    )
    return ItemCheck(label, name, math.nan, math.nan, "dtype", -math.inf, False, detail)


def all_zero_hint(reference: torch.Tensor, actual: torch.Tensor | None) -> str:
    """Where the reference is all zero and the actual is not: most often a reference function
    that detaches the input or does not use it differentiably."""
    reference = reference.detach()
    if reference.numel() == 0 or bool(torch.any(reference != 0)):
        return ""
    if actual is None or not bool(torch.any(actual.detach() != 0)):
        return ""
    return (
        "\nthe reference is all zero: does the reference function use this input "
        "differentiably (no .detach(), .item(), .numpy() or integer casts on its path)?"
    )


def format_failures(header: str, checks: Sequence[ItemCheck]) -> str:
    """The message of a comparison that failed: each failed item with its detail."""
    failed = [c for c in checks if not c.passed]
    lines = [f"{header}: {len(failed)} of {len(checks)} items differ"]
    for check in failed:
        body = check.detail.replace("\n", "\n    ")
        lines.append(f"- {check.label}:\n    {body}")
    return "\n".join(lines)
