"""What an error budget judges: an item's errors against the golden read to the host (its own,
the references', the rounding spread's runs'), each criterion's allowance, and how the
rounding spread widens it."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pytest_gradref.config.tolerances import SPREAD_VARIATIONS
from pytest_gradref.verdict.systematic import LeastSquares, SideFit


class Criterion(enum.Enum):
    """What a budget judges of an item's error vs the golden."""

    GREATEST = "greatest error"
    NORMWISE = "normwise error"
    SCALE = "systematic error, a scale"
    BIAS = "systematic error, a bias"

    @property
    def systematic(self) -> bool:
        return self in (Criterion.SCALE, Criterion.BIAS)


@dataclass(frozen=True)
class SideErrors:
    """One side's error vs the golden, read to the host: greatest and normwise, and where
    the item has systematic criteria its least-squares fit (NaN without one)."""

    max: float
    norm: float
    fit: SideFit | None = None

    @property
    def scale(self) -> float:
        return math.nan if self.fit is None else self.fit.scale

    @property
    def bias(self) -> float:
        return math.nan if self.fit is None else self.fit.bias

    @property
    def residual(self) -> float:
        return math.nan if self.fit is None else self.fit.residual

    def of(self, criterion: Criterion) -> float:
        """This side's error by ``criterion`` (signed, for a systematic one)."""
        return {
            Criterion.GREATEST: self.max,
            Criterion.NORMWISE: self.norm,
            Criterion.SCALE: self.scale,
            Criterion.BIAS: self.bias,
        }[criterion]


@dataclass(frozen=True)
class BudgetErrors:
    """What a budget judges, read to the host: the actual's greatest relative error, the
    golden's norm, mean magnitude and the item's scale, the value's first-order spread; the
    actual's errors and the standard errors of its systematic part; the reference's, the
    rounded reference's (None without one) and those of each of the rounding spread's runs
    (none where it was not asked for)."""

    own_max: float
    own_rel: float
    scale: float
    own_norm: float
    golden_norm: float
    spread: float  # the 2-norm of a scalar value's first-order terms (0 for other items)
    mean_magnitude: float
    own: SideErrors
    scale_se: float
    bias_se: float
    reference: SideErrors
    rounded: SideErrors | None = None
    samples: tuple[SideErrors, ...] = ()
    # The golden's least-squares design, for an item with systematic criteria.
    design: LeastSquares | None = None


@dataclass(frozen=True)
class Judged:
    """One criterion as judged: the actual's error (its magnitude), the basis it counts from
    (the reference's, or the larger of the two references'), the floor, the extra allowance
    of a systematic criterion (standard errors), the allowance of the rounding spread where it
    was asked for (factor x rms of its runs, NaN otherwise), and what is allowed: the larger of
    ``budget x basis + extra + floor`` and ``spread + floor``."""

    criterion: Criterion
    error: float
    basis: float
    floor: float
    extra: float = 0.0
    spread_factor: float = math.nan
    spread_rms: float = math.nan

    def allowed(self, budget: float) -> float:
        own = budget * self.basis + self.extra + self.floor
        if math.isnan(self.spread_rms) or math.isnan(own):
            return own
        spread = self.spread_factor * self.spread_rms
        if self.criterion.systematic:
            # A systematic floor is one rounding of a shared factor, independent of the
            # rounding the spread's runs draw: the two add as independent errors do.
            return max(own, math.hypot(spread, self.floor))
        return max(own, spread + self.floor)

    def passed(self, budget: float) -> bool:
        return self.error <= self.allowed(budget)  # False where either is NaN

    def share(self, budget: float) -> float:
        """The share of the allowance the error uses (NaN for a NaN allowance)."""
        allowed = self.allowed(budget)
        if allowed > 0 or math.isnan(allowed):
            return self.error / allowed
        return 0.0 if self.error == 0 else math.inf

    def with_spread(self, errors: BudgetErrors, budget: float) -> Judged:
        """The criterion with the rounding spread's allowance (``spread_factor`` of its runs'
        values). A systematic criterion's is scaled by the actual's noise against the runs'
        (the norms of what the fit leaves, at most 1): rounding that leaves little noise
        leaves a proportionately small scale, so a kernel that rounds once is not let off by
        the spread of one that rounds at every step."""
        samples = errors.samples
        factor, rms = spread_factor([s.of(self.criterion) for s in samples], budget)
        if self.criterion.systematic:
            _, noise = spread_factor([s.residual for s in samples], budget)
            if noise > 0 and math.isfinite(errors.own.residual):
                rms *= min(1.0, errors.own.residual / noise)
        return replace(self, spread_factor=factor, spread_rms=rms)


def spread_factor(values: Sequence[float], budget: float) -> tuple[float, float]:
    """The rounding spread's allowance for a criterion, as (factor, rms) of the magnitudes
    its runs gave: the error of a correct computation may reach ``factor x rms``. The runs
    round stochastically, whose error variance is twice round-to-nearest's, so the rms is
    theirs divided by sqrt(2). The factor is 1 + SPREAD_VARIATIONS coefficients of variation
    of those magnitudes, at least the budget: a criterion that is nearly the same in every run
    (the norm of a large gradient's error) gets the budget; one as variable as a single
    rounding error (a scalar, a sum that cancels, a scale) gets about 7, which a correct
    scalar exceeds less than once in 1e5 with 16 runs (tests/plugin/verdict/test_verdict_noise.py
    simulates the rate). (NaN, NaN) without finite runs."""
    finite = [abs(v) for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    mean_square = sum(v * v for v in finite) / len(finite)
    rms = math.sqrt(mean_square)
    if rms == 0:
        return budget, 0.0
    mean = sum(finite) / len(finite)
    variation = math.sqrt(max(mean_square - mean * mean, 0.0)) / rms
    return max(budget, 1 + SPREAD_VARIATIONS * variation), rms / math.sqrt(2)


def toward(own: float, references: Sequence[float]) -> float:
    """The references' systematic error (a scale or a bias) that counts toward the actual's:
    the largest on the actual's side of zero, 0 where every one lies on the other side. A
    correct kernel's systematic error lies between none (exact arithmetic, or a finer dtype)
    and the reference's (rounding where the reference rounds), so the reference's is allowed in
    its own direction only: a 1% scale error against a reference whose own rounding leans the
    other way is not hidden by twice that lean."""
    sign = 1.0 if own >= 0 else -1.0
    return max([0.0, *(sign * r for r in references)])
