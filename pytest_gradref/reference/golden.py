"""The golden reference: the same reference computed in a higher precision, for budgets.

What a golden dtype may be, the problem with its inputs upcast to it, the promotion of what
the reference does in a lower precision (``PromoteToGolden``: its casts, its ``dtype=``
arguments, the modules and tensors it reaches besides its arguments), and the warning where
fn still returns a golden less precise than requested.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from pytest_gradref.config.tolerances import dtype_name
from pytest_gradref.reference.differentiation import Outputs, Problem, Result, describe
from pytest_gradref.verdict.dtypes import epsilon, is_inexact, less_precise
from pytest_gradref.warning_types import GoldenPrecisionWarning, user_stacklevel

if TYPE_CHECKING:
    from pytest_gradref.reference.recording import Recording
    from pytest_gradref.reference.spread import Spread


@dataclass(frozen=True)
class Golden:
    """The same reference computed in a higher precision."""

    dtype: torch.dtype
    device: torch.device
    value: Outputs
    arg_grads: tuple[torch.Tensor, ...]
    param_grads: Mapping[str, torch.Tensor]
    aux: Any = None
    # The least precise floating dtype fn returned (value and aux): less precise than
    # ``dtype`` where fn casts inside, e.g. with .float().
    obtained: torch.dtype | None = None
    # For a scalar value: its first-order terms x * dvalue/dx over the differentiated inputs,
    # as their sum of magnitudes and their 2-norm (see budget_item.BudgetItem.condition), a float64
    # tensor of two; None otherwise.
    value_condition: torch.Tensor | None = None
    # The rounding spread: randomly rounded runs of the reference, run where an item asks.
    spread: Spread | None = None


def compute_golden(
    strategy: Callable[[Problem], Result], problem: Problem, dtype: torch.dtype
) -> tuple[Result, Problem]:
    """The golden result by ``strategy`` and the problem that gave it: ``problem`` itself
    where fn computes in the golden dtype throughout, else ``problem`` under PromoteToGolden:
    where fn computed something less precise than ``dtype`` (it casts inside, even where it
    casts back at the end: LowerPrecisionWatch) or failed (a module or tensor it reaches
    besides its arguments met the upcast inputs). The second run is paid only by references
    that need it. Where that fails too, the first error is
    raised."""
    __tracebackhide__ = True
    first: RuntimeError | None = None
    watch = LowerPrecisionWatch(dtype)
    try:
        result = strategy(replace(problem, mode=lambda: watch))
    except RuntimeError as error:
        first = error
    else:
        precise = epsilon(obtained_dtype(result.value, result.aux)) <= epsilon(dtype)
        if precise and not watch.seen:
            return result, problem
    promoted = replace(problem, mode=partial(PromoteToGolden, dtype))
    try:
        return strategy(promoted), promoted
    except RuntimeError:
        if first is not None:
            raise first from None
        raise


def value_condition(
    upcast: Problem, value: Outputs, arg_grads: Sequence[Any], param_grads: Mapping[str, Any]
) -> torch.Tensor | None:
    """A scalar value's first-order terms x * dvalue/dx over the differentiated inputs x
    (golden precision), as [sum of their magnitudes, their 2-norm]: for a sum of terms, the
    first is the sum of their magnitudes, which its rounding errors scale with where the terms
    cancel; the second, times u / sqrt(3), is the spread of the value's error when every
    input is rounded once more (see budget_item.BudgetItem.condition). None for a value that is
    not a scalar or has no gradient."""
    plain = (torch.Tensor, torch.nn.Parameter)
    if isinstance(value, tuple) or value.numel() != 1 or type(value) not in plain:
        # A tensor subclass (DTensor, a wrapper) may not stack into the two numbers (torch 2.8's
        # wrappers return a 0-dim result): its value's floor keeps the golden's own scale.
        return None
    inputs = [upcast.args[i] for i in upcast.argnums]
    pairs = [*zip(inputs, arg_grads), *((upcast.params[n], g) for n, g in param_grads.items())]
    terms = [
        (x.detach() * g.detach()).reshape(-1)
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
    # Non-finite terms (an infinite gradient, 0 * inf) set no scale, as in the golden's own
    # (statistics.finite): a NaN would fail every value, an infinity pass any.
    flat = torch.cat(terms).to(torch.float64).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
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


# torch's dispatch-mode base class is untyped.
class LowerPrecisionWatch(TorchFunctionMode):
    """Notes whether a reference's forward computes anything less precise than the golden
    dtype: a ``.float()``, a ``dtype=`` argument, a tensor made in float32. A reference that
    casts back at the end (``.to(x.dtype)``, the input's dtype, float64 in the golden's run)
    returns a float64 result computed in float32, which its result's dtype cannot tell. Only
    the torch calls of the reference's own code pass through a function mode, not the
    operations of its backward, so watching costs a few microseconds a call; a false alarm (a
    float32 tensor made and promoted at once) costs the promoted run, nothing else."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self._epsilon = epsilon(dtype)
        self.seen = False

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        if not self.seen:
            leaves = (result,) if type(result) is torch.Tensor else tree_leaves(result)
            self.seen = any(
                isinstance(leaf, torch.Tensor)
                and leaf.is_floating_point()
                and epsilon(leaf.dtype) > self._epsilon
                for leaf in leaves
            )
        return result


