"""Reference values and gradients, by autograd or by torch.func.grad_and_value.

``compute_reference`` never mutates the caller's tensors or modules: it differentiates
detached aliases (no ``.grad`` written, ``requires_grad`` untouched) and runs modules through
``torch.func.functional_call`` with detached parameters and cloned buffers.

An input that does not influence the loss gets a zero gradient under both strategies: that is
its true gradient, and it is what grad_and_value returns, so the two strategies agree.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from pytest_gradref.compare import (
    BudgetItem,
    Item,
    ItemCheck,
    ResolvedTolerance,
    Tolerance,
    ToleranceItem,
    ToleranceOverride,
    check_items,
    difference,
    dtype_name,
    epsilon,
    format_failures,
    less_precise,
    resolve_tolerance,
)
from pytest_gradref.numbers import check_number
from pytest_gradref.strategies import STRATEGIES, STRATEGY_CHOICES, Strategy, StrategyChoice

if TYPE_CHECKING:
    import torch

Argnums = Union[int, Sequence[int]]
ActualGrads = Union["torch.Tensor", Sequence[Union["torch.Tensor", None]], None]
ActualParamGrads = Union[Mapping[str, Union["torch.Tensor", None]], "torch.nn.Module", None]


@dataclass(frozen=True)
class Disagreement:
    """How far autograd and grad_and_value differ on one item (crosscheck).

    ``received`` is the strategy whose result the test received (the backend's default) and
    ``checked_against`` the other one, computed only to compare. ``exceeds_tolerance`` says
    whether the two differ by more than the item's tolerance, i.e. whether the choice of
    strategy alone could fail a test.
    """

    label: str
    dtype: str
    max_abs: float
    max_rel: float
    exceeds_tolerance: bool
    tolerance: str
    received: Strategy
    checked_against: Strategy


@dataclass
class Recording:
    """What one test's references checked, collected for the report.

    A Hypothesis test runs its body once per example; the record keeps one example, the one
    with the least headroom (a failing one when the test failed), not every example's items.
    Between examples the lists hold the worst example so far; during one, that example's own.
    """

    checks: list[ItemCheck] = field(default_factory=list)
    disagreements: list[Disagreement] = field(default_factory=list)
    # The strategy whose result each reference handed the test (never "crosscheck").
    strategies: list[str] = field(default_factory=list)
    # The worst finished example while another one runs; None outside an example.
    _kept: tuple[list[ItemCheck], list[Disagreement], list[str]] | None = None

    def add_checks(self, checks: Sequence[ItemCheck]) -> None:
        self._enter_example()
        self.checks.extend(checks)

    def add_reference(self, strategy: str, disagreements: Sequence[Disagreement]) -> None:
        self._enter_example()
        self.strategies.append(strategy)
        self.disagreements.extend(disagreements)

    def _enter_example(self) -> None:
        from pytest_gradref.examples import call_at_example_end

        if self._kept is None and call_at_example_end(self._leave_example):
            self._kept = (self.checks, self.disagreements, self.strategies)
            self.checks, self.disagreements, self.strategies = [], [], []

    def _leave_example(self) -> None:
        kept, self._kept = self._kept, None
        if kept is not None and kept[0] and _tightness(kept[0]) < _tightness(self.checks):
            self.checks, self.disagreements, self.strategies = kept


def _tightness(checks: Sequence[ItemCheck]) -> float:
    """The least headroom of an example's items: lower is closer to failing. An item without
    statistics counts as -inf when it failed, +inf when it passed."""
    least = math.inf
    for check in checks:
        headroom = check.headroom
        if math.isnan(headroom):
            headroom = math.inf if check.passed else -math.inf
        least = min(least, headroom)
    return least


@dataclass(frozen=True)
class CheckPolicy:
    """What comparisons depend on besides the dtype: backend table, overrides, budget."""

    backend: str
    table: Mapping[str, Tolerance] = field(default_factory=dict)
    overrides: tuple[ToleranceOverride, ...] = ()
    budget: float | None = None
    recording: Recording | None = None
    # Whether assert_close computes each item's statistics (for the report and the summary)
    # besides its verdict.
    statistics: bool = True

    def tolerance(
        self, dtype: torch.dtype, extra: tuple[ToleranceOverride, ...] = ()
    ) -> ResolvedTolerance:
        return resolve_tolerance(dtype, self.backend, self.table, (*extra, *self.overrides))


@dataclass(frozen=True)
class Golden:
    """The same reference computed in a higher precision."""

    dtype: torch.dtype
    device: torch.device
    value: torch.Tensor
    arg_grads: tuple[torch.Tensor, ...]
    param_grads: Mapping[str, torch.Tensor]


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
        golden: the same computed in a higher precision, when ``golden=`` was asked for.
    """

    value: torch.Tensor
    grads: torch.Tensor | tuple[torch.Tensor, ...]
    param_grads: Mapping[str, torch.Tensor]
    aux: Any
    strategy: Strategy
    backend: str
    crosscheck: tuple[Disagreement, ...] | None
    golden: Golden | None
    grad_labels: tuple[str, ...]
    policy: CheckPolicy

    def assert_close(
        self,
        actual_value: torch.Tensor,
        actual_grads: ActualGrads = None,
        *,
        param_grads: ActualParamGrads = None,
        rtol: float | None = None,
        atol: float | None = None,
        budget: float | None = None,
    ) -> None:
        """Assert that a kernel's value and gradients match this reference.

        By default each item is compared with the tolerance of its backend and dtype (the
        less precise of the actual's and the reference's), unless a ``gradref`` marker or
        ``rtol``/``atol`` here override it. With ``budget=k`` (or a marker's budget) and a
        golden reference, each item instead passes when its error against the golden is at
        most k times the same-dtype reference's own error, plus a floor (see compare.py).
        Every item is checked before failing, and the message names each one that differs.

        Raises:
            AssertionError: an item differs beyond its tolerance or budget.
            TypeError, ValueError: the arguments do not line up with the reference.
        """
        # pytest then ends a failure's traceback at the test's line, as torch.testing does;
        # the helpers below hide their frames too (--full-trace shows them).
        __tracebackhide__ = True
        if budget is not None and (rtol is not None or atol is not None):
            raise ValueError("assert_close() takes either budget= or rtol=/atol=, not both")
        if budget is None and rtol is None and atol is None:
            budget = self.policy.budget
        if budget is not None:
            check_number(budget, "budget", minimum=0, inclusive=False)
            if self.golden is None:
                raise ValueError(
                    f"assert_close(budget={budget:g}) needs a golden reference: call "
                    "grad_reference(..., golden=torch.float64) or mark the test "
                    "@pytest.mark.gradref(golden=torch.float64)"
                )
        extra: tuple[ToleranceOverride, ...] = ()
        if rtol is not None or atol is not None:
            extra = (ToleranceOverride(rtol, atol, "the assert_close() arguments"),)
        items: list[Item] = []
        for label, actual, expected, golden in self._pair_items(
            actual_value, actual_grads, param_grads
        ):
            if budget is not None:
                items.append(BudgetItem(label, actual, expected, golden, budget))
                continue
            dtype = expected.dtype if actual is None else less_precise(actual.dtype, expected.dtype)
            resolved = self.policy.tolerance(dtype, extra)
            items.append(ToleranceItem(label, actual, expected, resolved))
        checks = check_items(items, statistics=self.policy.statistics)  # one host read
        if self.policy.recording is not None:
            self.policy.recording.add_checks(checks)
        if not all(check.passed for check in checks):
            # The device index too: under xdist each worker has its own (npu:0, npu:1).
            header = (
                f"Reference mismatch on {self.value.device} ({self.backend} backend, "
                f"{self.strategy} reference)"
            )
            raise AssertionError(format_failures(header, checks))

    def _pair_items(
        self,
        actual_value: torch.Tensor,
        actual_grads: ActualGrads,
        param_grads: ActualParamGrads,
    ) -> list[tuple[str, torch.Tensor | None, torch.Tensor, Any]]:
        """(label, actual, reference, golden or None) for every item, validated."""
        __tracebackhide__ = True
        import torch

        golden = self.golden
        expected_grads = self.grads if isinstance(self.grads, tuple) else (self.grads,)
        items: list[tuple[str, torch.Tensor | None, torch.Tensor, Any]] = [
            ("value", actual_value, self.value, golden and golden.value)
        ]
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
            golden_grads = golden.arg_grads if golden else (None,) * len(expected_grads)
            items += zip(self.grad_labels, actual_tuple, expected_grads, golden_grads)
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
                golden_grad = golden.param_grads[name] if golden else None
                label = f"gradient of parameter {name!r}"
                items.append((label, param_grads[name], expected, golden_grad))
        return items


# --- computing -------------------------------------------------------------------------------


def _describe(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def normalize_argnums(
    fn: Callable[..., Any], args: Sequence[Any], argnums: Argnums, *, is_module: bool
) -> tuple[int, ...]:
    """Validated, non-negative argnums; raises a TypeError/ValueError that names the fault."""
    __tracebackhide__ = True
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
                + (
                    " (argnums=() asks for the module's parameter gradients alone)"
                    if is_module
                    else ""
                )
            )
        normalized.append(position)
    return tuple(normalized)


def _argument_labels(fn: Callable[..., Any], count: int, argnums: tuple[int, ...]) -> list[str]:
    """'gradient of argument 1 (weight)', naming parameters where the signature allows."""
    names: list[str | None] = [None] * count
    positional = _positional_names(fn)
    for i in range(min(count, len(positional))):
        names[i] = positional[i]
    labels = []
    for i in argnums:
        suffix = f" ({names[i]})" if names[i] else ""
        labels.append(f"gradient of argument {i}{suffix}")
    return labels


def _positional_names(fn: Callable[..., Any]) -> list[str]:
    """The names of fn's positional parameters (empty where it has no signature)."""
    if (
        inspect.isfunction(fn)
        and not hasattr(fn, "__wrapped__")
        and not hasattr(fn, "__signature__")
    ):
        # A plain function's are its code's first arguments: what inspect.signature reports,
        # at a fraction of its cost, which counts once per test.
        code = fn.__code__
        return list(code.co_varnames[: code.co_argcount])
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [
        p.name
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


@dataclass
class _Problem:
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
            import torch

            state = {**self.frozen, **buffers, **diff_params}
            return torch.func.functional_call(self.fn, state, tuple(full), self.kwargs)  # type: ignore[arg-type]
        return self.fn(*full, **self.kwargs)

    def split(self, out: Any) -> tuple[torch.Tensor, Any]:
        __tracebackhide__ = True
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
    __tracebackhide__ = True
    import torch
    from torch.utils._pytree import tree_map

    leaves = [problem.args[i].detach().requires_grad_(True) for i in problem.argnums]
    params = {n: p.detach().requires_grad_(True) for n, p in problem.params.items()}
    inputs = [*leaves, *params.values()]
    with torch.enable_grad():
        loss, aux = problem.split(problem.call(leaves, params, problem.fresh_buffers()))
        found: Sequence[torch.Tensor | None] = [None] * len(inputs)
        if loss.requires_grad and inputs:  # else nothing differentiable reached the loss
            found = torch.autograd.grad(loss, inputs, allow_unused=True)
    grads = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, found)]
    # aux comes back detached, as torch.func returns it.
    aux = tree_map(lambda leaf: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf, aux)
    return _Result(
        value=loss.detach(),
        aux=aux,
        arg_grads=tuple(grads[: len(leaves)]),
        param_grads=dict(zip(params, grads[len(leaves) :])),
    )


