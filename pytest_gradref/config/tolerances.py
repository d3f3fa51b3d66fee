"""What an item may differ by: the tolerance tables, the error budget's settings, and the test's
check policy that chooses among them.

No torch at import: the markers parse tolerances at collection, and a conftest builds a
backend's table from ``Tolerance`` before any test runs. The precision of a dtype (its machine
epsilon, the compute dtype) is in verdict/dtypes.py, the items and their judge in verdict/.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Union

from pytest_gradref.config.number_settings import check_number

if TYPE_CHECKING:
    import torch


# The key of an aux tolerance: the top-level key or index of the aux, which covers every
# item beneath it, or an item's full label such as "aux['logps'][0]".
AuxKey = Union[str, int]


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            check_number(getattr(self, name), f"Tolerance {name}", minimum=0)


# torch.testing.assert_close's defaults, by dtype name.
DEFAULT_TOLERANCES: Mapping[str, Tolerance] = {
    "float16": Tolerance(rtol=1e-3, atol=1e-5),
    "bfloat16": Tolerance(rtol=1.6e-2, atol=1e-5),
    "float32": Tolerance(rtol=1.3e-6, atol=1e-5),
    "float64": Tolerance(rtol=1e-7, atol=1e-7),
    "complex32": Tolerance(rtol=1e-3, atol=1e-5),
    "complex64": Tolerance(rtol=1.3e-6, atol=1e-5),
    "complex128": Tolerance(rtol=1e-7, atol=1e-7),
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Machine epsilon by dtype name, a complex dtype's that of its real part: torch.finfo's, held
# without torch, for the verdict (verdict/dtypes.py) and for reading reports (report/diff.py)
# alike. tests/plugin/report/test_diff.py holds it to torch.finfo.
EPSILONS = {
    "float16": 2.0**-10,
    "bfloat16": 2.0**-7,
    "float32": 2.0**-23,
    "float64": 2.0**-52,
    "complex32": 2.0**-10,
    "complex64": 2.0**-23,
    "complex128": 2.0**-52,
}


@dataclass(frozen=True)
class ResolvedTolerance:
    """A tolerance and a phrase saying where it came from."""

    tolerance: Tolerance
    source: str


@dataclass(frozen=True)
class ToleranceOverride:
    """rtol and/or atol set by one source (a marker or an argument)."""

    rtol: float | None
    atol: float | None
    source: str


def resolve_tolerance(
    dtype: torch.dtype,
    backend_name: str,
    backend_table: Mapping[str, Tolerance],
    overrides: Sequence[ToleranceOverride] = (),
    why_dtype: str = "",
) -> ResolvedTolerance:
    """The tolerance for one dtype: overrides (first wins) over the backend table over torch's.

    rtol and atol are resolved independently, so a marker that sets only rtol keeps the
    table's atol. ``why_dtype`` follows the table's name in the source, e.g. why an item
    is compared at a dtype other than its own.
    """
    name = dtype_name(dtype)
    if name in backend_table:
        base, base_source = backend_table[name], f"the {backend_name} backend's {name} table"
    elif name in DEFAULT_TOLERANCES:
        base, base_source = DEFAULT_TOLERANCES[name], f"torch.testing's default for {name}"
    else:
        base, base_source = Tolerance(0.0, 0.0), f"exact comparison for {name}"
    base_source += why_dtype
    rtol, rtol_source = base.rtol, base_source
    atol, atol_source = base.atol, base_source
    for override in reversed(overrides):
        if override.rtol is not None:
            rtol, rtol_source = override.rtol, override.source
        if override.atol is not None:
            atol, atol_source = override.atol, override.source
    if rtol_source == atol_source:
        source = rtol_source
    else:
        source = f"rtol from {rtol_source}, atol from {atol_source}"
    return ResolvedTolerance(Tolerance(rtol=rtol, atol=atol), source)


# The budget of the default verdict (--gradref-verdict=golden) where a test sets none: a
# kernel may err up to twice as much as the same-dtype reference, greatest and normwise.
DEFAULT_BUDGET = 2.0

# The budget's floor, in rounding steps (machine epsilons) of the reference's dtype at the
# item's scale (its largest golden magnitude; for a scalar value the sum of its first-order
# terms where larger). Half precision: one step, the resolution of the dtype itself; a looser
# floor would let a real bug hide under it, since bf16 references already err by a few steps.
# float32 and float64: 16 steps (2e-6 relative in float32, about torch.testing's own float32
# rtol of 1.3e-6): a kernel that reduces thousands of terms in another order legitimately
# differs by several steps, while a float32 reference can land within a step of the golden
# by chance (a scalar loss, typically). Not the compute dtype's steps: a float32 loss of bf16
# inputs judged in bf16 steps could grow its error 20,000 times unseen.
FLOOR_ULPS: Mapping[str, float] = {"float16": 1, "bfloat16": 1, "float32": 16, "float64": 16}

# A scalar value's floor is at least this many times the spread of its error under one more
# rounding of each input at the compute dtype (BudgetItem.condition): a single rounding error
# of the reference is one draw of that spread, as likely small as not, and a kernel's error
# of the same spread exceeds twice a small draw often. Four spreads: a false failure in fewer
# than one in ten thousand values of a correct kernel.
SPREAD_SIGMAS = 4.0

# The systematic criteria (verdict/budget_item.py: the error's scale along the golden and its
# bias) judge items of at least this many elements: fewer cannot tell a scale from rounding.
SYSTEMATIC_MIN_NUMEL = 64
# A systematic error may reach this many of its standard errors (estimated from what the fit
# leaves, as if elements erred independently) before the rounding spread is asked: rounding
# that errs element by element leaves a scale of a few at most, a scale bug hundreds.
SYSTEMATIC_SIGMAS = 6.0
# The systematic criteria's floor, as a share of the floor's rounding steps (FLOOR_ULPS of
# the dtype): half a step, the unit roundoff, the scale error of one rounding of a factor
# every element shares (0.39% in bf16, 0.049% in fp16, 16 x 6e-8 in float32).
SYSTEMATIC_FLOOR = 0.5

# The rounding spread's allowance (budget_criteria.spread_factor): its runs' rms times 1 + this many
# coefficients of variation of their errors (at least the budget).
SPREAD_VARIATIONS = 10.0


@dataclass(frozen=True)
class CheckPolicy:
    """What a test's comparisons depend on besides the items' dtypes: the backend's table,
    the overrides, the budget. The same for every reference of the test; what the test
    checked is kept apart, in its Recording."""

    backend: str
    table: Mapping[str, Tolerance] = field(default_factory=dict)
    overrides: tuple[ToleranceOverride, ...] = ()
    budget: float | None = None
    # The default verdict (verdict/criterion.py applies it): the golden every reference of
    # less precise inputs computes where none is asked for, and the budget of a reference
    # with a golden where the test gives no tolerance or budget. torch.float64 and
    # DEFAULT_BUDGET by default; both None under --gradref-verdict=tolerance.
    default_golden: torch.dtype | None = None
    default_budget: float | None = None
    # False (the marker's check_dtype=False): a less precise actual is judged, not failed.
    check_dtype: bool = True
    # Whether assert_close computes each item's statistics (for the report and the summary)
    # besides its verdict.
    statistics: bool = True
    # The marker's aux_tolerances, below assert_close's own (see Reference.assert_close).
    aux_tolerances: Mapping[AuxKey, Tolerance] = field(default_factory=dict)
    # Where the run turned the default golden off ("--gradref-verdict=tolerance from the
    # --gradref-verdict option"): a check that asks for a budget then skips its test, naming
    # it, rather than erroring on the golden it lacks. None where no setting turned it off.
    golden_off: str | None = None

    def __post_init__(self) -> None:
        if self.default_golden is not None and self.default_budget is None:
            raise ValueError(
                f"CheckPolicy(default_golden={self.default_golden}) computes a golden that no "
                "check would use: give default_budget= too (pytest_gradref's default is "
                f"{DEFAULT_BUDGET:g}), or leave default_golden=None to compare with tolerances"
            )

    def with_default_golden(self, golden: torch.dtype) -> CheckPolicy:
        """This policy with the default verdict's golden ``golden``, and its budget, or
        DEFAULT_BUDGET where it has none: what the deprecated ``default_golden=`` arguments
        of GradReference and compute_reference set."""
        budget = self.default_budget if self.default_budget is not None else DEFAULT_BUDGET
        return replace(self, default_golden=golden, default_budget=budget)

    def tolerance(
        self,
        dtype: torch.dtype,
        extra: tuple[ToleranceOverride, ...] = (),
        why_dtype: str = "",
    ) -> ResolvedTolerance:
        """The tolerance of an item compared at ``dtype``; ``extra`` overrides win over the
        test's, and ``why_dtype`` says why the dtype is not the item's own (the compute dtype,
        ComputeDtype.tolerance_dtype, where that is less precise). Reference.assert_close and
        the crosscheck both take an item's tolerance from here."""
        overrides = (*extra, *self.overrides)
        return resolve_tolerance(dtype, self.backend, self.table, overrides, why_dtype)
