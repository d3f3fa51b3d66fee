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
from typing import Any, Union, cast

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from pytest_gradref.config.strategies import Strategy

# What a reference function returns, its aux aside: a tensor (a scalar loss, or an output),
# or a tuple of tensor outputs.
Outputs = Union[torch.Tensor, tuple[torch.Tensor, ...]]


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
    # What a tensor output's gradients are the vector-Jacobian product with: the test's, or,
    # once the first run drew it (draw_cotangent), the same for every later run (the golden's
    # upcast). None: a scalar loss, differentiated as it is, or an output not yet seen.
    cotangent: Outputs | None = None
    # Whether the test gave the cotangent (checked against the output's shape and dtype), or
    # it comes from the first run (cast to each later run's output dtype: the golden's).
    cotangent_given: bool = False

    @property
    def differentiates(self) -> bool:
        """Whether anything is differentiated: a value-only reference (argnums=() on a
        function) computes fn's value and aux alone."""
        return bool(self.argnums or self.params)

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

    def split(self, out: Any) -> tuple[Outputs, Any]:
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
        if _is_tensor_tuple(loss):
            # A tuple of outputs: each a tensor, and their gradients one vector-Jacobian product.
            outputs = tuple(loss)
            for output in outputs:
                if not output.is_floating_point():
                    raise TypeError(
                        f"{name} returned a {output.dtype} output; it must be floating-point"
                    )
            if self.cotangent_given:
                check_cotangent(self.cotangent, outputs, name)
            return outputs, aux
        if not isinstance(loss, torch.Tensor):
            hint = (
                "; pass has_aux=True if the rest of the tuple is auxiliary output"
                if isinstance(out, tuple) and not self.has_aux
                else ""
            )
            raise TypeError(
                f"{name} must return a tensor (a loss, or an output its gradients are a "
                f"vector-Jacobian product of), it returned {type(loss).__name__}{hint}"
            )
        if not loss.is_floating_point():
            raise TypeError(f"{name} returned a {loss.dtype} output; it must be floating-point")
        if self.cotangent is not None:
            if self.cotangent_given:
                check_cotangent(self.cotangent, loss, name)
            return loss, aux
        if loss.numel() == 1:
            return loss.reshape(()), aux  # a scalar loss
        return loss, aux


@dataclass(frozen=True)
class Result:
    """What one strategy computed: fn's value (a scalar loss, or a tensor output) and aux,
    the gradients, and the cotangent they are the vector-Jacobian product with (None for a
    scalar loss differentiated as it is)."""

    value: Outputs
    aux: Any
    arg_grads: tuple[torch.Tensor, ...]
    param_grads: dict[str, torch.Tensor]
    cotangent: Outputs | None = None


# The cotangents a reference draws come from their own generator, so that drawing one leaves
# the test's random state alone, and every run draws the same.
COTANGENT_SEED = 0