def _by_grad_and_value(problem: _Problem) -> _Result:
    __tracebackhide__ = True
    import torch
    from torch.utils._pytree import tree_flatten, tree_unflatten

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
    try:
        (arg_grads, param_grads), (value, aux_tensors) = transform(
            diff_args, diff_params, problem.fresh_buffers()
        )
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
    tensors = iter(aux_tensors)
    leaves = [
        next(tensors) if isinstance(leaf, torch.Tensor) else leaf for leaf in aux_parts["leaves"]
    ]
    return _Result(
        value=value.detach(),
        aux=tree_unflatten(leaves, aux_parts["spec"]),
        arg_grads=tuple(arg_grads),
        param_grads=dict(param_grads),
    )


_STRATEGY_FUNCTIONS: dict[Strategy, Callable[[_Problem], _Result]] = {
    "autograd": _by_autograd,
    "grad_and_value": _by_grad_and_value,
}


def _disagreement(
    label: str,
    a: torch.Tensor,
    b: torch.Tensor,
    policy: CheckPolicy,
    received: Strategy,
    checked_against: Strategy,
) -> Disagreement:
    """How far ``a`` (received) and ``b`` (checked against) differ, as assert_close measures
    a difference (equal infinities differ by 0)."""
    import torch

    diff, magnitude = difference(a, b)
    resolved = policy.tolerance(a.dtype)
    tol = resolved.tolerance
    if diff.numel() == 0:
        return Disagreement(
            label, dtype_name(a.dtype), 0.0, 0.0, False, resolved.source, received, checked_against
        )
    relative = torch.where(diff == 0, 0.0, diff / magnitude)
    exceeds = not bool(torch.isclose(a.double(), b.double(), rtol=tol.rtol, atol=tol.atol).all())
    criterion = f"rtol={tol.rtol:g}, atol={tol.atol:g} from {resolved.source}"
    return Disagreement(
        label,
        dtype_name(a.dtype),
        float(diff.max()),
        float(relative.max()),
        exceeds,
        criterion,
        received,
        checked_against,
    )