class PromoteToGolden(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs a reference's operations in the golden dtype where it would run them lower.

    A ``dtype=`` argument less precise than the golden becomes the golden (which is what
    ``.float()``, ``.half()``, ``.to(torch.float32)`` and ``softmax(..., dtype=...)`` reach as
    operations), and a floating input less precise than the golden is upcast where it meets a
    golden-dtype input of the same operation (a closed-over module's float32 weight in the
    golden's matmul). Bit views (``view(dtype)``, whose dtype is positional) are left alone,
    and so are arguments written in place, whose aliasing the caller sees. It runs below
    autograd and torch.func, as the rounded reference's mode does, so gradients see the same
    promotion.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dtype = dtype
        self._epsilon = epsilon(dtype)

    def _lower(self, dtype: Any) -> bool:
        return (
            isinstance(dtype, torch.dtype) and is_inexact(dtype) and epsilon(dtype) > self._epsilon
        )

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self._lower(kwargs.get("dtype")):
            kwargs = {**kwargs, "dtype": torch.promote_types(kwargs["dtype"], self.dtype)}
        leaves, spec = tree_flatten((args, kwargs))
        floating = [
            i
            for i, leaf in enumerate(leaves)
            if isinstance(leaf, torch.Tensor) and is_inexact(leaf.dtype)
        ]
        if any(leaves[i].dtype == self.dtype for i in floating) and any(
            self._lower(leaves[i].dtype) for i in floating
        ):
            written = {
                id(args[position] if position < len(args) else kwargs.get(argument.name))
                for position, argument in enumerate(func._schema.arguments)
                if argument.alias_info is not None and argument.alias_info.is_write
            }
            for i in floating:
                leaf = leaves[i]
                if self._lower(leaf.dtype) and id(leaf) not in written:
                    leaves[i] = leaf.to(torch.promote_types(leaf.dtype, self.dtype))
            args, kwargs = tree_unflatten(leaves, spec)
        return func(*args, **kwargs)


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
        cotangent=cast(problem.cotangent),
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


def obtained_dtype(value: Outputs, aux: Any) -> torch.dtype:
    """The least precise floating dtype among a result's value (its outputs) and aux tensors."""
    least = torch.float64
    for leaf in (*tree_leaves(value), *tree_leaves(aux)):
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
            f"golden={requested} was requested, but {describe(fn)} returned {obtained} even "
            f"with its casts and dtype= arguments promoted to {dtype_name(requested)}, so the "
            f"golden is only {dtype_name(obtained)}-precise and budgets are measured against "
            f"that. Something on its path computes in {dtype_name(obtained)} where no "
            f"{dtype_name(requested)} tensor reaches it (a tensor it creates without a dtype "
            "or closes over, used alone; a round trip through NumPy or Python numbers): "
            "pass such tensors as arguments, or create them in the inputs' dtype"
        ),
        stacklevel=user_stacklevel(),
    )
