"""Tolerances, error budgets, and the comparison of actual results with a reference.

Two criteria:
- a tolerance: torch.testing.assert_close's defaults, loosened per dtype by a backend or
  overridden by a test; every check says where its tolerance came from;
- an error budget against a golden (higher-precision) reference: the actual result may be at
  most ``budget`` times as far from the golden as the same-dtype reference is, plus a floor
  (see ``FLOOR_ULPS``), so a reference that happens to land almost exactly on the golden does
  not demand exactness of the kernel.

Each check yields an ``ItemCheck`` with its statistics, for the failure message and the report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Tolerance {name} must be a number >= 0, got {value!r}")


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
) -> ResolvedTolerance:
    """The tolerance for one dtype: overrides (first wins) over the backend table over torch's.

    rtol and atol are resolved independently, so a marker that sets only rtol keeps the
    table's atol.
    """
    name = dtype_name(dtype)
    if name in backend_table:
        base, base_source = backend_table[name], f"the {backend_name} backend's {name} table"
    elif name in DEFAULT_TOLERANCES:
        base, base_source = DEFAULT_TOLERANCES[name], f"torch.testing's default for {name}"
    else:
        base, base_source = Tolerance(0.0, 0.0), f"exact comparison for {name}"
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


# The budget's floor, in rounding steps (machine epsilons) of the item's dtype at its largest
# golden magnitude. Half precision: one step, the resolution of the dtype itself; a looser
# floor would let a real bug hide under it, since bf16 references already err by a few steps.
# float32 and float64: 16 steps (2e-6 relative in float32, about torch.testing's own float32
# rtol of 1.3e-6): a kernel that reduces thousands of terms in another order legitimately
# differs by several steps, while a float32 reference can land within a step of the golden
# by chance (a scalar loss, typically).
FLOOR_ULPS: Mapping[str, float] = {"float16": 1, "bfloat16": 1, "float32": 16, "float64": 16}


def epsilon(dtype: torch.dtype) -> float:
    import torch

    if dtype.is_floating_point:
        return float(torch.finfo(dtype).eps)
    if dtype.is_complex:
        return float(torch.finfo(dtype.to_real()).eps)
    return 0.0


def less_precise(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype with the larger machine epsilon: the one that limits achievable accuracy."""
    return a if epsilon(a) >= epsilon(b) else b


@dataclass(frozen=True)
class ItemCheck:
    """One compared item: its statistics, the criterion applied, and the verdict.

    ``headroom`` is 1 minus the share of the allowance used by the worst element: 1 for an
    exact match, 0 at the limit, negative when the item fails.
    """

    label: str
    dtype: str
    max_abs: float
    max_rel: float
    criterion: str
    headroom: float
    passed: bool
    detail: str = ""


@dataclass(frozen=True)
class _Stats:
    max_abs: float
    max_rel: float
    worst_index: tuple[int, ...]
    has_nan: bool
    used: float  # greatest share of the tolerance used by one element (0 without one)