def draw_cotangent(output: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A cotangent for a tensor output: standard normal draws of its shape and dtype on its
    device, from ``generator``, by default one seeded with COTANGENT_SEED (on the CPU, then
    moved: every device gets the same numbers)."""
    if generator is None:
        generator = torch.Generator().manual_seed(COTANGENT_SEED)
    draws = torch.randn(output.shape, generator=generator, dtype=torch.float64)
    return draws.to(device=output.device, dtype=output.dtype)


def _is_tensor_tuple(value: Any) -> bool:
    """A plain tuple (not a named one) of tensors only: a function's several outputs."""
    return type(value) is tuple and bool(value) and all(isinstance(v, torch.Tensor) for v in value)


def check_cotangent(cotangent: Any, output: Outputs, name: str) -> None:
    """A cotangent must be a tensor of the output's shape and dtype; for a tuple of outputs,
    a tuple of such tensors, one for each."""
    __tracebackhide__ = True
    if isinstance(output, tuple):
        if not _is_tensor_tuple(cotangent) or len(cotangent) != len(output):
            raise TypeError(
                f"{name} returned {len(output)} outputs, so cotangent= must be a tuple of "
                f"{len(output)} tensors, one for each; got {_kind(cotangent)}"
            )
        for position, (part, out) in enumerate(zip(cotangent, output)):
            check_cotangent(part, out, f"{name}'s output {position}:")
        return
    if not isinstance(cotangent, torch.Tensor):
        raise TypeError(f"cotangent must be a tensor, got {_kind(cotangent)}")
    if cotangent.shape != output.shape or cotangent.dtype != output.dtype:
        raise ValueError(
            f"cotangent= has shape {tuple(cotangent.shape)} and dtype {cotangent.dtype}, but "
            f"{name} returned shape {tuple(output.shape)} and dtype {output.dtype}: a cotangent "
            "takes the output's shape and dtype"
        )


def _kind(value: Any) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return f"a {type(value).__name__}"


def _cotangent_for(problem: Problem, output: Outputs) -> Outputs | None:
    """The cotangent an output's gradients are taken with: the problem's, a fresh draw for a
    tensor output (one per output of a tuple, in turn from the one generator), None for a
    scalar loss."""
    if problem.cotangent is not None:
        if isinstance(output, tuple):
            return tuple(
                c.to(device=o.device, dtype=o.dtype) for c, o in zip(problem.cotangent, output)
            )
        assert isinstance(problem.cotangent, torch.Tensor)
        return problem.cotangent.to(device=output.device, dtype=output.dtype)
    if isinstance(output, tuple):
        generator = torch.Generator().manual_seed(COTANGENT_SEED)
        return tuple(draw_cotangent(o, generator) for o in output)
    if output.dim() == 0:
        return None
    return draw_cotangent(output)


def value_items(value: Outputs) -> list[tuple[str, torch.Tensor]]:
    """The items a reference's value makes, with their labels: ``value``, or ``value[0]``,
    ``value[1]``, ... for a tuple of outputs."""
    if isinstance(value, tuple):
        return [(f"value[{position}]", v) for position, v in enumerate(value)]
    return [("value", value)]


def detached_outputs(value: Outputs) -> Outputs:
    if isinstance(value, tuple):
        return tuple(v.detach() for v in value)
    return value.detach()


def _as_tuple(value: Any, count: int = 1) -> tuple[Any, ...]:
    """Outputs (or their cotangents) as a tuple; None (a scalar loss's implicit cotangent)
    as ``count`` Nones."""
    if value is None:
        return (None,) * count
    return value if isinstance(value, tuple) else (value,)


def _detached(aux: Any) -> Any:
    """aux with its tensors detached, as torch.func returns it."""
    return tree_map(lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf, aux)


def _value_only(problem: Problem) -> Result:
    """fn's value and aux, nothing differentiated: the same under both strategies."""
    __tracebackhide__ = True
    with torch.no_grad(), problem.mode():
        value, aux = problem.split(problem.call((), {}, problem.fresh_buffers()))
    return Result(value=detached_outputs(value), aux=_detached(aux), arg_grads=(), param_grads={})


def _by_autograd(problem: Problem) -> Result:
    __tracebackhide__ = True
    if not problem.differentiates:
        return _value_only(problem)
    leaves = [problem.args[i].detach().requires_grad_(True) for i in problem.argnums]
    params = {n: p.detach().requires_grad_(True) for n, p in problem.params.items()}
    inputs = [*leaves, *params.values()]
    buffers = problem.fresh_buffers()
    with torch.enable_grad(), problem.mode():
        loss, aux = problem.split(problem.call(leaves, params, buffers))
        cotangent = _cotangent_for(problem, loss)
        found: Sequence[torch.Tensor | None] = [None] * len(inputs)
        # Only outputs that the differentiated inputs reach (the others add nothing).
        pairs = [
            (o, c)
            for o, c in zip(_as_tuple(loss), _as_tuple(cotangent, len(_as_tuple(loss))))
            if o.requires_grad
        ]
        if pairs:  # else nothing differentiable reached the output
            outputs, cotangents = zip(*pairs)
            given = None if cotangent is None else list(cotangents)
            found = torch.autograd.grad(
                list(outputs), inputs, grad_outputs=given, allow_unused=True
            )
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, found)]
    return Result(
        value=detached_outputs(loss),
        aux=_detached(aux),
        arg_grads=tuple(grads[: len(leaves)]),
        param_grads=dict(zip(params, grads[len(leaves) :])),
        cotangent=cotangent,
    )


def _by_grad_and_value(problem: Problem) -> Result:
    __tracebackhide__ = True
    # torch.func returns only tensors as aux, so the rest of aux waits here and is put back.
    aux_parts: dict[str, Any] = {}

    def loss_and_aux(
        diff_args: tuple[torch.Tensor, ...],
        diff_params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
    ) -> tuple[Outputs, tuple[torch.Tensor, ...]]:
        __tracebackhide__ = True
        loss, aux = problem.split(problem.call(diff_args, diff_params, buffers))
        if scalar_only and (isinstance(loss, tuple) or loss.dim() != 0):
            raise _TensorOutput
        leaves, spec = tree_flatten(aux)
        aux_parts.update(leaves=leaves, spec=spec)
        return loss, tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))

    if not problem.differentiates:
        return _value_only(problem)
    diff_args = tuple(problem.args[i].detach() for i in problem.argnums)
    diff_params = {n: p.detach() for n, p in problem.params.items()}
    buffers = problem.fresh_buffers()
    cotangent = None
    # A scalar loss goes through grad_and_value, as the kernels under test do; a tensor output
    # (or a cotangent the test gave) through vjp. A tensor output not yet seen is found on
    # the first try, which then starts again (once per reference: its cotangent is kept).
    scalar_only = problem.cotangent is None
    try:
        with problem.mode():
            if scalar_only:
                try:
                    transform = torch.func.grad_and_value(
                        loss_and_aux, argnums=(0, 1), has_aux=True
                    )
                    (arg_grads, param_grads), (value, aux_tensors) = transform(
                        diff_args, diff_params, buffers
                    )
                except _TensorOutput:
                    scalar_only = False
            if not scalar_only:
                # With has_aux, vjp returns (output, pullback, aux); its stubs say a pair.
                value, pullback, aux_tensors = cast(
                    "tuple[Any, Any, Any]",
                    torch.func.vjp(
                        lambda a, p: loss_and_aux(a, p, problem.fresh_buffers()),
                        diff_args,
                        diff_params,
                        has_aux=True,
                    ),
                )
                cotangent = _cotangent_for(problem, value)
                arg_grads, param_grads = pullback(cotangent)
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
        value=detached_outputs(value),
        aux=tree_unflatten(leaves, aux_parts["spec"]),
        arg_grads=tuple(arg_grads),
        param_grads=dict(param_grads),
        cotangent=cotangent,
    )


class _TensorOutput(Exception):
    """fn returned a tensor output where grad_and_value needs a scalar: its vector-Jacobian
    product is taken instead (torch.func.vjp)."""


# What runs each strategy (crosscheck runs both).
STRATEGY_FUNCTIONS: dict[Strategy, Callable[[Problem], Result]] = {
    "autograd": _by_autograd,
    "grad_and_value": _by_grad_and_value,
}
