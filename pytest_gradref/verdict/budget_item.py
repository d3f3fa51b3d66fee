"""An item compared with an error budget against a golden reference: its statistics for the
batched pass, its check from them (or alone), and its failure message.

The actual result may be at most ``budget`` times as far from the golden as the same-dtype
reference is, plus a floor (tolerances.FLOOR_ULPS), so a reference that happens to land almost
exactly on the golden does not demand exactness of the kernel. With a rounded reference
(rounding.py: the reference rounded to the compute dtype after every operation) the budget
counts from the larger of the two references' errors. What each criterion allows is
budget_criteria.py's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from pytest_gradref.config.tolerances import (
    FLOOR_ULPS,
    SPREAD_SIGMAS,
    SYSTEMATIC_FLOOR,
    SYSTEMATIC_MIN_NUMEL,
    SYSTEMATIC_SIGMAS,
    dtype_name,
)
from pytest_gradref.verdict.budget_criteria import (
    BudgetErrors,
    Criterion,
    Judged,
    SideErrors,
    toward,
)
from pytest_gradref.verdict.checks import MISSING_HINT, ItemCheck, all_zero_hint, unmatched
from pytest_gradref.verdict.dtypes import epsilon, less_precise
from pytest_gradref.verdict.statistics import (
    batchable,
    difference,
    divide,
    finite,
    host_stats,
    nan_max,
    ratio,
    signed,
    stacked,
    whole_where_mixed,
    worst_index,
)
from pytest_gradref.verdict.systematic import LeastSquares, SideFit, host_fit


@dataclass(frozen=True)
class BudgetItem:
    """An item to compare with an error budget against a golden reference."""

    label: str
    actual: torch.Tensor | None
    reference: torch.Tensor
    golden: torch.Tensor
    budget: float
    # The least precise dtype among the inputs that produced the item: it sets the floor
    # where it is less precise than the item itself (a bf16 kernel's float32 loss).
    compute_dtype: torch.dtype | None = None
    missing: str = MISSING_HINT
    # The reference rounded to the compute dtype after every operation (rounding.py), where
    # asked for: the budget then counts from the larger of its error and the reference's.
    rounded: torch.Tensor | None = None
    check_dtype: bool = True
    # For a scalar value: its first-order terms x * dvalue/dx over the differentiated inputs,
    # in the golden's precision, as [sum of magnitudes, 2-norm] (a tensor where the golden
    # is). A value that is a sum of terms that cancel can be off by a few rounding steps of the
    # terms, not of the sum: the floor's scale is the larger of the first and |golden|. And a
    # kernel may round intermediates the size of its inputs at the compute dtype (a bf16
    # matmul's logits), which moves the value by about u / sqrt(3) times the second (u the
    # compute dtype's unit roundoff): the floor is at least SPREAD_SIGMAS times that.
    condition: torch.Tensor | None = None
    # The item in the rounding spread's randomly rounded runs of the reference (spread.py),
    # where the verdict asked for them (an item that failed without them): its errors there
    # are draws of a correct computation's, which the allowance may reach (``_judge``).
    samples: tuple[torch.Tensor, ...] = ()

    # ----------------------------------------------------------------- the batched pass

    def prepare(self, statistics: bool) -> torch.Tensor | ItemCheck:
        """The numbers the batched pass reads (see ``_numbers``), or the check where the item
        needs none of it: it cannot be judged, or is checked alone."""
        problem = unmatched(self.label, self.actual, self.reference, self.missing, self.check_dtype)
        if problem is not None:
            return problem
        numbers = self._numbers(statistics)
        return self.check_alone() if numbers is None else numbers

    @property
    def systematic(self) -> bool:
        """Whether the systematic criteria judge the item: a real item of at least
        SYSTEMATIC_MIN_NUMEL elements (fewer cannot tell a scale from rounding)."""
        actual = self.actual
        return (
            actual is not None
            and actual.numel() >= SYSTEMATIC_MIN_NUMEL
            and not actual.is_complex()
            and not self.golden.is_complex()
        )

    def _numbers(self, statistics: bool) -> torch.Tensor | None:
        """As a float64 tensor where the golden is (named by ``_layout``): with ``statistics``
        the actual's greatest relative error vs the golden; the golden's greatest finite
        magnitude, its norm and mean magnitude, with systematic criteria its sum; for a scalar
        value its first-order terms' sum of magnitudes and spread (``condition``); then per
        side (the actual, the reference, the rounded reference where there is one, each of the
        spread's runs) the greatest error and its norm, with systematic criteria the sums a
        least-squares fit of the error by the golden needs (``LeastSquares``): the error's sum
        and its product with the golden. None for an item the batched pass leaves out. NaN
        anywhere makes an error NaN (a NaN golden makes all NaN), which fails the item; which
        side held it is looked up for the failure message only.

        The sides are stacked and their statistics taken in one operation each, so an item
        costs the same few operations (kernel launches, on an accelerator) however many sides
        it has; a scalar's are its values alone, whose differences ``_scalar_statistics``
        takes on the host."""
        actual, reference, golden, rounded = self.actual, self.reference, self.golden, self.rounded
        assert actual is not None
        references = (reference,) if rounded is None else (reference, rounded)
        sides = (actual, *references, *self.samples)
        if not batchable(*sides, golden, on=golden.device):
            return None
        fitted = self.systematic
        if golden.numel() == 0:
            width = len(self._layout(statistics))
            return torch.zeros(width, dtype=torch.float64, device=golden.device)
        condition = [] if self.condition is None else [self.condition]
        if golden.numel() == 1:
            values = [t.detach().reshape(-1) for t in (*sides, golden, *condition)]
            if all(t.device == golden.device for t in values):
                return torch.cat(values).to(torch.float64)  # cat promotes: one operation
            return torch.cat([t.to(device=golden.device, dtype=torch.float64) for t in values])
        g = golden.detach().to(torch.float64)
        errors = signed(stacked(sides, g), g).reshape(len(sides), -1)
        magnitudes = errors.abs()
        g_finite = g.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).reshape(-1)
        finite_magnitude = g_finite.abs()
        head = [finite_magnitude.max(), g_finite.norm(), finite_magnitude.mean()]
        if statistics:
            own = magnitudes[0]
            head.insert(0, torch.where(own == 0, 0.0, own / g.abs().reshape(-1)).max())
        per_side = [magnitudes.amax(dim=1), torch.linalg.vector_norm(errors, dim=1)]
        if fitted:
            head.append(g_finite.sum())
            # A non-finite error makes its sums non-finite, which fails the fit, as the
            # greatest error fails the item.
            per_side += [errors.sum(dim=1), errors @ g_finite]
        parts = [torch.stack(head), *(c.to(g) for c in condition)]
        return torch.cat(parts + per_side)

    def _side_prefixes(self) -> list[str]:
        """How ``_numbers`` names a side's numbers: the actual's by nothing, a reference's by
        its position among them (``0.`` the reference, then the rounded reference and the
        spread's runs)."""
        references = 1 + (self.rounded is not None) + len(self.samples)
        return ["", *(f"{position}." for position in range(references))]

    def _layout(self, statistics: bool) -> list[str]:
        """The names of ``_numbers``' numbers, in order (see there)."""
        sides = self._side_prefixes()
        condition = ["condition_sum", "spread"] if self.condition is not None else []
        if self.golden.numel() == 1:
            return [side + "value" for side in sides] + ["golden", *condition]
        names = ["rel"] if statistics else []
        names += ["golden_max", "golden_norm", "mean_magnitude"]
        if self.systematic:
            names.append("sum_g")
        names += condition
        for statistic in ("max", "norm", *(("sum_e", "sum_eg") if self.systematic else ())):
            names += [side + statistic for side in sides]
        return names

    def _scalar_statistics(self, named: dict[str, float]) -> dict[str, float]:
        """A scalar item's statistics (as ``_layout`` names them) from its values, in float64
        on the host as ``_numbers`` takes a tensor's on the device: a side's error is its
        value minus the golden, 0 where the two are equal (infinities of one sign too), NaN
        where either is NaN; the golden's magnitude counts as 0 where it is not finite."""
        golden = named["golden"]
        magnitude = abs(golden) if math.isfinite(golden) else 0.0
        statistics = {
            "golden_max": magnitude,
            "golden_norm": magnitude,
            "mean_magnitude": magnitude,
        }
        for side in self._side_prefixes():
            value = named[side + "value"]
            error = 0.0 if value == golden else abs(value - golden)
            statistics[side + "max"] = statistics[side + "norm"] = error
        own = statistics["max"]
        statistics["rel"] = 0.0 if own == 0 else divide(own, abs(golden))
        for name in ("condition_sum", "spread"):
            if name in named:
                statistics[name] = named[name]
        return statistics

    def finish(self, values: Sequence[float], statistics: bool) -> ItemCheck:
        """The check from the numbers ``prepare(statistics)`` gave, read to the host."""
        actual = self.actual
        assert actual is not None
        named = dict(zip(self._layout(statistics), values))
        if self.golden.numel() == 1:
            named = self._scalar_statistics(named)
        design = None
        if self.systematic:
            design = LeastSquares(actual.numel(), named["sum_g"], named["golden_norm"] ** 2)

        def side(prefix: str) -> SideErrors:
            side_max, side_norm = named[prefix + "max"], named[prefix + "norm"]
            fit = None
            if design is not None:
                fit = design.fit(named[prefix + "sum_e"], named[prefix + "sum_eg"], side_norm**2)
            return SideErrors(side_max, side_norm, fit)

        own = side("")
        scale_se = bias_se = math.nan
        if design is not None and own.fit is not None:
            scale_se, bias_se = design.standard_errors(own.fit.residual)
        others = [side(prefix) for prefix in self._side_prefixes()[1:]]  # the references'
        rounded_sides = 2 if self.rounded is not None else 1
        # The item's scale: the golden's greatest finite magnitude, or for a scalar value the
        # sum of its first-order terms where larger (a NaN in either stays NaN, and fails).
        scale = named["golden_max"]
        if self.condition is not None:
            scale = nan_max(scale, named["condition_sum"])
        errors = BudgetErrors(
            named["max"],
            named.get("rel", math.nan),
            scale,
            named["norm"],
            named["golden_norm"],
            named.get("spread", 0.0),
            named["mean_magnitude"],
            own,
            scale_se,
            bias_se,
            others[0],
            others[1] if rounded_sides == 2 else None,
            tuple(others[rounded_sides:]),
            design,
        )
        return self._judge(errors)

    # ------------------------------------------------------------------ outside the pass

    def check_alone(self) -> ItemCheck:
        """The check outside the batched pass (complex, sparse, across devices, tensor
        subclasses...), with a host read per statistic."""
        whole = whole_where_mixed(
            {"actual": self.actual, "reference": self.reference, "golden": self.golden}
        )
        item = replace(self, **whole) if whole else self
        actual, golden = item.actual, item.golden
        assert actual is not None
        own = host_stats(actual, golden)
        scale, spread = own.scale, 0.0
        if item.condition is not None:
            scale, spread = max(scale, float(item.condition[0])), float(item.condition[1])
        design = None
        if item.systematic:
            g = golden.detach().to(torch.float64).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
            design = LeastSquares(actual.numel(), float(g.sum()), own.magnitude_norm**2)

        def side(tensor: torch.Tensor) -> SideErrors:
            stats = host_stats(tensor, golden)
            if design is None:
                return SideErrors(stats.max_abs, stats.norm)
            return SideErrors(stats.max_abs, stats.norm, host_fit(tensor, golden, design))

        own_side = side(actual)
        scale_se = bias_se = math.nan
        if own_side.fit is not None and design is not None:
            scale_se, bias_se = design.standard_errors(own_side.fit.residual)
        mean_magnitude = float(finite(golden.detach().abs().to(torch.float64)).mean())
        errors = BudgetErrors(
            own.max_abs,
            own.max_rel,
            scale,
            own.norm,
            own.magnitude_norm,
            spread,
            mean_magnitude,
            own_side,
            scale_se,
            bias_se,
            side(item.reference),
            None if item.rounded is None else side(item.rounded),
            tuple(side(sample) for sample in item.samples),
            design,
        )
        return item._judge(errors)

    # ---------------------------------------------------------------- the rounding spread

    def needs_spread(self, check: ItemCheck) -> bool:
        """Whether the item failed on its errors (not on a shape, a dtype, None or NaN), so
        that the rounding spread's runs may show it a correct computation's draw."""
        return not check.passed and math.isfinite(check.max_abs)

    def with_spread(self, samples: tuple[torch.Tensor, ...]) -> BudgetItem:
        """The item with the spread's runs of it, to be judged again."""
        return replace(self, samples=samples)

    # -------------------------------------------------------------------------- the verdict

    def _judge(self, errors: BudgetErrors) -> ItemCheck:
        """Pass when the actual's error vs the golden is within ``budget`` times the
        reference's own, plus a floor, by every criterion:

            max|actual - golden|      <= budget * max|reference - golden| + floor
            ||actual - golden||       <= budget * ||reference - golden||  + floor
            |scale|, |bias| of actual <= budget * the reference's on the actual's side of
                                         zero + 6 standard errors + floor

        The greatest error catches a wrong element; the norm an error spread thinly over
        many; the systematic criteria (the error's least-squares component along the golden,
        and its constant part) an error correlated with the result, which the norm cannot
        tell from rounding where the reference's own rounding is as large (a 1% scale error of
        a bf16 gradient). They apply to items of SYSTEMATIC_MIN_NUMEL elements or more.

        The floor is FLOOR_ULPS rounding steps of the reference's dtype at the item's scale;
        in a norm it is the error of one element off by the floor, so a scalar's two criteria
        are one; a systematic floor is SYSTEMATIC_FLOOR of the dtype's step (relative to the
        golden's mean magnitude for a bias). With a rounded reference the larger of its errors
        and the reference's counts, and the criterion names both.

        The reference's error is one draw of rounding noise. Where the item's error exceeds an
        allowance counted from it, the caller asks for the rounding spread (spread.py) and
        judges again with ``samples``: each criterion's allowance is then at least what the
        spread's runs allow (``spread_factor``), so a correct computation's draw, however its
        reference's fell, passes. NaN on any side fails. The worst element's index and the
        sides holding NaN are looked up for a failure's message.
        """
        actual, reference, golden, budget = self.actual, self.reference, self.golden, self.budget
        assert actual is not None
        dtype = reference.dtype  # judged at the reference's precision
        golden_name = dtype_name(golden.dtype)
        # The floor's steps are the reference's dtype's; with a rounded reference, which says
        # the kernel computes in the compute dtype, that dtype's where coarser (a bf16 kernel's
        # float32 sum carries bf16 rounding, which the rounded reference may miss by luck).
        floor_dtype = dtype
        if self.rounded is not None and self.compute_dtype is not None:
            floor_dtype = less_precise(dtype, self.compute_dtype)
        steps = FLOOR_ULPS.get(dtype_name(floor_dtype), 1)
        floor = steps * epsilon(floor_dtype) * errors.scale
        floor_text = f"floor {floor:.3g}"
        floor_why = (
            f"{steps:g} {dtype_name(floor_dtype)} steps at the item's scale {errors.scale:.3g}"
        )
        spread_dtype = self.compute_dtype if self.compute_dtype is not None else dtype
        spread_floor = SPREAD_SIGMAS * epsilon(spread_dtype) / 2 / math.sqrt(3) * errors.spread
        if spread_floor > floor:
            floor = spread_floor
            floor_text = f"floor {floor:.3g}"
            floor_why = (
                f"{SPREAD_SIGMAS:g} times the spread of the value's error under one more "
                f"{dtype_name(spread_dtype)} rounding of each input"
            )
        floor_norm = floor
        if epsilon(actual.dtype) > epsilon(dtype):
            # A less precise actual let through by check_dtype=False: judged at the
            # reference's precision, but no result of its dtype can be nearer than its own
            # rounding, at most half a step of each element (so, in a norm, of the golden's
            # norm).
            rounding = epsilon(actual.dtype) / 2
            floor = max(floor, rounding * errors.scale)
            floor_norm = max(floor, rounding * errors.golden_norm)
            floor_text = (
                f"floor {floor:.3g} (normwise {floor_norm:.3g}: the {dtype_name(actual.dtype)} "
                "result's own rounding)"
            )
        # The errors the budget counts from, whose they are, and the other reference's.
        basis = errors.reference
        basis_name = f"the {dtype_name(reference.dtype)} reference"
        other = ""
        bases = [errors.reference]
        if errors.rounded is not None:
            bases.append(errors.rounded)
            rounded_dtype = self.compute_dtype if self.compute_dtype is not None else dtype
            rounded_name = f"the {dtype_name(rounded_dtype)}-rounded reference"
            rounded = errors.rounded
            # A NaN error on either side becomes the basis, so the allowance is NaN and fails.
            if math.isnan(rounded.max) or rounded.max > basis.max:
                other = f"{basis_name}'s is {basis.max:.3g}"
                basis, basis_name = rounded, rounded_name
            else:
                other = f"{rounded_name}'s is {rounded.max:.3g}"
        judged = [
            Judged(Criterion.GREATEST, errors.own.max, basis.max, floor),
            Judged(Criterion.NORMWISE, errors.own.norm, max(b.norm for b in bases), floor_norm),
        ]
        fitted = (
            errors.design is not None
            and math.isfinite(errors.scale_se)
            and math.isfinite(errors.bias_se)
        )
        # A systematic error may be the reference's own (a kernel that computes an item as the
        # reference does shares its rounding, and the error of a cancelling sum repeated over
        # rows fits as a bias), up to the budget, plus SYSTEMATIC_SIGMAS of its standard
        # errors and the floor, one rounding of a shared factor (a bf16 1/N), or what the
        # rounding spread allows. A rounded reference (rounded=True) counts too: rounding to
        # nearest at every step can be biased.
        systematic_floor = SYSTEMATIC_FLOOR * steps * epsilon(floor_dtype)
        if fitted:
            judged += [
                Judged(
                    Criterion.SCALE,
                    abs(errors.own.scale),
                    toward(errors.own.scale, [b.scale for b in bases]),
                    systematic_floor,
                    SYSTEMATIC_SIGMAS * errors.scale_se,
                ),
                Judged(
                    Criterion.BIAS,
                    abs(errors.own.bias),
                    toward(errors.own.bias, [b.bias for b in bases]),
                    systematic_floor * errors.mean_magnitude,
                    SYSTEMATIC_SIGMAS * errors.bias_se,
                ),
            ]
        if errors.samples:
            judged = [j.with_spread(errors, budget) for j in judged]
        used = max(j.share(budget) for j in judged)
        passed = all(j.passed(budget) for j in judged)
        larger = f", the larger: {other}" if other else ""
        criterion = (
            f"budget {budget:g}x {basis_name}'s error vs the {golden_name} golden, greatest and "
            f"normwise ({basis.max:.3g} and {max(b.norm for b in bases):.3g}{larger}) + "
            f"{floor_text} ({floor_why})"
        )
        if fitted:
            criterion += (
                f"; systematic error (scale, bias) within {SYSTEMATIC_SIGMAS:g} standard "
                f"errors + floor {systematic_floor:.3g}"
            )
        if errors.samples:
            criterion += (
                f"; rounding spread of {len(errors.samples)} randomly rounded runs of the reference"
            )
        detail = ""
        if not passed:
            detail = self._failure(errors, judged, basis_name, other, floor_text)
        return ItemCheck(
            self.label,
            dtype_name(dtype),
            errors.own_max,
            errors.own_rel,
            criterion,
            1 - used,
            passed,
            detail,
            errors.rounded.max if errors.rounded is not None else None,
            norm_rel=ratio(errors.own_norm, errors.golden_norm),
            scale=errors.scale,
            reference_error=errors.reference.max,
            reference_norm_rel=ratio(errors.reference.norm, errors.golden_norm),
            numel=actual.numel(),
            scale_error=errors.own.scale if fitted else math.nan,
            bias_error=ratio(errors.own.bias, errors.mean_magnitude) if fitted else math.nan,
            spread_runs=len(errors.samples),
        )

    def _failure(
        self,
        errors: BudgetErrors,
        judged: Sequence[Judged],
        basis_name: str,
        other: str,
        floor_text: str,
    ) -> str:
        """A failed budget's message: each criterion that failed, with the errors, their
        ratio and what was allowed (and what the rounding spread allowed, where it was asked
        for); the sides that hold NaN; an all-zero reference of a nonzero golden."""
        actual, golden, budget = self.actual, self.golden, self.budget
        assert actual is not None
        golden_name = dtype_name(golden.dtype)
        also = f" ({other})" if other else ""
        lines = []
        reference_fit = errors.reference.fit
        for j in judged:
            if j.passed(budget):
                continue
            allowed = j.allowed(budget)
            own = f"{_times(j.error, j.basis)} {basis_name}'s own {j.basis:.3g}"
            if j.criterion is Criterion.GREATEST:
                line = (
                    f"greatest error vs the {golden_name} golden: {j.error:.3g} at index "
                    f"{worst_index(actual, golden)} (greatest relative "
                    f"{self._greatest_relative(errors):.3g}), "
                    f"{own}{also}; allowed: budget {budget:g} x {j.basis:.3g} + {floor_text}"
                )
            elif j.criterion is Criterion.NORMWISE:
                relative = ratio(j.error, errors.golden_norm)
                line = (
                    f"normwise error vs the {golden_name} golden: {j.error:.3g} (relative "
                    f"{relative:.3g}), {own}; allowed: budget {budget:g} x {j.basis:.3g} + floor"
                )
            else:
                if j.criterion is Criterion.SCALE:
                    what = (
                        f"a scale of {errors.own.scale:+.3g} (the error's least-squares "
                        "component along the golden; the reference's own: "
                        f"{_fitted(reference_fit, 'scale')})"
                    )
                else:
                    what = (
                        f"a bias of {errors.own.bias:+.3g}, "
                        f"{ratio(errors.own.bias, errors.mean_magnitude):+.3g} of the golden's "
                        f"mean magnitude {errors.mean_magnitude:.3g} (the reference's own: "
                        f"{_fitted(reference_fit, 'bias')})"
                    )
                standard_error = j.extra / SYSTEMATIC_SIGMAS
                line = (
                    f"systematic error vs the {golden_name} golden: {what}, "
                    f"{_times(j.error, standard_error)} its standard error {standard_error:.2g} "
                    f"(from the rest of the error); allowed: "
                    + (
                        f"budget {budget:g} x {basis_name}'s {j.basis:.3g} + "
                        if j.basis
                        else "(none of the reference's own, which leans the other way or is 0) "
                    )
                    + f"{SYSTEMATIC_SIGMAS:g} standard errors + floor {j.floor:.3g}"
                )
            line += f" = {allowed:.3g}"
            if not math.isnan(j.spread_rms):
                plus = "and the floor in quadrature" if j.criterion.systematic else "+ floor"
                line += (
                    f"; the rounding spread ({len(errors.samples)} randomly rounded runs of the "
                    f"reference) allows "
                    f"{j.spread_factor:.3g} x their rms {j.spread_rms:.3g} {plus}"
                )
            lines.append(line)
        sides = [("actual result", actual), ("reference", self.reference), ("golden", golden)]
        if self.rounded is not None:
            sides.append(("rounded reference", self.rounded))
        nan_sides = [side for side, t in sides if bool(t.detach().isnan().any())]
        text = "\n".join(lines) + "".join(f" (the {side} has NaN)" for side in nan_sides)
        return text + all_zero_hint(self.reference, actual)

    def _greatest_relative(self, errors: BudgetErrors) -> float:
        """The actual's greatest relative error vs the golden: from the batched pass where it
        was computed (with statistics), else looked up for a failure's message."""
        if not math.isnan(errors.own_rel):
            return errors.own_rel
        assert self.actual is not None
        diff, magnitude = difference(self.actual, self.golden)
        return float(torch.where(diff == 0, 0.0, diff / magnitude).max())


def _fitted(fit: SideFit | None, name: str) -> str:
    """A side's systematic error in a message: signed, or "-" where it has no fit."""
    return "-" if fit is None else f"{getattr(fit, name):+.3g}"


def _times(error: float, basis: float) -> str:
    return f"{error / basis:.3g}x" if basis > 0 else "infinitely many times"
