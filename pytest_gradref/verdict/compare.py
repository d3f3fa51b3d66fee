"""The comparison of actual results with a reference: items, their checks, failure messages.

Two criteria:
- a tolerance: torch.testing.assert_close's defaults, loosened per dtype by a backend or
  overridden by a test (the tables are tolerances.py's); every check says where its
  tolerance came from;
- an error budget against a golden (higher-precision) reference: the actual result may be at
  most ``budget`` times as far from the golden as the same-dtype reference is, plus a floor
  (tolerances.FLOOR_ULPS), so a reference that happens to land almost exactly on the golden
  does not demand exactness of the kernel. With a rounded reference (rounding.py: the
  reference rounded to the compute dtype after every operation) the budget counts from the
  larger of the two references' errors.

Each check yields an ``ItemCheck`` with its statistics, for the failure message and the report.
``check_items`` is the one judge of items: an ``assert_close`` and a crosscheck (two
strategies' results) both hand it their items, and it compares all of them with one host read
(see there).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from operator import methodcaller
from typing import Union

import torch

from pytest_gradref.config.tolerances import (
    FLOOR_ULPS,
    SPREAD_SIGMAS,
    SPREAD_VARIATIONS,
    SYSTEMATIC_FLOOR,
    SYSTEMATIC_MIN_NUMEL,
    SYSTEMATIC_SIGMAS,
    ResolvedTolerance,
    Tolerance,
    dtype_name,
)
from pytest_gradref.verdict.dtypes import epsilon, is_inexact, less_precise


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
    # are draws of a correct computation's, which the allowance may reach (_budget_check).
    samples: tuple[torch.Tensor, ...] = ()


Item = Union[ToleranceItem, BudgetItem]


def check_items(items: Sequence[Item], *, statistics: bool = True) -> list[ItemCheck]:
    """Compare every item, reading the host once per device whatever their number.

    Each item's verdict and statistics are computed on its device into a few float64 numbers;
    the numbers of all items are read to the host together (one ``tolist``, one sync on an
    accelerator). The detail of a failed item (torch.testing's message, the worst element's
    index) is computed afterwards, for the failed items only. Items are not concatenated: an
    operation over a larger tensor runs on several threads on the CPU, which costs far more
    than it saves when other processes hold the cores.

    With ``statistics=False`` a tolerance check computes its verdict alone (torch.testing's
    cost), for runs that neither report nor show the statistics; a budget's statistics are
    its criterion, so they are computed either way, all but the greatest relative error,
    which a failure's message looks up. An actual result less precise than its
    reference fails on its dtype (``check_dtype``), before any statistics.
    """
    __tracebackhide__ = True
    checks: list[ItemCheck | None] = [None] * len(items)
    # Per device: the position of each item and a tensor of its numbers (float64; a bool
    # verdict for a tolerance without statistics, which the concatenation promotes).
    pending: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for position, item in enumerate(items):
        expected = item.expected if isinstance(item, ToleranceItem) else item.reference
        problem = _shape_problem(item.label, item.actual, expected, item.missing)
        if problem is None and item.check_dtype:
            problem = _dtype_problem(item.label, item.actual, expected)
        if problem is not None:
            checks[position] = problem
            continue
        actual = item.actual
        assert actual is not None
        if isinstance(item, ToleranceItem):
            if actual.device != expected.device or not _batchable(
                actual, expected, on=expected.device
            ):
                checks[position] = _check_alone(item)  # compared on its own, as before
                continue
            if expected.numel() == 0:
                checks[position] = _tolerance_check(item, 0.0, 0.0, 0.0, passed=True)
                continue
            stats: torch.Tensor | None = _tolerance_stats(item, statistics)
        else:
            stats = _budget_stats(item, statistics)
        if stats is None:
            checks[position] = _check_alone(item)
        else:
            pending.setdefault(stats.device, []).append((position, stats))
    for group in pending.values():
        numbers = torch.cat([stats for _, stats in group]).tolist()  # the one host read
        offset = 0
        for position, stats in group:
            width = stats.numel()
            values = numbers[offset : offset + width]
            checks[position] = _finish(items[position], values, statistics)
            offset += width
    return [check for check in checks if check is not None]


def _batchable(*tensors: torch.Tensor, on: torch.device) -> bool:
    """Real floating strided plain tensors, compared in float64 on ``on`` (where they are, for
    a tolerance; where the golden is, for a budget).

    A tensor subclass (DTensor, a wrapper subclass with ``__torch_dispatch__``) cannot be read
    in bulk (``tolist`` refuses it, and its statistics are subclass tensors too): its items
    take ``_check_alone``, whose operations and scalar reads go through the subclass, as
    torch.testing's do. ``type(t)`` rather than isinstance, since every subclass is an
    instance of torch.Tensor; a plain nn.Parameter is a plain tensor.
    """
    plain = (torch.Tensor, torch.nn.Parameter)
    return on.type != "mps" and all(
        type(t) in plain
        and t.is_floating_point()
        and t.dtype.itemsize > 1
        and t.layout == torch.strided
        for t in tensors
    )


def _tolerance_stats(item: ToleranceItem, statistics: bool = True) -> torch.Tensor:
    """Without ``statistics``: whether every element is close, decided exactly as
    torch.testing.assert_close decides it (isclose in the promoted dtype), as a one-element
    bool tensor (the batched read promotes it with the other items' numbers: 1 or 0); two
    operations, as torch.testing's own, less its host read.

    With them: the greatest |a - e|, the greatest relative difference and the greatest share
    of the tolerance used, in float64; the verdict is read from that share (see ``_finish``),
    which spares the isclose pass. The item is non-empty, with both tensors on one device.
    """
    actual, expected = item.actual, item.expected.detach()
    assert actual is not None
    actual = actual.detach()
    tol = item.resolved.tolerance
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
    norms = torch.stack([diff.norm(), _finite(magnitude).norm()])
    scale = _finite(magnitude).max()
    used = diff.div_(magnitude.mul_(tol.rtol).add_(tol.atol))
    if tol.atol == 0:  # equal zeros would divide 0 by 0
        used = torch.where(exact, 0.0, used)
    return torch.cat([torch.stack([max_abs, max_rel, used.max(), scale]), norms])


def _budget_stats(item: BudgetItem, statistics: bool = True) -> torch.Tensor | None:
    """As a float64 tensor where the golden is (named by ``_layout``): with ``statistics``
    the actual's greatest relative error vs the golden; the golden's greatest finite
    magnitude, its norm and mean magnitude, with a systematic criterion (``systematic``) its
    sum; for a scalar value its first-order terms' sum of magnitudes and spread
    (``condition``); then per side (the actual, the reference, the rounded reference where
    there is one, each of the spread's runs) the greatest error and its norm, with a
    systematic criterion the sums a least-squares fit of the error by the golden needs
    (``LeastSquares``): the error's sum and its product with the golden. None for an item the
    batched pass leaves out. NaN anywhere makes an error NaN (a NaN golden makes all NaN),
    which fails the item; which side held it is looked up for the failure message only.

    The sides are stacked and their statistics taken in one operation each, so an item costs
    the same few operations (kernel launches, on an accelerator) however many sides it has;
    a scalar's are its values alone, whose differences ``_scalar_statistics`` takes on the
    host."""
    actual, reference, golden, rounded = item.actual, item.reference, item.golden, item.rounded
    assert actual is not None
    references = (reference,) if rounded is None else (reference, rounded)
    sides = (actual, *references, *item.samples)
    if not _batchable(*sides, golden, on=golden.device):
        return None
    fitted = systematic(item)
    if golden.numel() == 0:
        width = len(_layout(item, fitted, statistics))
        return torch.zeros(width, dtype=torch.float64, device=golden.device)
    condition = [] if item.condition is None else [item.condition]
    if golden.numel() == 1:
        values = [t.detach().reshape(-1) for t in (*sides, golden, *condition)]
        if all(t.device == golden.device for t in values):
            return torch.cat(values).to(torch.float64)  # cat promotes: one operation
        return torch.cat([t.to(device=golden.device, dtype=torch.float64) for t in values])
    g = golden.detach().to(torch.float64)
    errors = _signed(_stacked(sides, g), g).reshape(len(sides), -1)
    magnitudes = errors.abs()
    g_finite = g.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).reshape(-1)
    finite = g_finite.abs()
    head = [finite.max(), g_finite.norm(), finite.mean()]
    if statistics:
        own = magnitudes[0]
        head.insert(0, torch.where(own == 0, 0.0, own / g.abs().reshape(-1)).max())
    per_side = [magnitudes.amax(dim=1), torch.linalg.vector_norm(errors, dim=1)]
    if fitted:
        head.append(g_finite.sum())
        # A non-finite error makes its sums non-finite, which fails the fit, as the greatest
        # error fails the item.
        per_side += [errors.sum(dim=1), errors @ g_finite]
    parts = [torch.stack(head), *(c.to(g) for c in condition)]
    return torch.cat(parts + per_side)


def _stacked(tensors: Sequence[torch.Tensor], golden: torch.Tensor) -> torch.Tensor:
    """The tensors (each of the golden's shape) stacked into one float64 tensor where the
    golden is."""
    first = tensors[0]
    if all(t.dtype == first.dtype and t.device == golden.device for t in tensors):
        return torch.stack([t.detach() for t in tensors]).to(torch.float64)
    return torch.stack([t.detach().to(device=golden.device, dtype=torch.float64) for t in tensors])


def _signed(actual: torch.Tensor, golden: torch.Tensor) -> torch.Tensor:
    """actual - golden (float64 tensors on one device, broadcast), 0 where the two are equal
    (infinities of one sign too, as torch.testing has them), NaN where either is NaN."""
    return torch.where(actual == golden, 0.0, actual - golden)


def systematic(item: BudgetItem) -> bool:
    """Whether the systematic criteria judge the item: a real item of at least
    SYSTEMATIC_MIN_NUMEL elements (fewer cannot tell a scale from rounding)."""
    actual = item.actual
    return (
        actual is not None
        and actual.numel() >= SYSTEMATIC_MIN_NUMEL
        and not actual.is_complex()
        and not item.golden.is_complex()
    )


def _side_prefixes(item: BudgetItem) -> list[str]:
    """How _budget_stats names a side's numbers: the actual's by nothing, a reference's by its
    position among them (``0.`` the reference, then the rounded reference and the spread's
    runs)."""
    references = 1 + (item.rounded is not None) + len(item.samples)
    return ["", *(f"{position}." for position in range(references))]


def _layout(item: BudgetItem, fitted: bool, statistics: bool) -> list[str]:
    """The names of _budget_stats' numbers, in order (see there)."""
    sides = _side_prefixes(item)
    condition = ["condition_sum", "spread"] if item.condition is not None else []
    if item.golden.numel() == 1:
        return [side + "value" for side in sides] + ["golden", *condition]
    names = ["rel"] if statistics else []
    names += ["golden_max", "golden_norm", "mean_magnitude"]
    if fitted:
        names.append("sum_g")
    names += condition
    for statistic in ("max", "norm", *(("sum_e", "sum_eg") if fitted else ())):
        names += [side + statistic for side in sides]
    return names


def _scalar_statistics(item: BudgetItem, named: dict[str, float]) -> dict[str, float]:
    """A scalar item's statistics (as _layout names them) from its values, in float64 on the
    host as _budget_stats takes a tensor's on the device: a side's error is its value minus
    the golden, 0 where the two are equal (infinities of one sign too), NaN where either is
    NaN; the golden's magnitude counts as 0 where it is not finite."""
    golden = named["golden"]
    magnitude = abs(golden) if math.isfinite(golden) else 0.0
    statistics = {
        "golden_max": magnitude,
        "golden_norm": magnitude,
        "mean_magnitude": magnitude,
    }
    for side in _side_prefixes(item):
        value = named[side + "value"]
        error = 0.0 if value == golden else abs(value - golden)
        statistics[side + "max"] = statistics[side + "norm"] = error
    own = statistics["max"]
    statistics["rel"] = 0.0 if own == 0 else _divide(own, abs(golden))
    for name in ("condition_sum", "spread"):
        if name in named:
            statistics[name] = named[name]
    return statistics


def _divide(a: float, b: float) -> float:
    """a / b for magnitudes as float64 tensors divide them (inf for a nonzero a over 0, NaN
    for 0 / 0)."""
    if b == 0:
        return math.nan if a == 0 or math.isnan(a) else math.inf
    return a / b


@dataclass(frozen=True)
class LeastSquares:
    """The least-squares fit of an error ``e`` by ``scale * golden + bias``, from sums: the
    part of an error that is correlated with the result (a scale) or the same everywhere (a
    bias), which rounding is not. ``n`` elements, the golden's sum and sum of squares
    (non-finite elements count as zeros). With the golden (nearly) constant the two cannot be
    told apart, and the fit is a scale alone. The standard errors are the fit's own, from what
    it leaves (the residual) as if every element erred independently and alike; elements that
    err together are what the rounding spread's runs are for (spread.py)."""

    n: float
    sum_g: float
    sum_gg: float

    @property
    def _det(self) -> float:
        return self.n * self.sum_gg - self.sum_g * self.sum_g

    @property
    def separable(self) -> bool:
        return self._det > 1e-9 * self.n * self.sum_gg

    def fit(self, sum_e: float, sum_eg: float, sum_ee: float) -> SideFit:
        if self.separable:
            scale = (self.n * sum_eg - self.sum_g * sum_e) / self._det
            bias = (self.sum_gg * sum_e - self.sum_g * sum_eg) / self._det
        else:
            scale = sum_eg / self.sum_gg if self.sum_gg > 0 else 0.0
            bias = 0.0
        residual = sum_ee - scale * sum_eg - bias * sum_e
        return SideFit(scale, bias, math.sqrt(max(residual, 0.0)))

    def standard_errors(self, residual_norm: float) -> tuple[float, float]:
        """The scale's and the bias's."""
        if self.separable:
            variance = residual_norm**2 / max(self.n - 2, 1)
            return math.sqrt(variance * self.n / self._det), math.sqrt(
                variance * self.sum_gg / self._det
            )
        if self.sum_gg <= 0:
            return 0.0, 0.0
        variance = residual_norm**2 / max(self.n - 1, 1)
        return math.sqrt(variance / self.sum_gg), 0.0


@dataclass(frozen=True)
class SideFit:
    """One side's systematic error: a scale (relative), a bias (in the item's units), and
    the norm of the rest (its noise)."""

    scale: float
    bias: float
    residual: float


def _finite(magnitude: torch.Tensor) -> torch.Tensor:
    """Magnitudes with NaN and infinities as 0: the scale of what the item can be measured
    by (an infinity matched exactly is no error, and it sets no scale)."""
    return magnitude.nan_to_num(nan=0.0, posinf=0.0)


def difference(actual: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """|actual - expected| and |expected|, in float64 on expected's device. Equal elements
    differ by 0, infinities of the same sign included (as torch.testing treats them), where
    the subtraction would give NaN."""
    a = actual.detach().to(device=expected.device, dtype=torch.float64)
    e = expected.detach().to(torch.float64)
    diff = torch.where(a == e, 0.0, a - e).abs_()
    return diff, e.abs()  # new tensors: the callers may change them in place


# An item whose share of the tolerance used, computed in float64, lies above 1 or within this
# many rounding steps of the promoted dtype below it gets torch.testing's own verdict: isclose
# in bfloat16 or float16 rounds |a - e| and atol + rtol * |e| by up to a step each, so the two
# part near the limit (tests/plugin/verdict/test_assert_close.py finds such pairs).
_CONFIRM_STEPS = 4


def _finish(item: Item, values: Sequence[float], statistics: bool = True) -> ItemCheck:
    """The check of an item from its statistics read to the host."""
    actual = item.actual
    assert actual is not None
    if isinstance(item, ToleranceItem):
        if len(values) == 1:  # the verdict without statistics: whether all are close
            nan = float("nan")
            return _tolerance_check(item, nan, nan, nan, passed=bool(values[0]))
        max_abs, max_rel, used, scale, diff_norm, expected_norm = values
        promoted = torch.promote_types(actual.dtype, item.expected.dtype)
        clear = used <= 1 - _CONFIRM_STEPS * epsilon(promoted)  # False for NaN
        return _tolerance_check(
            item,
            max_abs,
            max_rel,
            used,
            passed=True if clear else None,
            norm_rel=_ratio(diff_norm, expected_norm),
            scale=scale,
        )
    fitted = systematic(item)
    named = dict(zip(_layout(item, fitted, statistics), values))
    if item.golden.numel() == 1:
        named = _scalar_statistics(item, named)
    design = None
    if fitted:
        design = LeastSquares(actual.numel(), named["sum_g"], named["golden_norm"] ** 2)

    def side(prefix: str) -> SideErrors:
        side_max, side_norm = named[prefix + "max"], named[prefix + "norm"]
        fit = None
        if design is not None:
            fit = design.fit(named[prefix + "sum_e"], named[prefix + "sum_eg"], side_norm**2)
        return SideErrors(side_max, side_norm, fit)

    own_fit = None
    scale_se = bias_se = math.nan
    if design is not None:
        own_fit = design.fit(named["sum_e"], named["sum_eg"], named["norm"] ** 2)
        scale_se, bias_se = design.standard_errors(own_fit.residual)
    others = [side(prefix) for prefix in _side_prefixes(item)[1:]]  # the references' sides
    rounded_sides = 2 if item.rounded is not None else 1
    # The item's scale: the golden's greatest finite magnitude, or for a scalar value the sum
    # of its first-order terms where larger (a NaN in either stays NaN, and fails).
    scale = named["golden_max"]
    if item.condition is not None:
        scale = _nan_max(scale, named["condition_sum"])
    errors = BudgetErrors(
        named["max"],
        named.get("rel", math.nan),
        scale,
        named["norm"],
        named["golden_norm"],
        named.get("spread", 0.0),
        named["mean_magnitude"],
        SideErrors(named["max"], named["norm"], own_fit),
        scale_se,
        bias_se,
        others[0],
        others[1] if rounded_sides == 2 else None,
        tuple(others[rounded_sides:]),
        design,
    )
    return _budget_check(item, errors)


def _nan_max(a: float, b: float) -> float:
    """The larger of two numbers, NaN where either is (as torch.maximum)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _ratio(error: float, magnitude: float) -> float:
    """A relative error: 0 for no error (even of a zero), inf for an error of a zero."""
    if error == 0:
        return 0.0
    return error / magnitude if magnitude > 0 else math.inf


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


@dataclass(frozen=True)
class BudgetErrors:
    """What a budget judges, read to the host: the actual's greatest relative error, the
    golden's norm, mean magnitude and the item's scale (see ``_budget_stats``), the value's
    first-order spread; the actual's errors and the standard errors of its systematic part;
    the reference's, the rounded reference's (None without one) and those of each of the
    rounding spread's runs (none where it was not asked for)."""

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


def _check_alone(item: Item) -> ItemCheck:
    """An item outside the batched pass (complex, sparse, across devices, tensor
    subclasses...), by itself, with a host read per statistic."""

    item = _full_where_mixed(item)
    actual = item.actual
    assert actual is not None
    if isinstance(item, ToleranceItem):
        stats = _stats(actual, item.expected, item.resolved.tolerance)
        return _tolerance_check(
            item,
            stats.max_abs,
            stats.max_rel,
            stats.used,
            passed=None,
            norm_rel=_ratio(stats.norm, stats.magnitude_norm),
            scale=stats.scale,
        )
    golden = item.golden
    own = _stats(actual, golden)
    scale, spread = own.scale, 0.0
    if item.condition is not None:
        scale, spread = max(scale, float(item.condition[0])), float(item.condition[1])
    design = None
    if systematic(item):
        g = golden.detach().to(torch.float64).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        design = LeastSquares(actual.numel(), float(g.sum()), own.magnitude_norm**2)

    def side(tensor: torch.Tensor) -> SideErrors:
        stats = _stats(tensor, golden)
        if design is None:
            return SideErrors(stats.max_abs, stats.norm)
        return SideErrors(stats.max_abs, stats.norm, _host_fit(tensor, golden, design))

    own_side = side(actual)
    scale_se = bias_se = math.nan
    if own_side.fit is not None and design is not None:
        scale_se, bias_se = design.standard_errors(own_side.fit.residual)
    mean_magnitude = float(_finite(golden.detach().abs().to(torch.float64)).mean())
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
    return _budget_check(item, errors)


def _host_fit(tensor: torch.Tensor, golden: torch.Tensor, design: LeastSquares) -> SideFit:
    """A side's least-squares fit, its sums read to the host one by one (an item outside the
    batched pass, or a failure's message)."""
    g = golden.detach().to(torch.float64)
    signed = _signed(tensor.detach().to(device=g.device, dtype=torch.float64), g)
    finite = g.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    # Elementwise, not torch.dot: a tensor subclass need not implement it.
    sum_e, sum_eg, sum_ee = signed.sum(), (signed * finite).sum(), signed.square().sum()
    return design.fit(float(sum_e), float(sum_eg), float(sum_ee))


def _full_where_mixed(item: Item) -> Item:
    """The item with each distributed tensor (a DTensor: one with ``full_tensor``) made whole
    where the item mixes it with plain tensors, which DTensor's operators and torch.testing
    refuse. The shapes agree already (a DTensor's shape is the whole tensor's), so the plain
    side is the whole tensor, not a shard; where every side is distributed, each stays as it
    is. On a mesh of several ranks this gathers, as full_tensor always does."""
    if isinstance(item, ToleranceItem):
        tensors = {"actual": item.actual, "expected": item.expected}
    else:
        tensors = {"actual": item.actual, "reference": item.reference, "golden": item.golden}
    distributed = {name for name, t in tensors.items() if hasattr(t, "full_tensor")}
    if not distributed or len(distributed) == len(tensors):
        return item
    whole = methodcaller("full_tensor")  # DTensor's, unknown to torch.Tensor's type
    return replace(item, **{name: whole(tensors[name]) for name in distributed})


def _tolerance_check(
    item: ToleranceItem,
    max_abs: float,
    max_rel: float,
    used: float,
    passed: bool | None,
    norm_rel: float = math.nan,
    scale: float = math.nan,
) -> ItemCheck:
    """torch.testing.assert_close writes the failure detail; it runs when the item failed
    (``passed`` False) or when no verdict was computed yet (None)."""
    actual = item.actual
    assert actual is not None
    tol = item.resolved.tolerance
    dtype = dtype_name(item.expected.dtype)  # judged at the reference's dtype
    criterion = f"rtol={tol.rtol:g}, atol={tol.atol:g} from {item.resolved.source}"
    detail = ""
    if not passed:
        try:
            torch.testing.assert_close(
                actual.detach(),
                item.expected.detach(),
                rtol=tol.rtol,
                atol=tol.atol,
                check_dtype=False,
                check_device=False,
                equal_nan=False,
            )
            passed = True
        except AssertionError as error:
            detail = f"{str(error).strip()}\ntolerance {criterion}"
            detail += _all_zero_hint(item.expected, actual)
            passed = False
        except RuntimeError as error:
            # torch.testing itself failed on this tensor type (torch 2.6 on a DTensor, while
            # writing its mismatch message): the verdict and the detail come from the
            # float64 statistics instead.
            if math.isnan(used):
                stats = _stats(actual, item.expected, tol)
                max_abs, max_rel, used = stats.max_abs, stats.max_rel, stats.used
            passed = used <= 1
            detail = (
                ""
                if passed
                else (
                    f"greatest absolute difference {max_abs:.3g}, greatest relative {max_rel:.3g}, "
                    f"{used:.3g} times the tolerance (torch.testing could not describe this "
                    f"{type(actual).__name__}: {str(error).splitlines()[0]})\ntolerance {criterion}"
                )
            )
    return ItemCheck(
        item.label,
        dtype,
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


class Criterion(enum.Enum):
    """What a budget judges of an item's error vs the golden."""

    GREATEST = "greatest error"
    NORMWISE = "normwise error"
    SCALE = "systematic error, a scale"
    BIAS = "systematic error, a bias"


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
        if self.criterion in (Criterion.SCALE, Criterion.BIAS):
            # A systematic floor is one rounding of a shared factor, independent of the
            # rounding the spread's runs draw: the two add as independent errors do.
            return max(own, math.hypot(spread, self.floor))
        return max(own, spread + self.floor)

    def passed(self, budget: float) -> bool:
        return self.error <= self.allowed(budget)  # False where either is NaN


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


def _budget_check(item: BudgetItem, errors: BudgetErrors) -> ItemCheck:
    """Pass when the actual's error vs the golden is within ``budget`` times the reference's
    own, plus a floor, by every criterion:

        max|actual - golden|      <= budget * max|reference - golden| + floor
        ||actual - golden||       <= budget * ||reference - golden||  + floor
        |scale|, |bias| of actual <= budget * the reference's on the actual's side of zero
                                      + 6 standard errors + floor

    The greatest error catches a wrong element; the norm an error spread thinly over many;
    the systematic criteria (``Systematic``: the error's least-squares component along the
    golden, and its constant part) an error correlated with the result, which the norm cannot
    tell from rounding where the reference's own rounding is as large (a 1% scale error of a
    bf16 gradient). They apply to items of SYSTEMATIC_MIN_NUMEL elements or more.

    The floor is FLOOR_ULPS rounding steps of the reference's dtype at the item's scale; in a
    norm it is the error of one element off by the floor, so a scalar's two criteria are one;
    a systematic floor is SYSTEMATIC_FLOOR of the dtype's step (relative to the golden's mean
    magnitude for a bias). With a rounded reference the larger of its errors and the
    reference's counts, and the criterion names both.

    The reference's error is one draw of rounding noise. Where the item's error exceeds an
    allowance counted from it, the caller asks for the rounding spread (spread.py) and judges
    again with ``item.samples``: each criterion's allowance is then at least what the spread's
    runs allow (``spread_factor``), so a correct computation's draw, however its reference's
    fell, passes. NaN on any side fails. The worst element's index and the sides holding NaN
    are looked up for a failure's message.
    """
    actual, reference, golden, budget = item.actual, item.reference, item.golden, item.budget
    assert actual is not None
    dtype = reference.dtype  # judged at the reference's precision
    golden_name = dtype_name(golden.dtype)
    # The floor's steps are the reference's dtype's; with a rounded reference, which says the
    # kernel computes in the compute dtype, that dtype's where coarser (a bf16 kernel's float32
    # sum carries bf16 rounding, which the rounded reference may miss by luck).
    floor_dtype = dtype
    if item.rounded is not None and item.compute_dtype is not None:
        floor_dtype = less_precise(dtype, item.compute_dtype)
    steps = FLOOR_ULPS.get(dtype_name(floor_dtype), 1)
    floor = steps * epsilon(floor_dtype) * errors.scale
    floor_text = f"floor {floor:.3g}"
    floor_why = f"{steps:g} {dtype_name(floor_dtype)} steps at the item's scale {errors.scale:.3g}"
    spread_dtype = item.compute_dtype if item.compute_dtype is not None else dtype
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
        # A less precise actual let through by check_dtype=False: judged at the reference's
        # precision, but no result of its dtype can be nearer than its own rounding, at most
        # half a step of each element (so, in a norm, of the golden's norm).
        rounding = epsilon(actual.dtype) / 2
        floor = max(floor, rounding * errors.scale)
        floor_norm = max(floor, rounding * errors.golden_norm)
        floor_text = (
            f"floor {floor:.3g} (normwise {floor_norm:.3g}: the {dtype_name(actual.dtype)} "
            "result's own rounding)"
        )
    # The errors the budget counts from, whose they are, and the other reference's (rounded).
    basis = errors.reference
    basis_name = f"the {dtype_name(reference.dtype)} reference"
    other = ""
    bases = [errors.reference]
    if errors.rounded is not None:
        bases.append(errors.rounded)
        rounded_dtype = item.compute_dtype if item.compute_dtype is not None else dtype
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
    # rows fits as a bias), up to the budget, plus SYSTEMATIC_SIGMAS of its standard errors and
    # the floor, one rounding of a shared factor (a bf16 1/N), or what the rounding spread
    # allows. A rounded reference (rounded=True) counts too: rounding to nearest at every step
    # can be biased.
    systematic_floor = SYSTEMATIC_FLOOR * steps * epsilon(floor_dtype)
    if fitted:
        judged += [
            Judged(
                Criterion.SCALE,
                abs(errors.own.scale),
                _toward(errors.own.scale, [b.scale for b in bases]),
                systematic_floor,
                SYSTEMATIC_SIGMAS * errors.scale_se,
            ),
            Judged(
                Criterion.BIAS,
                abs(errors.own.bias),
                _toward(errors.own.bias, [b.bias for b in bases]),
                systematic_floor * errors.mean_magnitude,
                SYSTEMATIC_SIGMAS * errors.bias_se,
            ),
        ]
    if errors.samples:
        judged = [_with_spread(j, errors, budget) for j in judged]
    used = max(_share(j.error, j.allowed(budget)) for j in judged)
    passed = all(j.passed(budget) for j in judged)
    larger = f", the larger: {other}" if other else ""
    criterion = (
        f"budget {budget:g}x {basis_name}'s error vs the {golden_name} golden, greatest and "
        f"normwise ({basis.max:.3g} and {max(b.norm for b in bases):.3g}{larger}) + "
        f"{floor_text} ({floor_why})"
    )
    if fitted:
        criterion += (
            f"; systematic error (scale, bias) within {SYSTEMATIC_SIGMAS:g} standard errors + "
            f"floor {systematic_floor:.3g}"
        )
    if errors.samples:
        criterion += (
            f"; rounding spread of {len(errors.samples)} randomly rounded runs of the reference"
        )
    detail = ""
    if not passed:
        detail = _budget_failure(item, errors, judged, basis_name, other, floor_text)
    return ItemCheck(
        item.label,
        dtype_name(dtype),
        errors.own_max,
        errors.own_rel,
        criterion,
        1 - used,
        passed,
        detail,
        errors.rounded.max if errors.rounded is not None else None,
        norm_rel=_ratio(errors.own_norm, errors.golden_norm),
        scale=errors.scale,
        reference_error=errors.reference.max,
        reference_norm_rel=_ratio(errors.reference.norm, errors.golden_norm),
        numel=item.actual.numel() if item.actual is not None else 0,
        scale_error=errors.own.scale if fitted else math.nan,
        bias_error=_ratio(errors.own.bias, errors.mean_magnitude) if fitted else math.nan,
        spread_runs=len(errors.samples),
    )


def _toward(own: float, references: Sequence[float]) -> float:
    """The references' systematic error (a scale or a bias) that counts toward the actual's:
    the largest on the actual's side of zero, 0 where every one lies on the other side. A
    correct kernel's systematic error lies between none (exact arithmetic, or a finer dtype)
    and the reference's (rounding where the reference rounds), so the reference's is allowed in
    its own direction only: a 1% scale error against a reference whose own rounding leans the
    other way is not hidden by twice that lean."""
    sign = 1.0 if own >= 0 else -1.0
    return max([0.0, *(sign * r for r in references)])


def _with_spread(judged: Judged, errors: BudgetErrors, budget: float) -> Judged:
    """The criterion with the rounding spread's allowance (``spread_factor`` of its runs'
    values). A systematic criterion's is scaled by the actual's noise against the runs' (the
    norms of what the fit leaves, at most 1): rounding that leaves little noise leaves a
    proportionately small scale, so a kernel that rounds once is not let off by the spread of
    one that rounds at every step."""
    samples = errors.samples
    field_name = {
        Criterion.GREATEST: "max",
        Criterion.NORMWISE: "norm",
        Criterion.SCALE: "scale",
        Criterion.BIAS: "bias",
    }[judged.criterion]
    factor, rms = spread_factor([getattr(s, field_name) for s in samples], budget)
    if judged.criterion in (Criterion.SCALE, Criterion.BIAS):
        _, noise = spread_factor([s.residual for s in samples], budget)
        if noise > 0 and math.isfinite(errors.own.residual):
            rms *= min(1.0, errors.own.residual / noise)
    return replace(judged, spread_factor=factor, spread_rms=rms)


def _share(error: float, allowed: float) -> float:
    """The share of an allowance an error uses (NaN for a NaN allowance)."""
    if allowed > 0 or math.isnan(allowed):
        return error / allowed
    return 0.0 if error == 0 else math.inf


def _budget_failure(
    item: BudgetItem,
    errors: BudgetErrors,
    judged: Sequence[Judged],
    basis_name: str,
    other: str,
    floor_text: str,
) -> str:
    """A failed budget's message: each criterion that failed, with the errors, their ratio and
    what was allowed (and what the rounding spread allowed, where it was asked for); the
    sides that hold NaN; an all-zero reference of a nonzero golden."""
    actual, golden, budget = item.actual, item.golden, item.budget
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
                f"{_worst_index(actual, golden)} (greatest relative "
                f"{_greatest_relative(errors, actual, golden):.3g}), "
                f"{own}{also}; allowed: budget {budget:g} x {j.basis:.3g} + {floor_text}"
            )
        elif j.criterion is Criterion.NORMWISE:
            relative = _ratio(j.error, errors.golden_norm)
            line = (
                f"normwise error vs the {golden_name} golden: {j.error:.3g} (relative "
                f"{relative:.3g}), {own}; allowed: budget {budget:g} x {j.basis:.3g} + floor"
            )
        else:
            if j.criterion is Criterion.SCALE:
                what = (
                    f"a scale of {errors.own.scale:+.3g} (the error's least-squares component "
                    f"along the golden; the reference's own: {_fitted(reference_fit, 'scale')})"
                )
            else:
                what = (
                    f"a bias of {errors.own.bias:+.3g}, "
                    f"{_ratio(errors.own.bias, errors.mean_magnitude):+.3g} of the golden's "
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
            plus = (
                "and the floor in quadrature"
                if j.criterion in (Criterion.SCALE, Criterion.BIAS)
                else "+ floor"
            )
            line += (
                f"; the rounding spread ({len(errors.samples)} randomly rounded runs of the "
                f"reference) allows "
                f"{j.spread_factor:.3g} x their rms {j.spread_rms:.3g} {plus}"
            )
        lines.append(line)
    sides = [("actual result", actual), ("reference", item.reference), ("golden", golden)]
    if item.rounded is not None:
        sides.append(("rounded reference", item.rounded))
    nan_sides = [side for side, t in sides if bool(t.detach().isnan().any())]
    text = "\n".join(lines) + "".join(f" (the {side} has NaN)" for side in nan_sides)
    return text + _all_zero_hint(item.reference, actual)


def _fitted(fit: SideFit | None, name: str) -> str:
    return "-" if fit is None else f"{getattr(fit, name):+.3g}"


def _times(error: float, basis: float) -> str:
    return f"{error / basis:.3g}x" if basis > 0 else "infinitely many times"


def _all_zero_hint(reference: torch.Tensor, actual: torch.Tensor | None) -> str:
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


@dataclass(frozen=True)
class _Stats:
    max_abs: float
    max_rel: float
    used: float  # greatest share of the tolerance used by one element (0 without one)
    norm: float  # ||actual - expected||
    magnitude_norm: float  # ||expected||, finite elements
    scale: float  # max|expected|, finite elements


def _stats(
    actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance | None = None
) -> _Stats:
    """Greatest absolute and relative difference and the norms, computed in float64 on
    expected's device, and with a tolerance the greatest |a - e| / (atol + rtol * |e|); with
    host reads, for the items the batched pass leaves out."""
    diff, magnitude = difference(actual, expected)
    if diff.numel() == 0:
        return _Stats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    zero = torch.zeros_like(diff)
    relative = torch.where(diff == 0, zero, diff / magnitude)
    used = 0.0
    if tolerance is not None:
        allowed = tolerance.atol + tolerance.rtol * magnitude
        used = float(torch.where(diff == 0, zero, diff / allowed).max())
    # A mask, not boolean indexing: a sharded DTensor cannot index by a data-dependent shape.
    finite = torch.where(magnitude.isfinite(), magnitude, zero)
    return _Stats(
        float(diff.max()),
        float(relative.max()),
        used,
        float(diff.norm()),
        float(finite.norm()),
        float(finite.max()),
    )


def _greatest_relative(errors: BudgetErrors, actual: torch.Tensor, golden: torch.Tensor) -> float:
    """The actual's greatest relative error vs the golden: from the batched pass where it was
    computed (with statistics), else looked up for a failure's message."""
    if not math.isnan(errors.own_rel):
        return errors.own_rel
    diff, magnitude = difference(actual, golden)
    return float(torch.where(diff == 0, 0.0, diff / magnitude).max())


def _worst_index(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Where |actual - expected| is greatest (NaN counting as greatest), for a failure message;
    a tensor subclass that cannot locate it (torch 2.6's DTensor has no argmax) says so."""
    diff, _ = difference(actual, expected)
    try:
        flat = int(diff.nan_to_num(nan=float("inf")).argmax())
    except (NotImplementedError, RuntimeError) as error:
        return f"(not located: {type(diff).__name__} {str(error).splitlines()[0]})"
    return str(tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)))


def _shape_problem(
    label: str, actual: object, expected: torch.Tensor, missing: str = MISSING_HINT
) -> ItemCheck | None:
    if not isinstance(actual, torch.Tensor):
        what = f"None: {missing}" if actual is None else type(actual).__name__
        return ItemCheck(label, "-", float("nan"), float("nan"), "-", float("-inf"), False, what)
    if actual.shape != expected.shape:
        detail = f"shape {tuple(actual.shape)} differs from the reference's {tuple(expected.shape)}"
        dtype = dtype_name(expected.dtype)
        return ItemCheck(
            label, dtype, float("nan"), float("nan"), "-", float("-inf"), False, detail
        )
    return None


def _dtype_problem(
    label: str, actual: torch.Tensor | None, expected: torch.Tensor
) -> ItemCheck | None:
    """A failed check where the actual result is less precise than its reference: judged at
    its own dtype's tolerance it would pass a float32 test with a bf16 result."""
    if actual is None or not (is_inexact(actual.dtype) and is_inexact(expected.dtype)):
        return None
    if epsilon(actual.dtype) <= epsilon(expected.dtype):
        return None
    detail = (
        f"dtype: the result is {dtype_name(actual.dtype)}, less precise than the reference's "
        f"{dtype_name(expected.dtype)}. A kernel that returns a lower precision on purpose "
        "says so with check_dtype=False (on assert_close or @pytest.mark.gradref); the item "
        f"is then judged at the reference's precision, {dtype_name(expected.dtype)}"
    )
    name = dtype_name(expected.dtype)
    return ItemCheck(label, name, math.nan, math.nan, "dtype", -math.inf, False, detail)


def format_failures(header: str, checks: Sequence[ItemCheck]) -> str:
    failed = [c for c in checks if not c.passed]
    lines = [f"{header}: {len(failed)} of {len(checks)} items differ"]
    for check in failed:
        body = check.detail.replace("\n", "\n    ")
        lines.append(f"- {check.label}:\n    {body}")
    return "\n".join(lines)
