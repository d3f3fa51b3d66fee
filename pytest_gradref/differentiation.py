"""How one strategy differentiates fn: by autograd or by torch.func.grad_and_value.

Neither mutates the caller's tensors or modules: they differentiate detached aliases (no
``.grad`` written, ``requires_grad`` untouched) and run modules through
``torch.func.functional_call`` with detached parameters and cloned buffers.

An input that does not influence the loss gets a zero gradient under both strategies: that is
its true gradient, and it is what grad_and_value returns, so the two strategies agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from pytest_gradref.strategies import Strategy


def describe(fn: Callable[..., Any]) -> str:
    """fn's name for messages: its qualified name, else its type's (a module, a callable)."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__


@dataclass
class Problem:
    """fn and its arguments, split into what is differentiated and what is not.

    For modules, ``params`` are the parameters differentiated, ``frozen`` the others, and
    ``buffers`` the buffers, which every run gets fresh copies of: a module that updates them
    (BatchNorm's running statistics) then changes neither the caller's module nor later runs.
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    argnums: tuple[int, ...]
    has_aux: bool
    params: dict[str, torch.Tensor]
    frozen: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    # Entered around fn and its differentiation, not around the plugin's own bookkeeping
    # (fresh buffers, zero gradients): the rounded reference's dispatch mode (rounding.py).
    mode: Callable[[], AbstractContextManager[object]] = nullcontext

    def fresh_buffers(self) -> dict[str, torch.Tensor]:
        return {name: buffer.clone() for name, buffer in self.buffers.items()}

    def call(
        self,
        diff_args: Sequence[torch.Tensor],
        diff_params: Mapping[str, Any],
        buffers: Mapping[str, torch.Tensor],
    ) -> Any:
        __tracebackhide__ = True
        full = list(self.args)
        for position, tensor in zip(self.argnums, diff_args):
            full[position] = tensor
        if self.params or self.frozen or self.buffers:
            state = {**self.frozen, **buffers, **diff_params}
            return torch.func.functional_call(self.fn, state, tuple(full), self.kwargs)  # type: ignore[arg-type]
        return self.fn(*full, **self.kwargs)

    def split(self, out: Any) -> tuple[torch.Tensor, Any]:
        __tracebackhide__ = True
        name = describe(self.fn)
        if self.has_aux:
            if not isinstance(out, tuple):
                raise TypeError(
                    f"has_aux=True needs {name} to return a (loss, aux) pair, "
                    f"it returned a {type(out).__name__}"
                )
            if len(out) != 2:
                rest = ", ".join(f"out[{i}]" for i in range(1, len(out)))
                raise TypeError(
                    f"has_aux=True needs {name} to return a (loss, aux) pair: it returned "
                    f"{len(out)} elements and needs 2; return (loss, ({rest},)) to pass the "
                    "rest as one aux"
                )
            loss, aux = out
        else:
            loss, aux = out, None
        if not isinstance(loss, torch.Tensor):
            hint = (
                "; pass has_aux=True if the rest of the tuple is auxiliary output"
                if isinstance(out, tuple) and not self.has_aux
                else ""
            )
            raise TypeError(
                f"{name} must return a scalar loss tensor, it returned {type(loss).__name__}{hint}"
            )
        if loss.numel() != 1:
            raise ValueError(
                f"{name} returned a tensor of shape {tuple(loss.shape)}; the loss must be a "
                "scalar (0-dim or one element): reduce it, e.g. with .sum() or .mean()"
            )
        if not loss.is_floating_point():
            raise TypeError(f"{name} returned a {loss.dtype} loss; it must be floating-point")
        return loss.reshape(()), aux


@dataclass(frozen=True)
class Result:
    """What one strategy computed: fn's value and aux, and the gradients."""

    value: torch.Tensor
    aux: Any
    arg_grads: tuple[torch.Tensor, ...]
    param_grads: dict[str, torch.Tensor]


def _by_autograd(problem: Problem) -> Result:
    __tracebackhide__ = True
    leaves = [problem.args[i].detach().requires_grad_(True) for i in problem.argnums]
    params = {n: p.detach().requires_grad_(True) for n, p in problem.params.items()}
    inputs = [*leaves, *params.values()]
    buffers = problem.fresh_buffers()
    with torch.enable_grad(), problem.mode():
        loss, aux = problem.split(problem.call(leaves, params, buffers))
        found: Sequence[torch.Tensor | None] = [None] * len(inputs)
        if loss.requires_grad and inputs:  # else nothing differentiable reached the loss
            found = torch.autograd.grad(loss, inputs, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, found)]
    # aux comes back detached, as torch.func returns it.
    aux = tree_map(lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf, aux)
    return Result(
        value=loss.detach(),
        aux=aux,
        arg_grads=tuple(grads[: len(leaves)]),
        param_grads=dict(zip(params, grads[len(leaves) :])),
    )


def _by_grad_and_value(problem: Problem) -> Result:
    __tracebackhide__ = True
    # torch.func returns only tensors as aux, so the rest of aux waits here and is put back.
    aux_parts: dict[str, Any] = {}

    def loss_and_aux(
        diff_args: tuple[torch.Tensor, ...],
        diff_params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        __tracebackhide__ = True
        loss, aux = problem.split(problem.call(diff_args, diff_params, buffers))
        leaves, spec = tree_flatten(aux)
        aux_parts.update(leaves=leaves, spec=spec)
        return loss, tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))

    transform = torch.func.grad_and_value(loss_and_aux, argnums=(0, 1), has_aux=True)
    diff_args = tuple(problem.args[i].detach() for i in problem.argnums)
    diff_params = {n: p.detach() for n, p in problem.params.items()}
    buffers = problem.fresh_buffers()
    try:
        with problem.mode():
            (arg_grads, param_grads), (value, aux_tensors) = transform(
                diff_args, diff_params, buffers
            )
    except RuntimeError as error:
        if "setup_context" in str(error):
            raise RuntimeError(
                f"grad_and_value cannot differentiate {describe(problem.fn)}: it calls a "
                "torch.autograd.Function that has no setup_context staticmethod, which "
                "torch.func transforms require. Either give that Function a setup_context "
                "(https://pytorch.org/docs/stable/notes/extending.func.html) or compute this "
                "reference by autograd: @pytest.mark.gradref(strategy='autograd')"
            ) from error
        raise
    tensors = iter(aux_tensors)
    leaves = [
        next(tensors) if isinstance(leaf, torch.Tensor) else leaf for leaf in aux_parts["leaves"]
    ]
    return Result(
        value=value.detach(),
        aux=tree_unflatten(leaves, aux_parts["spec"]),
        arg_grads=tuple(arg_grads),
        param_grads=dict(param_grads),
    )


# What runs each strategy (crosscheck runs both).
STRATEGY_FUNCTIONS: dict[Strategy, Callable[[Problem], Result]] = {
    "autograd": _by_autograd,
    "grad_and_value": _by_grad_and_value,
}
