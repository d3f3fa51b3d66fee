"""How a reference is computed: ``compute_reference`` and the checks of what it is given.

It validates fn and its arguments (argnums, a module's parameters chosen with ``params=``),
names each gradient after fn's signature, finds the compute dtype, runs the strategy
(differentiation.py), under crosscheck both strategies and their disagreement per item (the
aux's leaves among them), with ``golden=`` the golden (golden.py), and with ``rounded=True``
the rounded reference (rounding.py).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Union

from pytest_gradref.auxiliary import leaf_tensor, pair_aux
from pytest_gradref.compare import difference, dtype_name, epsilon, is_inexact
from pytest_gradref.differentiation import STRATEGY_FUNCTIONS, Problem, describe
from pytest_gradref.golden import (
    Golden,
    check_golden_dtype,
    check_golden_obtained,
    golden_problem,
    obtained_dtype,
    value_condition,
)
from pytest_gradref.policy import CheckPolicy, ComputeDtype
from pytest_gradref.recording import Disagreement
from pytest_gradref.reference import Reference
from pytest_gradref.strategies import STRATEGIES, STRATEGY_CHOICES, Strategy, StrategyChoice

if TYPE_CHECKING:
    import torch

    from pytest_gradref.rounding import Rounded

Argnums = Union[int, Sequence[int]]
# Which of a module's parameters a reference differentiates and checks: names, or a predicate
# of (name, parameter); None: those that require grad.
ParamSelection = Union[str, Sequence[str], Callable[[str, "torch.nn.Parameter"], bool], None]


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
    params: ParamSelection = None,
    rounded: bool = False,
    default_golden: torch.dtype | None = None,
) -> Reference:
    """fn's value and gradients by ``strategy``; differentiation.py states the guarantees.

    Under ``crosscheck`` both strategies run, ``default_strategy``'s result is returned and
    the disagreement per item is recorded on ``Reference.crosscheck``. With ``golden`` the
    primary strategy also runs on inputs upcast to that dtype (on ``golden_device`` when
    given, else where the inputs are); a golden that fn returns less precise than that is
    warned of (GoldenPrecisionWarning). ``params`` chooses a module's parameters
    differentiated and checked (names, or a predicate of name and parameter); by default
    those that require grad. ``rounded=True`` (which needs ``golden``) also runs the primary
    strategy with every floating-point result rounded to the compute dtype, for budgets that
    count from the larger of the two references' errors. ``default_golden`` is the golden
    computed where none is asked for and the compute dtype is less precise (the default
    verdict's float64): a reference of float64 inputs gets none.
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
        check_golden_dtype(golden, args)
    selected: dict[str, torch.Tensor] = {}
    frozen: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    if isinstance(fn, torch.nn.Module):
        selected, frozen = _select_params(fn, params)
        buffers = {name: buffer.detach() for name, buffer in fn.named_buffers()}
    elif params is not None:
        raise TypeError(
            f"params= chooses an nn.Module's parameters, and {describe(fn)} is not a module"
        )
    problem = Problem(fn, args, dict(kwargs), positions, has_aux, selected, frozen, buffers)
    signature_source = fn.forward if isinstance(fn, torch.nn.Module) else fn
    labels = _argument_labels(signature_source, len(args), positions)
    compute = _compute_dtype(
        signature_source, args, kwargs, fn if isinstance(fn, torch.nn.Module) else None
    )
    automatic = (
        golden is None
        and default_golden is not None
        and compute is not None
        and compute.dtype.is_floating_point
        and epsilon(compute.dtype) > epsilon(default_golden)
    )
    if automatic:
        golden = default_golden
    _check_rounded(rounded, golden)

    primary: Strategy = default_strategy if strategy == "crosscheck" else strategy
    result = STRATEGY_FUNCTIONS[primary](problem)
    crosscheck = None
    if strategy == "crosscheck":
        other_strategy = next(s for s in STRATEGIES if s != primary)
        other = STRATEGY_FUNCTIONS[other_strategy](problem)
        pairs = [("value", result.value, other.value)]
        pairs += zip(labels, result.arg_grads, other.arg_grads)
        pairs += [
            (f"gradient of parameter {name!r}", grad, other.param_grads[name])
            for name, grad in result.param_grads.items()
        ]
        crosscheck = tuple(
            _disagreement(*pair, policy, compute, primary, other_strategy) for pair in pairs
        ) + _aux_disagreements(result.aux, other.aux, policy, compute, primary, other_strategy)
    if policy.recording is not None:
        policy.recording.add_reference(primary, crosscheck or ())

    golden_result = None
    if golden is not None:
        upcast = golden_problem(problem, golden, golden_device)
        computed = STRATEGY_FUNCTIONS[primary](upcast)
        obtained = obtained_dtype(computed.value, computed.aux)
        # A golden asked for is warned of when fn returns it less precise; the default
        # verdict's only where it is no more precise than the reference (a .float() inside
        # still gives a bf16 reference a float32 golden worth judging by).
        assert compute is not None or not automatic
        if not automatic or (compute and epsilon(obtained) >= epsilon(compute.dtype)):
            check_golden_obtained(fn, golden, obtained, policy)
        golden_result = Golden(
            dtype=golden,
            device=computed.value.device,
            value=computed.value,
            arg_grads=computed.arg_grads,
            param_grads=computed.param_grads,
            aux=computed.aux,
            obtained=obtained,
            value_condition=value_condition(
                upcast, computed.value, computed.arg_grads, computed.param_grads
            ),
        )

    rounded_result = None
    if rounded:
        rounded_result = _rounded_reference(problem, primary, compute)

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
        compute=compute,
        rounded=rounded_result,
    )


