"""Tolerances and the comparison of actual results with a reference.

The defaults are torch.testing.assert_close's; a backend may loosen them per dtype and a test
may override them. Every comparison says where its tolerance came from, so a failure points at
the table, marker or argument to look at.
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
    """A tolerance and a sentence saying where each half of it came from."""

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


def less_precise(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype with the larger machine epsilon: the one that limits achievable accuracy."""
    import torch

    def eps(dtype: torch.dtype) -> float:
        if dtype.is_floating_point:
            return float(torch.finfo(dtype).eps)
        if dtype.is_complex:
            return float(torch.finfo(dtype.to_real()).eps)
        return 0.0

    return a if eps(a) >= eps(b) else b


@dataclass(frozen=True)
class ItemMismatch:
    label: str
    message: str


def compare_item(
    label: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    resolved: ResolvedTolerance,
) -> ItemMismatch | None:
    """Compare one tensor with torch.testing.assert_close; None when it is close enough."""
    import torch

    if not isinstance(actual, torch.Tensor):
        return ItemMismatch(label, f"expected a tensor, got {type(actual).__name__}")
    tol = resolved.tolerance
    try:
        torch.testing.assert_close(
            actual.detach(),
            expected.detach(),
            rtol=tol.rtol,
            atol=tol.atol,
            check_dtype=False,
            check_device=True,
            equal_nan=False,
        )
    except AssertionError as error:
        detail = str(error).strip()
        return ItemMismatch(
            label,
            f"{detail}\n  tolerance rtol={tol.rtol:g}, atol={tol.atol:g} from {resolved.source}",
        )
    return None


def format_mismatches(header: str, mismatches: Sequence[ItemMismatch], total: int) -> str:
    lines = [f"{header}: {len(mismatches)} of {total} items differ"]
    for mismatch in mismatches:
        body = mismatch.message.replace("\n", "\n    ")
        lines.append(f"- {mismatch.label}:\n    {body}")
    return "\n".join(lines)
