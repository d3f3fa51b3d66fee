"""The precision of dtypes: machine epsilon, the less precise of two, and the compute dtype,
at which every item of a reference is compared at least as coarsely."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pytest_gradref.config.tolerances import EPSILONS, dtype_name


def epsilon(dtype: torch.dtype) -> float:
    """Machine epsilon (a complex dtype's real part's; 0 for an exact dtype): the one table
    reports are read with, torch.finfo's for a dtype it does not hold (float8 kinds)."""
    known = EPSILONS.get(dtype_name(dtype))
    if known is not None:
        return known
    if dtype.is_floating_point:
        return float(torch.finfo(dtype).eps)
    if dtype.is_complex:
        return float(torch.finfo(dtype.to_real()).eps)
    return 0.0


def less_precise(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype with the larger machine epsilon: the one that limits achievable accuracy."""
    return a if epsilon(a) >= epsilon(b) else b


def is_inexact(dtype: torch.dtype) -> bool:
    """Floating or complex: a dtype that rounds, to which tolerances and budgets apply."""
    return dtype.is_floating_point or dtype.is_complex


@dataclass(frozen=True)
class ComputeDtype:
    """The least precise floating dtype among the inputs (tensor arguments, differentiated or
    not, and a module's parameters), and which input has it: every item is compared at a dtype
    at least this coarse, since rounding there reaches every output (a bf16 kernel's float32
    loss)."""

    dtype: torch.dtype
    source: str  # e.g. "argument 0 (x)" or "parameter 'lin.weight'"

    def tolerance_dtype(self, item_dtype: torch.dtype) -> tuple[torch.dtype, str]:
        """The dtype an item of ``item_dtype`` is compared at, and why where it is not its
        own (a phrase that follows the tolerance table's name)."""
        if not is_inexact(item_dtype) or epsilon(self.dtype) <= epsilon(item_dtype):
            return item_dtype, ""
        return self.dtype, (
            f", the compute dtype ({self.source} is {dtype_name(self.dtype)}; "
            f"the item is {dtype_name(item_dtype)})"
        )
