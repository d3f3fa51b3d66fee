"""Reference values and gradients, by autograd or by torch.func.grad_and_value.

``compute_reference`` never mutates the caller's tensors or modules: it differentiates
detached aliases (no ``.grad`` written, ``requires_grad`` untouched) and runs modules through
``torch.func.functional_call`` with detached parameters and cloned buffers.

An input that does not influence the loss gets a zero gradient under both strategies: that is
its true gradient, and it is what grad_and_value returns, so the two strategies agree.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Union

from pytest_gradref.backends import STRATEGIES, Strategy
from pytest_gradref.compare import (
    ItemMismatch,
    Tolerance,
    ToleranceOverride,
    compare_item,
    format_mismatches,
    less_precise,
    resolve_tolerance,
)

if TYPE_CHECKING:
    import torch

StrategyChoice = Literal["autograd", "grad_and_value", "crosscheck"]
STRATEGY_CHOICES: tuple[StrategyChoice, ...] = ("autograd", "grad_and_value", "crosscheck")
Argnums = Union[int, Sequence[int]]


@dataclass(frozen=True)
class Disagreement:
    """How far autograd and grad_and_value differ on one item (crosscheck)."""

    label: str
    max_abs: float
    max_rel: float


@dataclass(frozen=True)
class ToleranceContext:
    """What tolerances depend on besides the dtype: the backend and any overrides."""

    backend: str
    table: Mapping[str, Tolerance] = field(default_factory=dict)
    overrides: tuple[ToleranceOverride, ...] = ()


@dataclass(frozen=True, eq=False)
class Reference:
    """A reference loss value and its gradients.

    Attributes:
        value: the loss, detached.
        grads: gradients w.r.t. ``args[argnums]``: one tensor when argnums is an int, else a
            tuple aligned with argnums.
        param_grads: gradients w.r.t. the named parameters when fn is an nn.Module.
        aux: fn's auxiliary output when ``has_aux=True``.
        strategy: the strategy that produced value and grads.
        backend: the backend whose policy chose it.
        crosscheck: under the crosscheck strategy, the disagreement per item between
            autograd and grad_and_value; else None.
    """

    value: torch.Tensor
    grads: torch.Tensor | tuple[torch.Tensor, ...]
    param_grads: Mapping[str, torch.Tensor]
    aux: Any
    strategy: Strategy
    backend: str
    crosscheck: tuple[Disagreement, ...] | None
    grad_labels: tuple[str, ...]
    tolerance_context: ToleranceContext

    def _grads_tuple(self) -> tuple[torch.Tensor, ...]:
        return self.grads if isinstance(self.grads, tuple) else (self.grads,)

    def assert_close(
        self,
        actual_value: torch.Tensor,
        actual_grads: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
        *,
        param_grads: Mapping[str, torch.Tensor | None] | torch.nn.Module | None = None,
        rtol: float | None = None,
        atol: float | None = None,
    ) -> None:
        """Assert that a kernel's value and gradients match this reference.

        Each item is compared with the tolerance of its backend and dtype (the less precise of
        the two dtypes), unless a ``gradref`` marker or ``rtol``/``atol`` here override it.
        Every item is checked before failing, and the message names each one that differs.

        Raises:
            AssertionError: an item differs beyond its tolerance.
            TypeError, ValueError: the actual results do not line up with the reference.
        """
        items = self._pair_items(actual_value, actual_grads, param_grads)
        overrides = self.tolerance_context.overrides
        if rtol is not None or atol is not None:
            call = ToleranceOverride(rtol, atol, "the assert_close() arguments")
            overrides = (call, *overrides)
        mismatches: list[ItemMismatch] = []
        for label, actual, expected in items:
            if actual is None:
                mismatches.append(
                    ItemMismatch(label, "the actual gradient is None: did backward() reach it?")
                )
                continue
            dtype = less_precise(actual.dtype, expected.dtype)
            resolved = resolve_tolerance(
                dtype, self.tolerance_context.backend, self.tolerance_context.table, overrides
            )
            mismatch = compare_item(label, actual, expected, resolved)
            if mismatch is not None:
                mismatches.append(mismatch)
        if mismatches:
            header = f"Reference mismatch ({self.backend} backend, {self.strategy} reference)"
            raise AssertionError(format_mismatches(header, mismatches, len(items)))

    def _pair_items(
        self,
        actual_value: torch.Tensor,
        actual_grads: torch.Tensor | Sequence[torch.Tensor | None] | None,
        param_grads: Mapping[str, torch.Tensor | None] | torch.nn.Module | None,
    ) -> list[tuple[str, torch.Tensor | None, torch.Tensor]]:
        import torch

        items: list[tuple[str, torch.Tensor | None, torch.Tensor]] = [
            ("value", actual_value, self.value)
        ]
        expected_grads = self._grads_tuple()
        if expected_grads:
            if actual_grads is None:
                raise TypeError(
                    f"assert_close(): this reference holds {len(expected_grads)} gradient(s) "
                    f"({', '.join(self.grad_labels)}); pass them as actual_grads"
                )
            if isinstance(actual_grads, torch.Tensor):
                actual_tuple: tuple[torch.Tensor | None, ...] = (actual_grads,)
            else:
                actual_tuple = tuple(actual_grads)
            if len(actual_tuple) != len(expected_grads):
                raise ValueError(
                    f"assert_close(): actual_grads has {len(actual_tuple)} entries but the "
                    f"reference has {len(expected_grads)} ({', '.join(self.grad_labels)}), "
                    "aligned with argnums"
                )
            items += zip(self.grad_labels, actual_tuple, expected_grads)
        if self.param_grads:
            if param_grads is None:
                raise TypeError(
                    "assert_close(): this reference holds gradients for the module's "
                    f"parameters ({', '.join(self.param_grads)}); pass param_grads= (a mapping "
                    "of name to gradient, or the module after backward())"
                )
            if isinstance(param_grads, torch.nn.Module):
                param_grads = {n: p.grad for n, p in param_grads.named_parameters()}
            missing = sorted(set(self.param_grads) - set(param_grads))
            if missing:
                raise ValueError(f"assert_close(): param_grads lacks {', '.join(missing)}")
            for name, expected in self.param_grads.items():
                items.append((f"gradient of parameter {name!r}", param_grads[name], expected))
        return items


# --- computing -------------------------------------------------------------------------------


def _describe(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def normalize_argnums(
    fn: Callable[..., Any], args: Sequence[Any], argnums: Argnums, *, is_module: bool
) -> tuple[int, ...]:
    """Validated, non-negative argnums; raises a TypeError/ValueError that names the fault."""
    import torch

    if isinstance(argnums, bool) or not isinstance(argnums, (int, tuple, list)):
        raise TypeError(f"argnums must be an int or a tuple of ints, got {argnums!r}")
    raw = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not raw and not is_module:
        raise ValueError(
            "argnums=() asks for no gradients; name at least one tensor argument of "
            f"{_describe(fn)}"
        )
    count = len(args)
    normalized: list[int] = []
    for index in raw:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"argnums entries must be ints, got {index!r}")
        if not -count <= index < count:
            raise ValueError(
                f"argnums={index} is out of range: {_describe(fn)} was given {count} "
                f"positional argument(s), so valid indices are 0..{count - 1} (or negative)"
            )
        position = index % count
        if position in normalized:
            raise ValueError(f"argnums names argument {position} twice")
        arg = args[position]
        if not isinstance(arg, torch.Tensor):
            raise TypeError(
                f"argnums={index} points at argument {position}, a {type(arg).__name__}; "
                "gradients need a floating-point torch.Tensor there"
            )
        if not (arg.is_floating_point() or arg.is_complex()):
            raise TypeError(
                f"argnums={index} points at argument {position}, a {arg.dtype} tensor; "
                "only floating-point and complex tensors have gradients, so leave it out "
                "of argnums"
            )
        normalized.append(position)
    return tuple(normalized)


def _argument_labels(fn: Callable[..., Any], count: int, argnums: tuple[int, ...]) -> list[str]:
    """'gradient of argument 1 (weight)', naming parameters where the signature allows."""
    names: list[str | None] = [None] * count
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        positional = [
            p
            for p in signature.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        for i in range(min(count, len(positional))):
            names[i] = positional[i].name
    labels = []
    for i in argnums:
        suffix = f" ({names[i]})" if names[i] else ""
        labels.append(f"gradient of argument {i}{suffix}")
    return labels


@dataclass
class _Problem:
    """fn and its arguments, split into what is differentiated and what is not."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    argnums: tuple[int, ...]
    has_aux: bool
    params: dict[str, torch.Tensor]
    frozen: dict[str, torch.Tensor]

    def call(self, diff_args: Sequence[torch.Tensor], diff_params: Mapping[str, Any]) -> Any:
        full = list(self.args)
        for position, tensor in zip(self.argnums, diff_args):
            full[position] = tensor
        if self.params or self.frozen:
            import torch

            state = {**self.frozen, **diff_params}
            return torch.func.functional_call(self.fn, state, tuple(full), self.kwargs)  # type: ignore[arg-type]
        return self.fn(*full, **self.kwargs)

    def split(self, out: Any) -> tuple[torch.Tensor, Any]:
        import torch

        name = _describe(self.fn)
        if self.has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    f"has_aux=True needs {name} to return a (loss, aux) pair, "
                    f"it returned {type(out).__name__}"
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
class _Result:
    value: torch.Tensor
    aux: Any
    arg_grads: tuple[torch.Tensor, ...]
    param_grads: dict[str, torch.Tensor]