def _upcast(value: Any, dtype: torch.dtype, device: torch.device | None) -> Any:
    """value with floating tensors cast to dtype (and every tensor moved to device)."""
    import torch

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


def _golden_problem(problem: _Problem, dtype: torch.dtype, device: torch.device | None) -> _Problem:
    def cast(value: Any) -> Any:
        return _upcast(value, dtype, device)

    return _Problem(
        fn=problem.fn,
        args=cast(problem.args),
        kwargs=cast(problem.kwargs),
        argnums=problem.argnums,
        has_aux=problem.has_aux,
        params=cast(problem.params),
        frozen=cast(problem.frozen),
        buffers=cast(problem.buffers),
    )


def _check_golden_dtype(golden: Any, args: Sequence[Any]) -> None:
    __tracebackhide__ = True
    import torch

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


def compute_reference(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    argnums: Argnums,
    has_aux: bool,
    strategy: StrategyChoice,
    default_strategy: Strategy,
    policy: CheckPolicy,
    golden: torch.dtype | None = None,
    golden_device: torch.device | None = None,
) -> Reference:
    """fn's value and gradients by ``strategy``; see the module docstring for guarantees.

    Under ``crosscheck`` both strategies run, ``default_strategy``'s result is returned and
    the disagreement per item is recorded on ``Reference.crosscheck``. With ``golden`` the
    primary strategy also runs on inputs upcast to that dtype (on ``golden_device`` when
    given, else where the inputs are).
    """
    __tracebackhide__ = True
    import torch

    if strategy not in STRATEGY_CHOICES:
        raise ValueError(f"strategy must be one of {STRATEGY_CHOICES}, got {strategy!r}")
    if not callable(fn):
        raise TypeError(f"grad_reference needs a callable or nn.Module first, got {fn!r}")
    is_module = isinstance(fn, torch.nn.Module)
    args = tuple(args)
    positions = normalize_argnums(fn, args, argnums, is_module=is_module)
    if golden is not None:
        _check_golden_dtype(golden, args)
    params: dict[str, torch.Tensor] = {}
    frozen: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    if isinstance(fn, torch.nn.Module):
        for name, param in fn.named_parameters():
            if param.requires_grad:
                params[name] = param
            else:
                frozen[name] = param.detach()
        buffers = {name: buffer.detach() for name, buffer in fn.named_buffers()}
    problem = _Problem(fn, args, dict(kwargs), positions, has_aux, params, frozen, buffers)
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
        crosscheck = tuple(_disagreement(*pair, policy, primary, other_strategy) for pair in pairs)
    if policy.recording is not None:
        policy.recording.add_reference(primary, crosscheck or ())

    golden_result = None
    if golden is not None:
        upcast = _golden_problem(problem, golden, golden_device)
        computed = _STRATEGY_FUNCTIONS[primary](upcast)
        golden_result = Golden(
            dtype=golden,
            device=computed.value.device,
            value=computed.value,
            arg_grads=computed.arg_grads,
            param_grads=computed.param_grads,
        )

    grads: torch.Tensor | tuple[torch.Tensor, ...] = result.arg_grads
    if isinstance(argnums, int):
        grads = result.arg_grads[0]
    return Reference(
        value=result.value,
        grads=grads,
        param_grads=result.param_grads,
        aux=result.aux,
        strategy=primary,
        backend=policy.backend,
        crosscheck=crosscheck,
        golden=golden_result,
        grad_labels=tuple(labels),
        policy=policy,
    )