def _stats(
    actual: torch.Tensor, expected: torch.Tensor, tolerance: Tolerance | None = None
) -> _Stats:
    """Greatest absolute and relative difference, computed in float64 on expected's device,
    and with a tolerance the greatest |a - e| / (atol + rtol * |e|)."""
    import torch

    a = actual.detach().to(device=expected.device, dtype=torch.float64)
    e = expected.detach().to(torch.float64)
    diff = (a - e).abs()
    has_nan = bool(diff.isnan().any())
    if diff.numel() == 0:
        return _Stats(0.0, 0.0, (), has_nan, 0.0)
    zero = torch.zeros_like(diff)
    relative = torch.where(diff == 0, zero, diff / e.abs())
    used = 0.0
    if tolerance is not None:
        allowed = tolerance.atol + tolerance.rtol * e.abs()
        used = float(torch.where(diff == 0, zero, diff / allowed).max())
    flat = int(diff.nan_to_num(nan=float("inf")).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    return _Stats(float(diff.max()), float(relative.max()), index, has_nan, used)


def _shape_problem(label: str, actual: object, expected: torch.Tensor) -> ItemCheck | None:
    import torch

    if not isinstance(actual, torch.Tensor):
        what = "None: did backward() reach it?" if actual is None else type(actual).__name__
        return ItemCheck(label, "-", float("nan"), float("nan"), "-", float("-inf"), False, what)
    if actual.shape != expected.shape:
        detail = f"shape {tuple(actual.shape)} differs from the reference's {tuple(expected.shape)}"
        dtype = dtype_name(expected.dtype)
        return ItemCheck(
            label, dtype, float("nan"), float("nan"), "-", float("-inf"), False, detail
        )
    return None


def check_tolerance(
    label: str, actual: torch.Tensor | None, expected: torch.Tensor, resolved: ResolvedTolerance
) -> ItemCheck:
    """Compare with torch.testing.assert_close, which decides and writes the failure detail."""
    import torch

    problem = _shape_problem(label, actual, expected)
    if problem is not None:
        return problem
    assert actual is not None
    tol = resolved.tolerance
    dtype = dtype_name(less_precise(actual.dtype, expected.dtype))
    criterion = f"rtol={tol.rtol:g}, atol={tol.atol:g} from {resolved.source}"
    stats = _stats(actual, expected, tol)
    used = stats.used
    try:
        torch.testing.assert_close(
            actual.detach(),
            expected.detach(),
            rtol=tol.rtol,
            atol=tol.atol,
            check_dtype=False,
            check_device=False,
            equal_nan=False,
        )
    except AssertionError as error:
        detail = f"{str(error).strip()}\ntolerance {criterion}"
        return ItemCheck(
            label, dtype, stats.max_abs, stats.max_rel, criterion, 1 - used, False, detail
        )
    return ItemCheck(label, dtype, stats.max_abs, stats.max_rel, criterion, 1 - used, True)


def check_budget(
    label: str,
    actual: torch.Tensor | None,
    reference: torch.Tensor,
    golden: torch.Tensor,
    budget: float,
) -> ItemCheck:
    """Pass when |actual - golden| <= budget * |reference - golden| + floor (greatest elements)."""
    problem = _shape_problem(label, actual, reference)
    if problem is not None:
        return problem
    assert actual is not None
    dtype = less_precise(actual.dtype, reference.dtype)
    golden_name = dtype_name(golden.dtype)
    own = _stats(actual, golden)
    ref = _stats(reference, golden)
    scale = float(golden.detach().abs().max()) if golden.numel() else 0.0
    floor = FLOOR_ULPS.get(dtype_name(dtype), 1) * epsilon(dtype) * scale
    allowed = budget * ref.max_abs + floor
    used = own.max_abs / allowed if allowed > 0 else (0.0 if own.max_abs == 0 else float("inf"))
    passed = not own.has_nan and own.max_abs <= allowed
    ratio = own.max_abs / ref.max_abs if ref.max_abs > 0 else float("inf")
    criterion = (
        f"budget {budget:g}x the {dtype_name(reference.dtype)} reference's error vs the "
        f"{golden_name} golden ({ref.max_abs:.3g}) + floor {floor:.3g}"
    )
    detail = ""
    if not passed:
        ratio_text = f"{ratio:.3g}x" if ref.max_abs > 0 else "infinitely many times"
        detail = (
            f"error vs the {golden_name} golden: {own.max_abs:.3g} at index {own.worst_index} "
            f"(greatest relative {own.max_rel:.3g}), {ratio_text} the "
            f"{dtype_name(reference.dtype)} reference's own error {ref.max_abs:.3g}; "
            f"allowed: budget {budget:g} x {ref.max_abs:.3g} + floor {floor:.3g} "
            f"= {allowed:.3g}" + (" (the actual result has NaN)" if own.has_nan else "")
        )
    return ItemCheck(
        label, dtype_name(dtype), own.max_abs, own.max_rel, criterion, 1 - used, passed, detail
    )


def format_failures(header: str, checks: Sequence[ItemCheck]) -> str:
    failed = [c for c in checks if not c.passed]
    lines = [f"{header}: {len(failed)} of {len(checks)} items differ"]
    for check in failed:
        body = check.detail.replace("\n", "\n    ")
        lines.append(f"- {check.label}:\n    {body}")
    return "\n".join(lines)