def _by_autograd(problem: _Problem) -> _Result:
    import torch

    leaves = [problem.args[i].detach().requires_grad_(True) for i in problem.argnums]
    params = {n: p.detach().requires_grad_(True) for n, p in problem.params.items()}
    inputs = [*leaves, *params.values()]
    with torch.enable_grad():
        loss, aux = problem.split(problem.call(leaves, params))
        found: Sequence[torch.Tensor | None] = [None] * len(inputs)
        if loss.requires_grad and inputs:  # else nothing differentiable reached the loss
            found = torch.autograd.grad(loss, inputs, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, found)]
    return _Result(
        value=loss.detach(),
        aux=aux,
        arg_grads=tuple(grads[: len(leaves)]),
        param_grads=dict(zip(params, grads[len(leaves) :])),
    )


def _by_grad_and_value(problem: _Problem) -> _Result:
    import torch

    def loss_and_aux(
        diff_args: tuple[torch.Tensor, ...], diff_params: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Any]:
        loss, aux = problem.split(problem.call(diff_args, diff_params))
        # torch.func unwraps aux as a pytree of tensors, so "no aux" travels as an empty tuple.
        return loss, aux if problem.has_aux else ()

    transform = torch.func.grad_and_value(loss_and_aux, argnums=(0, 1), has_aux=True)
    diff_args = tuple(problem.args[i].detach() for i in problem.argnums)
    diff_params = {n: p.detach() for n, p in problem.params.items()}
    try:
        (arg_grads, param_grads), (value, aux) = transform(diff_args, diff_params)
    except RuntimeError as error:
        if "setup_context" in str(error):
            raise RuntimeError(
                f"grad_and_value cannot differentiate {_describe(problem.fn)}: it calls a "
                "torch.autograd.Function that has no setup_context staticmethod, which "
                "torch.func transforms require. Either give that Function a setup_context "
                "(https://pytorch.org/docs/stable/notes/extending.func.html) or compute this "
                "reference by autograd: @pytest.mark.gradref(strategy='autograd')"
            ) from error
        raise
    return _Result(
        value=value.detach(),
        aux=aux if problem.has_aux else None,
        arg_grads=tuple(arg_grads),
        param_grads=dict(param_grads),
    )