@dataclass(frozen=True)
class GradReference:
    """The ``grad_reference`` fixture: computes references under the test's policy.

    ``golden`` is the test's default golden dtype (from its marker); ``golden_on_cpu`` names
    the dtypes the backend cannot compute on its device, whose goldens go to the CPU.
    """

    strategy: StrategyChoice
    default_strategy: Strategy
    policy: CheckPolicy
    golden: torch.dtype | None = None
    golden_on_cpu: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        # Short: pytest and Hypothesis print a test's arguments (a falsifying example, a
        # failing test's locals), and the policy's tables and recording run to dozens of lines.
        fields = f"backend={self.policy.backend!r}, strategy={self.strategy!r}"
        if self.golden is not None:
            fields += f", golden={self.golden}"
        return f"GradReference({fields})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # IPython's pretty-printing protocol, which Hypothesis' falsifying-example printer
        # follows; without it that printer lists a dataclass's fields instead of its repr.
        printer.text(repr(self))

    def __call__(
        self,
        fn: Callable[..., Any],
        /,
        *args: Any,
        argnums: Argnums = 0,
        has_aux: bool = False,
        golden: torch.dtype | None = None,
        **kwargs: Any,
    ) -> Reference:
        """fn(*args, **kwargs)'s value and its gradients w.r.t. ``args[argnums]``.

        fn may be an nn.Module: then gradients w.r.t. its parameters that require grad come
        too, in ``Reference.param_grads``, and ``argnums=()`` asks for those alone. With
        ``golden=torch.float64`` the reference is also computed in that dtype, for
        ``Reference.assert_close(..., budget=k)``.
        """
        __tracebackhide__ = True
        import torch

        golden = golden if golden is not None else self.golden
        golden_device = None
        if golden is not None and dtype_name(golden) in self.golden_on_cpu:
            golden_device = torch.device("cpu")
        return compute_reference(
            fn,
            args,
            kwargs,
            argnums=argnums,
            has_aux=has_aux,
            strategy=self.strategy,
            default_strategy=self.default_strategy,
            policy=self.policy,
            golden=golden,
            golden_device=golden_device,
        )
