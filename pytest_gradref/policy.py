"""What an item's tolerance depends on besides its own dtype: the test's policy (backend
table, marker overrides, budget, where checks are recorded) and the compute dtype.

Both the reference's ``assert_close`` and the crosscheck measure items by these, so they live
below the modules that compute and check references.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pytest_gradref.compare import (
    ResolvedTolerance,
    Tolerance,
    ToleranceOverride,
    dtype_name,
    epsilon,
    is_inexact,
    resolve_tolerance,
)
from pytest_gradref.recording import Recording

if TYPE_CHECKING:
    import torch

    from pytest_gradref.auxiliary import AuxKey


@dataclass(frozen=True)
class CheckPolicy:
    """What comparisons depend on besides the dtype: backend table, overrides, budget."""

    backend: str
    table: Mapping[str, Tolerance] = field(default_factory=dict)
    overrides: tuple[ToleranceOverride, ...] = ()
    budget: float | None = None
    recording: Recording | None = None
    # The budget of a reference with a golden where the test gives no tolerance or budget:
    # DEFAULT_BUDGET under the default verdict, None under --gradref-verdict=tolerance.
    default_budget: float | None = None
    # False (the marker's check_dtype=False): a less precise actual is judged, not failed.
    check_dtype: bool = True
    # Whether assert_close computes each item's statistics (for the report and the summary)
    # besides its verdict.
    statistics: bool = True
    # The marker's aux_tolerances, below assert_close's own (see Reference.assert_close).
    aux_tolerances: Mapping[AuxKey, Tolerance] = field(default_factory=dict)

    def tolerance(
        self, dtype: torch.dtype, extra: tuple[ToleranceOverride, ...] = (), why_dtype: str = ""
    ) -> ResolvedTolerance:
        overrides = (*extra, *self.overrides)
        return resolve_tolerance(dtype, self.backend, self.table, overrides, why_dtype)


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