_STRATEGY_FUNCTIONS: dict[Strategy, Callable[[_Problem], _Result]] = {
    "autograd": _by_autograd,
    "grad_and_value": _by_grad_and_value,
}


def _disagreement(label: str, a: torch.Tensor, b: torch.Tensor) -> Disagreement:
    import torch

    a64, b64 = a.detach().double(), b.detach().double()
    diff = (a64 - b64).abs()
    if diff.numel() == 0:
        return Disagreement(label, 0.0, 0.0)
    relative = torch.where(diff == 0, torch.zeros_like(diff), diff / b64.abs())
    return Disagreement(label, float(diff.max()), float(relative.max()))


def compute_reference(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    argnums: Argnums,
    has_aux: bool,
    strategy: StrategyChoice,
    default_strategy: Strategy,
    tolerance_context: ToleranceContext,
) -> Reference:
    """fn's value and gradients by ``strategy``; see the module docstring for guarantees.

    Under ``crosscheck`` both strategies run, ``default_strategy``'s result is returned and
    the greatest disagreement per item is recorded on ``Reference.crosscheck``.
    """
    import torch

    if strategy not in STRATEGY_CHOICES:
        raise ValueError(f"strategy must be one of {STRATEGY_CHOICES}, got {strategy!r}")
    if not callable(fn):
        raise TypeError(f"grad_reference needs a callable or nn.Module first, got {fn!r}")
    is_module = isinstance(fn, torch.nn.Module)
    args = tuple(args)
    positions = normalize_argnums(fn, args, argnums, is_module=is_module)
    params: dict[str, torch.Tensor] = {}
    frozen: dict[str, torch.Tensor] = {}
    if is_module:
        assert isinstance(fn, torch.nn.Module)
        for name, param in fn.named_parameters():
            if param.requires_grad:
                params[name] = param
            else:
                frozen[name] = param.detach()
        # Clones, so running statistics updated by the call never reach the caller's module.
        frozen.update({name: b.detach().clone() for name, b in fn.named_buffers()})
    problem = _Problem(fn, args, dict(kwargs), positions, has_aux, params, frozen)
    signature_source = fn.forward if isinstance(fn, torch.nn.Module) else fn
    labels = _argument_labels(signature_source, len(args), positions)

    primary: Strategy = default_strategy if strategy == "crosscheck" else strategy
    result = _STRATEGY_FUNCTIONS[primary](problem)
    crosscheck = None
    if strategy == "crosscheck":
        other_strategy = next(s for s in STRATEGIES if s != primary)
        other = _STRATEGY_FUNCTIONS[other_strategy](problem)
        pairs = [("value", result.value, other.value)]
        pairs += zip(labels, result.arg_grads, other.arg_grads)
        pairs += [
            (f"gradient of parameter {name!r}", grad, other.param_grads[name])
            for name, grad in result.param_grads.items()
        ]
        crosscheck = tuple(_disagreement(*pair) for pair in pairs)

    grads: torch.Tensor | tuple[torch.Tensor, ...] = result.arg_grads
    if isinstance(argnums, int):
        grads = result.arg_grads[0]
    return Reference(
        value=result.value,
        grads=grads,
        param_grads=result.param_grads,
        aux=result.aux,
        strategy=primary,
        backend=tolerance_context.backend,
        crosscheck=crosscheck,
        grad_labels=tuple(labels),
        tolerance_context=tolerance_context,
    )


@dataclass(frozen=True)
class GradReference:
    """The ``grad_reference`` fixture: computes references under the test's policy."""

    strategy: StrategyChoice
    default_strategy: Strategy
    tolerance_context: ToleranceContext

    def __call__(
        self,
        fn: Callable[..., Any],
        /,
        *args: Any,
        argnums: Argnums = 0,
        has_aux: bool = False,
        **kwargs: Any,
    ) -> Reference:
        """fn(*args, **kwargs)'s value and its gradients w.r.t. ``args[argnums]``.

        fn may be an nn.Module: then gradients w.r.t. its parameters that require grad come
        too, in ``Reference.param_grads``, and ``argnums=()`` asks for those alone.
        """
        return compute_reference(
            fn,
            args,
            kwargs,
            argnums=argnums,
            has_aux=has_aux,
            strategy=self.strategy,
            default_strategy=self.default_strategy,
            tolerance_context=self.tolerance_context,
        )
