"""The golden reference: the same reference computed in a higher precision, for budgets.

What a golden dtype may be, the problem with its inputs upcast to it, and the warning where
fn returns a golden less precise than requested (it casts inside).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves

from pytest_gradref.differentiation import Problem, describe
from pytest_gradref.dtypes import epsilon, is_inexact, less_precise
from pytest_gradref.tolerances import dtype_name
from pytest_gradref.warning_types import GoldenPrecisionWarning, user_stacklevel

if TYPE_CHECKING:
    from pytest_gradref.recording import Recording


@dataclass(frozen=True)
class Golden:
    """The same reference computed in a higher precision."""

    dtype: torch.dtype
    device: torch.device
    value: torch.Tensor
    arg_grads: tuple[torch.Tensor, ...]
    param_grads: Mapping[str, torch.Tensor]
    aux: Any = None
    # The least precise floating dtype fn returned (value and aux): less precise than
    # ``dtype`` where fn casts inside, e.g. with .float().
    obtained: torch.dtype | None = None
    # For a scalar value: its first-order terms x * dvalue/dx over the differentiated inputs,
    # as their sum of magnitudes and their 2-norm (see compare.BudgetItem.condition), a float64
    # tensor of two; None otherwise.
    value_condition: torch.Tensor | None = None


def value_condition(
    upcast: Problem, value: torch.Tensor, arg_grads: Sequence[Any], param_grads: Mapping[str, Any]
) -> torch.Tensor | None:
    """A scalar value's first-order terms x * dvalue/dx over the differentiated inputs x
    (golden precision), as [sum of their magnitudes, their 2-norm]: for a sum of terms, the
    first is the sum of their magnitudes, which its rounding errors scale with where the terms
    cancel; the second, times u / sqrt(3), is the spread of the value's error when every
    input is rounded once more (see compare.BudgetItem.condition). None for a value that is
    not a scalar or has no gradient."""
    plain = (torch.Tensor, torch.nn.Parameter)
    if value.numel() != 1 or type(value) not in plain:
        # A tensor subclass (DTensor, a wrapper) may not stack into the two numbers (torch 2.8's
        # wrappers return a 0-dim result): its value's floor keeps the golden's own scale.
        return None
    inputs = [upcast.args[i] for i in upcast.argnums]
    pairs = [*zip(inputs, arg_grads), *((upcast.params[n], g) for n, g in param_grads.items())]
    # Non-finite terms (an infinite gradient, 0 * inf) set no scale, as in the golden's own
    # (compare._finite): a NaN would fail every value, an infinity pass any.
    terms = [
        (x.detach() * g.detach()).reshape(-1).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        for x, g in pairs
        if type(x) in plain
        and type(g) in plain
        and x.shape == g.shape
        and x.device == value.device
        and is_inexact(g.dtype)
        and not g.is_complex()
    ]
    if not terms:
        return None
    flat = torch.cat(terms).to(torch.float64)
    return torch.stack([flat.abs().sum(), flat.norm()])


def _upcast(value: Any, dtype: torch.dtype, device: torch.device | None) -> Any:
    """value with floating tensors cast to dtype (and every tensor moved to device)."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        if device is not None:
            tensor = tensor.to(device)
        return tensor.to(dtype) if tensor.is_floating_point() else tensor
    if isinstance(value, list):
        return [_upcast(v, dtype, device) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_upcast(v, dtype, device) for v in value)
    if isinstance(value, dict):
        return {k: _upcast(v, dtype, device) for k, v in value.items()}
    return value


def golden_problem(problem: Problem, dtype: torch.dtype, device: torch.device | None) -> Problem:
    """problem with its floating inputs (arguments, parameters, buffers) cast to dtype."""

    def cast(value: Any) -> Any:
        return _upcast(value, dtype, device)

    return Problem(
        fn=problem.fn,
        args=cast(problem.args),
        kwargs=cast(problem.kwargs),
        argnums=problem.argnums,
        has_aux=problem.has_aux,
        params=cast(problem.params),
        frozen=cast(problem.frozen),
        buffers=cast(problem.buffers),
    )


def check_golden_dtype(golden: Any, args: Sequence[Any]) -> None:
    """Refuse a golden that is no floating dtype or is less precise than an argument."""
    __tracebackhide__ = True
    if not isinstance(golden, torch.dtype) or not golden.is_floating_point:
        raise TypeError(
            f"golden must be a floating torch.dtype such as torch.float64, got {golden!r}"
        )
    for position, arg in enumerate(args):
        floating = isinstance(arg, torch.Tensor) and arg.is_floating_point()
        if floating and epsilon(arg.dtype) < epsilon(golden):
            raise ValueError(
                f"golden={golden} is less precise than argument {position} "
                f"({arg.dtype}); a golden reference needs a more precise dtype"
            )


def obtained_dtype(value: torch.Tensor, aux: Any) -> torch.dtype:
    """The least precise floating dtype among a result's value and aux tensors."""
    least = value.dtype
    for leaf in tree_leaves(aux):
        if isinstance(leaf, torch.Tensor) and is_inexact(leaf.dtype):
            least = less_precise(least, leaf.dtype)
    return least


def check_golden_obtained(
    fn: Callable[..., Any],
    requested: torch.dtype,
    obtained: torch.dtype,
    recording: Recording | None,
) -> None:
    """Warn, once per test (as ``recording`` keeps), where fn returned a golden less precise
    than requested."""
    if epsilon(obtained) <= epsilon(requested):
        return
    if recording is not None:
        if recording.golden_shortfall is not None:
            return
        recording.golden_shortfall = (dtype_name(requested), dtype_name(obtained))
    warnings.warn(
        GoldenPrecisionWarning(
            f"golden={requested} was requested, but {describe(fn)} returned {obtained}: it "
            f"casts inside (e.g. .float()), so the golden is only {dtype_name(obtained)}-"
            "precise and budgets are measured against that. Compute in at least the inputs' "
            "dtype, e.g. x.to(torch.promote_types(x.dtype, torch.float32)) for .float()"
        ),
        stacklevel=user_stacklevel(),
    )
