"""How the verdict's tests call a reference: as the ``grad_reference`` fixture computes it
under each verdict (plugin.py), and the failure message of an assert_close that must fail."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pytest_gradref import Reference, compute_reference
from pytest_gradref.config.tolerances import DEFAULT_BUDGET, CheckPolicy


def reference(
    fn: Callable[..., Any],
    *args: Any,
    verdict: str = "golden",
    argnums: Any = 0,
    has_aux: bool = False,
    **kwargs: Any,
) -> Reference:
    """fn's reference as grad_reference computes it under ``verdict`` (plugin.py): the golden
    verdict gives a float64 golden where the compute dtype is less precise, and the budget
    assert_close uses where the test gives no tolerance."""
    golden = verdict == "golden"
    policy = CheckPolicy(
        backend="cpu",
        default_golden=torch.float64 if golden else None,
        default_budget=DEFAULT_BUDGET if golden else None,
    )
    return compute_reference(
        fn,
        args,
        {},
        argnums=argnums,
        has_aux=has_aux,
        strategy="autograd",
        default_strategy="autograd",
        policy=policy,
        **kwargs,
    )


def failure(ref: Reference, *args: Any, **kwargs: Any) -> str:
    """assert_close's failure message (it must fail)."""
    with pytest.raises(AssertionError) as raised:
        ref.assert_close(*args, **kwargs)
    return str(raised.value)
