"""How a reference is computed: ``compute_reference`` and the checks of what it is given.

It validates fn and its arguments (argnums, a module's parameters chosen with ``params=``),
names each gradient after fn's signature, finds the compute dtype, runs the strategy
(differentiation.py), under crosscheck both strategies and their disagreement per item (the
aux's leaves among them, made items by auxiliary.aux_items), judged by verdict.judge.check_items
as assert_close judges an item, with ``golden=`` the golden (golden.py), and with
``rounded=True`` the rounded reference (rounding.py).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Union

import torch
from torch.utils._pytree import tree_leaves

from pytest_gradref.config.strategies import STRATEGIES, STRATEGY_CHOICES, Strategy, StrategyChoice
from pytest_gradref.config.tolerances import CheckPolicy, dtype_name
from pytest_gradref.reference.auxiliary import AuxLeaf, AuxValue, aux_items, pair_aux
from pytest_gradref.reference.differentiation import (
    STRATEGY_FUNCTIONS,
    Outputs,
    Problem,
    Result,
    describe,
    value_items,
)
from pytest_gradref.reference.golden import (
    Golden,
    check_golden_dtype,
    check_golden_obtained,
    compute_golden,
    golden_problem,
    obtained_dtype,
    value_condition,
)
from pytest_gradref.reference.recording import Disagreement, Recording
from pytest_gradref.reference.result import GradientArgument, Reference, parameter_label
from pytest_gradref.reference.spread import Spread
from pytest_gradref.verdict.checks import ItemCheck
from pytest_gradref.verdict.criterion import golden_for
from pytest_gradref.verdict.dtypes import ComputeDtype, epsilon, is_inexact
from pytest_gradref.verdict.judge import check_items
from pytest_gradref.verdict.tolerance_item import ToleranceItem
from pytest_gradref.warning_types import user_stacklevel

if TYPE_CHECKING:
    from pytest_gradref.reference.rounding import Rounded

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
    recording: Recording | None = None,
    golden: torch.dtype | None = None,
    golden_device: torch.device | None = None,
    params: ParamSelection = None,
    rounded: bool = False,
    default_golden: torch.dtype | None = None,
    cotangent: Outputs | None = None,
    kernel: bool = False,
) -> Reference:
    """fn's value and gradients by ``strategy``; differentiation.py states the guarantees.

    Under ``crosscheck`` both strategies run, ``default_strategy``'s result is returned and
    the disagreement per item is on ``Reference.crosscheck``; ``recording`` (where given)
    records the reference and that disagreement for the report. With ``golden`` the
    primary strategy also runs on inputs upcast to that dtype (on ``golden_device`` when
    given, else where the inputs are); a golden that fn returns less precise than that is
    warned of (GoldenPrecisionWarning). ``params`` chooses a module's parameters
    differentiated and checked (names, or a predicate of name and parameter); by default
    those that require grad. ``rounded=True`` (which needs ``golden``) also runs the primary
    strategy with every floating-point result rounded to the compute dtype, for budgets that
    count from the larger of the two references' errors. Where no golden is asked for, the
    policy's default verdict chooses (verdict/criterion.py): its golden where the compute
    dtype is less precise, none for a reference of float64 inputs or a ``kernel`` (a reference
    that is itself a kernel, GradReference.kernel). ``default_golden`` is deprecated: it sets
    the policy's ``default_golden``, which is where the default verdict now lives.

    fn returns a scalar loss, or a tensor output, whose gradients are then the
    vector-Jacobian product with ``cotangent`` (by default a seeded standard normal draw of
    the output's shape and dtype, ``Reference.cotangent``, for the kernel's own backward).
    ``argnums=()`` on a function computes fn's value and aux alone (a value-only reference).
    """
    __tracebackhide__ = True
    if default_golden is not None:
        warnings.warn(
            "compute_reference(default_golden=...) is deprecated and will be removed in the "
            "next release: set it on the policy, "
            "CheckPolicy(default_golden=..., default_budget=...)",
            DeprecationWarning,
            stacklevel=user_stacklevel(),
        )
        policy = policy.with_default_golden(default_golden)
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
    if cotangent is not None and not isinstance(cotangent, (torch.Tensor, tuple)):
        raise TypeError(
            f"cotangent must be a tensor (a tuple of them for several outputs), got "
            f"{type(cotangent).__name__}"
        )
    problem = Problem(
        fn,
        args,
        dict(kwargs),
        positions,
        has_aux,
        selected,
        frozen,
        buffers,
        cotangent=cotangent,
        cotangent_given=cotangent is not None,
    )
    if cotangent is not None and not problem.differentiates:
        raise ValueError(
            "cotangent= is for gradients, and this reference computes none (argnums=() on a "
            "function): drop cotangent=, or name the inputs to differentiate in argnums"
        )
    signature_source = fn.forward if isinstance(fn, torch.nn.Module) else fn
    arguments = _gradient_arguments(signature_source, len(args), positions)
    compute = _compute_dtype(
        signature_source, args, kwargs, fn if isinstance(fn, torch.nn.Module) else None
    )
    golden = golden_for(
        policy, golden, compute.dtype if compute is not None else None, kernel=kernel
    )
    _check_rounded(rounded, golden)

    primary: Strategy = default_strategy if strategy == "crosscheck" else strategy
    result = STRATEGY_FUNCTIONS[primary](problem)
    # Every later run (the other strategy, the golden, the spread, the rounded reference)
    # takes the same cotangent as the first.
    problem = replace(problem, cotangent=result.cotangent, cotangent_given=False)
    crosscheck = None
    if strategy == "crosscheck":
        other_strategy = next(s for s in STRATEGIES if s != primary)
        other = STRATEGY_FUNCTIONS[other_strategy](problem)
        labels = [argument.label for argument in arguments]
        crosscheck = _crosscheck(result, other, labels, policy, compute, primary, other_strategy)
    if recording is not None:
        recording.add_reference(primary, crosscheck or ())

    golden_result = None
    if golden is not None:
        upcast = golden_problem(problem, golden, golden_device)
        computed, upcast = compute_golden(STRATEGY_FUNCTIONS[primary], upcast, golden)
        obtained = obtained_dtype(computed.value, computed.aux)
        check_golden_obtained(fn, golden, obtained, recording)
        golden_result = Golden(
            dtype=golden,
            device=value_items(computed.value)[0][1].device,
            value=computed.value,
            arg_grads=computed.arg_grads,
            param_grads=computed.param_grads,
            aux=computed.aux,
            obtained=obtained,
            value_condition=None
            if problem.cotangent is not None
            else value_condition(upcast, computed.value, computed.arg_grads, computed.param_grads),
            spread=Spread(
                problem,
                STRATEGY_FUNCTIONS[primary],
                compute.dtype if rounded and compute is not None else None,
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
        grad_arguments=arguments,
        grad_labels=tuple(argument.label for argument in arguments),
        policy=policy,
        compute=compute,
        rounded=rounded_result,
        recording=recording,
        cotangent=result.cotangent,
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
    from pytest_gradref.reference.rounding import Rounded, RoundToDtype

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
    if isinstance(argnums, bool) or not isinstance(argnums, (int, tuple, list)):
        raise TypeError(f"argnums must be an int or a tuple of ints, got {argnums!r}")
    raw = (argnums,) if isinstance(argnums, int) else tuple(argnums)
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


def _gradient_arguments(
    fn: Callable[..., Any], count: int, argnums: tuple[int, ...]
) -> tuple[GradientArgument, ...]:
    """Each differentiated argument, named where the signature allows."""
    names: list[str | None] = [None] * count
    positional = _positional_names(fn)
    for i in range(min(count, len(positional))):
        names[i] = positional[i]
    return tuple(GradientArgument(i, names[i]) for i in argnums)


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

    def tensors(value: Any) -> list[torch.Tensor]:
        return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]

    nested = {i: tensors(arg) for i, arg in enumerate(args)}
    positions = tuple(i for i, found in nested.items() if found)
    arguments = _gradient_arguments(signature_source, len(args), positions)
    candidates = [
        (argument.label.removeprefix("gradient of "), tensor)
        for argument in arguments
        for tensor in nested[argument.position]
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


def _crosscheck(
    result: Result,
    other: Result,
    labels: Sequence[str],
    policy: CheckPolicy,
    compute: ComputeDtype | None,
    received: Strategy,
    checked_against: Strategy,
) -> tuple[Disagreement, ...]:
    """How far the received strategy's result and the other one's differ, item by item (the
    aux's leaves after the value and the gradients, labelled as assert_close labels them),
    each item judged by check_items with the tolerance assert_close gives it, all in one
    host read. The received result is the item's actual, the other one its expected: the
    relative difference is relative to the result checked against. Aux leaves with nothing
    to measure (structures that differ, values that are no tensor or number) agree only
    where equal (no measure: NaN). No aux under either (has_aux=False) has no items."""

    def item(label: str, actual: Any, expected: torch.Tensor) -> ToleranceItem:
        dtype, why = _dtype_of(actual, expected), ""
        if compute is not None:
            dtype, why = compute.tolerance_dtype(dtype)
        tolerance = policy.tolerance(dtype, why_dtype=why)
        missing = f"{checked_against}'s aux holds None here"
        return ToleranceItem(label, actual, expected, tolerance, missing, check_dtype=False)

    found: list[ToleranceItem | AuxValue] = [
        item(label, actual, expected)
        for (label, actual), (_, expected) in zip(
            value_items(result.value), value_items(other.value)
        )
    ]
    found += map(item, labels, result.arg_grads, other.arg_grads)
    found += [
        item(parameter_label(name), grad, other.param_grads[name])
        for name, grad in result.param_grads.items()
    ]
    if result.aux is not None or other.aux is not None:

        def aux_item(
            leaf: AuxLeaf, actual: Any, expected: torch.Tensor, *references: Any
        ) -> ToleranceItem:
            # Paired with the received aux as the reference, whose structure and labels
            # the items follow: ``actual`` is the other strategy's leaf, turned round here
            # where it is a tensor (else the comparison fails it as it stands).
            if isinstance(actual, torch.Tensor):
                return item(leaf.label, expected, actual)
            return item(leaf.label, actual, expected)

        found += aux_items(pair_aux(other.aux, result.aux, None), aux_item)
    items = [entry for entry in found if isinstance(entry, ToleranceItem)]
    checks = iter(check_items(items))  # one host read (more for a failed item's detail)
    return tuple(
        _aux_disagreement(entry, received, checked_against)
        if isinstance(entry, AuxValue)
        else _disagreement(entry, next(checks), received, checked_against)
        for entry in found
    )


def _dtype_of(actual: Any, expected: torch.Tensor) -> torch.dtype:
    """The received result's dtype, which the item's tolerance follows (the expected's where
    the received aux holds no tensor there)."""
    return actual.dtype if isinstance(actual, torch.Tensor) else expected.dtype


def _disagreement(
    item: ToleranceItem, check: ItemCheck, received: Strategy, checked_against: Strategy
) -> Disagreement:
    """A crosschecked item as the report records it: the greatest absolute and relative
    difference, whether it exceeds the item's tolerance (check_items' verdict), and the
    tolerance, or where the two cannot be measured (shapes that differ), what they lack."""
    actual, expected = item.actual, item.expected
    dtype = dtype_name(_dtype_of(actual, expected))
    criterion = check.criterion
    if not isinstance(actual, torch.Tensor):
        criterion = f"a tensor or number on both sides ({check.detail})"
    elif actual.shape != expected.shape:
        shapes = f"{tuple(actual.shape)} received, {tuple(expected.shape)} checked against"
        criterion = f"the same shape ({shapes})"
    return Disagreement(
        item.label,
        dtype,
        check.max_abs,
        check.max_rel,
        not check.passed,
        criterion,
        received,
        checked_against,
    )


def _aux_disagreement(
    value: AuxValue, received: Strategy, checked_against: Strategy
) -> Disagreement:
    """An aux leaf with nothing to measure: the same structure, or equal values."""
    leaf = value.leaf
    if leaf.problem is not None:
        dtype = "-"
        criterion = f"the same structure ({leaf.problem}; the actual: {checked_against}'s aux)"
    else:
        dtype, criterion = type(leaf.expected).__name__, "equality"
    measure = 0.0 if value.passed else math.nan
    return Disagreement(
        leaf.label,
        dtype,
        measure,
        measure,
        not value.passed,
        criterion,
        received,
        checked_against,
    )
