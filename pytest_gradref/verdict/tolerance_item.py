"""An item compared with a tolerance, as torch.testing.assert_close compares it: its statistics
for the batched pass, its verdict from them, its check alone, and its failure message
(torch.testing's own)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from pytest_gradref.config.tolerances import ResolvedTolerance, dtype_name
from pytest_gradref.verdict.checks import MISSING_HINT, ItemCheck, all_zero_hint, unmatched
from pytest_gradref.verdict.dtypes import epsilon
from pytest_gradref.verdict.statistics import (
    batchable,
    difference,
    finite,
    host_stats,
    ratio,
    whole_where_mixed,
)

# An item whose share of the tolerance used, computed in float64, lies above 1 or within this
# many rounding steps of the promoted dtype below it gets torch.testing's own verdict: isclose
# in bfloat16 or float16 rounds |a - e| and atol + rtol * |e| by up to a step each, so the two
# part near the limit (tests/plugin/verdict/test_assert_close.py finds such pairs).
_CONFIRM_STEPS = 4


@dataclass(frozen=True)
class ToleranceItem:
    """An item to compare with a tolerance, as torch.testing.assert_close would."""

    label: str
    actual: torch.Tensor | None
    expected: torch.Tensor
    resolved: ResolvedTolerance
    missing: str = MISSING_HINT
    # False: an actual less precise than the expected is judged, not failed on its dtype.
    check_dtype: bool = True

    def prepare(self, statistics: bool) -> torch.Tensor | ItemCheck:
        """The numbers the batched pass reads (see ``_numbers``), or the check where the item
        needs none of it: it cannot be judged, is empty, or is checked alone."""
        problem = unmatched(self.label, self.actual, self.expected, self.missing, self.check_dtype)
        if problem is not None:
            return problem
        actual, expected = self.actual, self.expected
        assert actual is not None
        if actual.device != expected.device or not batchable(actual, expected, on=expected.device):
            return self.check_alone()
        if expected.numel() == 0:
            return self._check(0.0, 0.0, 0.0, passed=True)
        return self._numbers(statistics)

    def _numbers(self, statistics: bool) -> torch.Tensor:
        """Without ``statistics``: whether every element is close, decided exactly as
        torch.testing.assert_close decides it (isclose in the promoted dtype), as a
        one-element bool tensor (the batched read promotes it with the other items' numbers: 1
        or 0); two operations, as torch.testing's own, less its host read.

        With them: the greatest |a - e|, the greatest relative difference, the greatest share
        of the tolerance used and the expected's greatest finite magnitude, then the
        difference's and the expected's norms, in float64; the verdict is read from that share
        (see ``finish``), which spares the isclose pass."""
        actual, expected = self.actual, self.expected.detach()
        assert actual is not None
        actual = actual.detach()
        tol = self.resolved.tolerance
        if not statistics:
            dtype = torch.promote_types(actual.dtype, expected.dtype)
            close = torch.isclose(
                actual.to(dtype), expected.to(dtype), rtol=tol.rtol, atol=tol.atol, equal_nan=False
            )
            return close.all()[None]
        diff, magnitude = difference(actual, expected)
        exact = diff == 0
        max_abs = diff.max()
        max_rel = torch.where(exact, 0.0, diff / magnitude).max()
        norms = torch.stack([diff.norm(), finite(magnitude).norm()])
        scale = finite(magnitude).max()
        used = diff.div_(magnitude.mul_(tol.rtol).add_(tol.atol))
        if tol.atol == 0:  # equal zeros would divide 0 by 0
            used = torch.where(exact, 0.0, used)
        return torch.cat([torch.stack([max_abs, max_rel, used.max(), scale]), norms])

    def finish(self, values: Sequence[float], statistics: bool) -> ItemCheck:
        """The check from the numbers ``prepare(statistics)`` gave, read to the host."""
        if not statistics:  # the verdict alone: whether all are close
            return self._check(math.nan, math.nan, math.nan, passed=bool(values[0]))
        max_abs, max_rel, used, scale, diff_norm, expected_norm = values
        assert self.actual is not None
        promoted = torch.promote_types(self.actual.dtype, self.expected.dtype)
        clear = used <= 1 - _CONFIRM_STEPS * epsilon(promoted)  # False for NaN
        return self._check(
            max_abs,
            max_rel,
            used,
            passed=True if clear else None,
            norm_rel=ratio(diff_norm, expected_norm),
            scale=scale,
        )

    def check_alone(self) -> ItemCheck:
        """The check outside the batched pass (complex, sparse, across devices, tensor
        subclasses...), with a host read per statistic."""
        whole = whole_where_mixed({"actual": self.actual, "expected": self.expected})
        item = replace(self, **whole) if whole else self
        assert item.actual is not None
        tol = item.resolved.tolerance
        stats = host_stats(item.actual, item.expected, tol.rtol, tol.atol)
        return item._check(
            stats.max_abs,
            stats.max_rel,
            stats.used,
            passed=None,
            norm_rel=ratio(stats.norm, stats.magnitude_norm),
            scale=stats.scale,
        )

    def needs_spread(self, check: ItemCheck) -> bool:
        """A tolerance does not consult the rounding spread."""
        return False

    def with_spread(self, samples: tuple[torch.Tensor, ...]) -> ToleranceItem:
        return self

    def _check(
        self,
        max_abs: float,
        max_rel: float,
        used: float,
        passed: bool | None,
        norm_rel: float = math.nan,
        scale: float = math.nan,
    ) -> ItemCheck:
        """torch.testing.assert_close writes the failure detail; it runs when the item failed
        (``passed`` False) or when no verdict was computed yet (None)."""
        actual = self.actual
        assert actual is not None
        tol = self.resolved.tolerance
        criterion = f"rtol={tol.rtol:g}, atol={tol.atol:g} from {self.resolved.source}"
        detail = ""
        if not passed:
            try:
                torch.testing.assert_close(
                    actual.detach(),
                    self.expected.detach(),
                    rtol=tol.rtol,
                    atol=tol.atol,
                    check_dtype=False,
                    check_device=False,
                    equal_nan=False,
                )
                passed = True
            except AssertionError as error:
                detail = f"{str(error).strip()}\ntolerance {criterion}"
                detail += all_zero_hint(self.expected, actual)
                passed = False
            except RuntimeError as error:
                # torch.testing itself failed on this tensor type (torch 2.6 on a DTensor,
                # while writing its mismatch message): the verdict and the detail come from
                # the float64 statistics instead.
                if math.isnan(used):
                    stats = host_stats(actual, self.expected, tol.rtol, tol.atol)
                    max_abs, max_rel, used = stats.max_abs, stats.max_rel, stats.used
                passed = used <= 1
                detail = (
                    ""
                    if passed
                    else (
                        f"greatest absolute difference {max_abs:.3g}, greatest relative "
                        f"{max_rel:.3g}, {used:.3g} times the tolerance (torch.testing could "
                        f"not describe this {type(actual).__name__}: "
                        f"{str(error).splitlines()[0]})\ntolerance {criterion}"
                    )
                )
        return ItemCheck(
            self.label,
            dtype_name(self.expected.dtype),  # judged at the reference's dtype
            max_abs,
            max_rel,
            criterion,
            1 - used,
            passed,
            detail,
            norm_rel=norm_rel,
            scale=scale,
            numel=actual.numel(),
        )