def _check_rounded(rounded: object, golden: torch.dtype | None) -> None:
    """``rounded`` is a bool, and True only beside a golden: it only widens a budget."""
    __tracebackhide__ = True
    if not isinstance(rounded, bool):
        raise TypeError(f"rounded must be True or False, got {rounded!r}")
    if rounded and golden is None:
        raise ValueError(
            "rounded=True needs a golden reference: the rounded reference only widens an "
            "error budget, which is measured against a golden. Add golden=torch.float64 "
            "(here or in @pytest.mark.gradref) and check with a budget, e.g. "
            "@pytest.mark.gradref(golden=torch.float64, budget=2, rounded=True)"
        )


def _rounded_reference(
    problem: Problem, strategy: Strategy, compute: ComputeDtype | None
) -> Rounded:
    """fn's value and gradients by ``strategy`` with every floating-point result rounded to the
    compute dtype: what the same computation gives carried out in that dtype at every step."""
    __tracebackhide__ = True
    from pytest_gradref.rounding import Rounded, RoundToDtype

    if compute is None or not compute.dtype.is_floating_point:
        given = "no floating tensor" if compute is None else f"{compute.source}, {compute.dtype}"
        raise ValueError(
            "rounded=True rounds every result to the compute dtype, a floating dtype: that of "
            f"the least precise input; {describe(problem.fn)} was given {given}"
        )
    dtype = compute.dtype
    # torch.func.grad_and_value runs under the mode too (torch 2.6 and later): both
    # strategies round the same operations.
    computed = STRATEGY_FUNCTIONS[strategy](replace(problem, mode=lambda: RoundToDtype(dtype)))
    return Rounded(
        dtype=dtype,
        value=computed.value,
        arg_grads=computed.arg_grads,
        param_grads=computed.param_grads,
        aux=computed.aux,
    )


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
            f"argnums=() asks for no gradients; name at least one tensor argument of {describe(fn)}"
        )
    count = len(args)
    normalized: list[int] = []
    for index in raw:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"argnums entries must be ints, got {index!r}")
        if not -count <= index < count:
            raise ValueError(
                f"argnums={index} is out of range: {describe(fn)} was given {count} "
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


def _select_params(
    module: torch.nn.Module, params: ParamSelection
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The module's parameters split into those differentiated and checked, and the others."""
    __tracebackhide__ = True
    named = dict(module.named_parameters())
    if params is None:
        chosen = {name for name, p in named.items() if p.requires_grad}
    elif callable(params):
        chosen = {name for name, p in named.items() if params(name, p)}
    else:
        names = [params] if isinstance(params, str) else list(params)
        unknown = [name for name in names if name not in named]
        if unknown or not all(isinstance(name, str) for name in names):
            raise ValueError(
                f"params= names {', '.join(map(repr, unknown or names))}, not parameters of "
                f"{describe(module)}; its parameters are {', '.join(named) or 'none'}"
            )
        chosen = set(names)
    selected: dict[str, torch.Tensor] = {n: p for n, p in named.items() if n in chosen}
    others = {name: p.detach() for name, p in named.items() if name not in chosen}
    return selected, others


def _compute_dtype(
    signature_source: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    module: torch.nn.Module | None,
) -> ComputeDtype | None:
    """The least precise floating dtype among the inputs that produce the result: every tensor
    argument, differentiated or not (a bf16 teacher rounds the loss as a bf16 student does),
    tensors nested in an argument's lists, tuples and dicts, tensor keyword arguments, and the
    module's parameters (checked or not: a frozen bf16 reference model rounds the loss too)."""
    import torch
    from torch.utils._pytree import tree_leaves

    def tensors(value: Any) -> list[torch.Tensor]:
        return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]

    nested = {i: tensors(arg) for i, arg in enumerate(args)}
    positions = tuple(i for i, found in nested.items() if found)
    labels = _argument_labels(signature_source, len(args), positions)
    candidates = [
        (label.removeprefix("gradient of "), tensor)
        for label, i in zip(labels, positions)
        for tensor in nested[i]
    ]
    candidates += [
        (f"keyword argument {name!r}", tensor)
        for name, value in kwargs.items()
        for tensor in tensors(value)
    ]
    if module is not None:
        candidates += [(f"parameter {n!r}", p) for n, p in module.named_parameters()]
    least: ComputeDtype | None = None
    for source, tensor in candidates:
        dtype = tensor.dtype
        if is_inexact(dtype) and (least is None or epsilon(dtype) > epsilon(least.dtype)):
            least = ComputeDtype(dtype, source)
    return least


def _disagreement(
    label: str,
    a: torch.Tensor,
    b: torch.Tensor,
    policy: CheckPolicy,
    compute: ComputeDtype | None,
    received: Strategy,
    checked_against: Strategy,
) -> Disagreement:
    """How far ``a`` (received) and ``b`` (checked against) differ, as assert_close measures
    a difference (equal infinities differ by 0), judged by the tolerance assert_close gives
    the item."""
    import torch

    diff, magnitude = difference(a, b)
    dtype, why = compute.tolerance_dtype(a.dtype) if compute is not None else (a.dtype, "")
    resolved = policy.tolerance(dtype, why_dtype=why)
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


def _aux_disagreements(
    received_aux: Any,
    other_aux: Any,
    policy: CheckPolicy,
    compute: ComputeDtype | None,
    received: Strategy,
    checked_against: Strategy,
) -> tuple[Disagreement, ...]:
    """The aux's leaves under the two strategies, labelled as assert_close labels them: tensors
    and numbers measured as the other items are; other values, and places where the two
    differ in structure or shape, agree only when equal (no measure: NaN). No aux under
    either (has_aux=False) has no items."""
    if received_aux is None and other_aux is None:
        return ()
    found = []
    for leaf in pair_aux(other_aux, received_aux, None):
        a = leaf_tensor(leaf.expected, None)  # the received strategy's
        b = leaf_tensor(leaf.actual, None if a is None else a.device)
        if leaf.problem is None and a is not None and b is not None and a.shape == b.shape:
            found.append(
                _disagreement(leaf.label, a, b, policy, compute, received, checked_against)
            )
            continue
        if leaf.problem is not None:
            dtype, agree = "-", False
            criterion = f"the same structure ({leaf.problem}; the actual: {checked_against}'s aux)"
        elif a is not None and b is not None:
            shapes = f"{tuple(a.shape)} received, {tuple(b.shape)} checked against"
            dtype, agree, criterion = dtype_name(a.dtype), False, f"the same shape ({shapes})"
        else:
            dtype, criterion = type(leaf.expected).__name__, "equality"
            agree = type(leaf.actual) is type(leaf.expected) and bool(leaf.actual == leaf.expected)
        measure = 0.0 if agree else math.nan
        found.append(
            Disagreement(
                leaf.label, dtype, measure, measure, not agree, criterion, received, checked_against
            )
        )
    return tuple(found)
