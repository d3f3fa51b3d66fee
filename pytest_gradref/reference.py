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
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from pytest_gradref.auxiliary import AuxKey, pair_aux
from pytest_gradref.compare import (
    MISSING_HINT,
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
    is_inexact,
    less_precise,
    resolve_tolerance,
)
from pytest_gradref.numbers import check_number
from pytest_gradref.strategies import STRATEGIES, STRATEGY_CHOICES, Strategy, StrategyChoice
from pytest_gradref.warning_types import GoldenPrecisionWarning

if TYPE_CHECKING:
    import torch

Argnums = Union[int, Sequence[int]]
ActualGrads = Union["torch.Tensor", Sequence[Union["torch.Tensor", None]], None]
ActualParamGrads = Union[Mapping[str, Union["torch.Tensor", None]], "torch.nn.Module", None]
# Which of a module's parameters a reference differentiates and checks: names, or a predicate
# of (name, parameter); None: those that require grad.
ParamSelection = Union[str, Sequence[str], Callable[[str, "torch.nn.Parameter"], bool], None]


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
    # Per test, not per example: why the test's references were not crosschecked in a
    # crosscheck session (a marker fixed the strategy, a kernel reference), and the golden
    # dtype requested and obtained where fn returned a less precise one.
    crosscheck_opt_out: str | None = None
    golden_shortfall: tuple[str, str] | None = None
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
        compute: the least precise floating dtype among the inputs, which every item's
            tolerance follows (None where no input is floating).
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
    compute: ComputeDtype | None = None

    def assert_close(
        self,
        actual_value: torch.Tensor,
        actual_grads: ActualGrads = None,
        *,
        param_grads: ActualParamGrads = None,
        aux: Any = None,
        aux_tolerances: Mapping[AuxKey, Tolerance] | None = None,
        rtol: float | None = None,
        atol: float | None = None,
        budget: float | None = None,
    ) -> None:
        """Assert that a kernel's value, gradients and aux match this reference.

        By default each item is compared with the tolerance of its backend and dtype: the
        least precise of the actual's, the reference's and the compute dtype (that of the
        least precise input differentiated), unless a ``gradref`` marker or ``rtol``/``atol``
        here override it. With ``budget=k`` (or a marker's budget) and a golden reference,
        each item instead passes when its error against the golden is at most k times the
        same-dtype reference's own error, plus a floor (see compare.py). ``aux`` (the
        kernel's auxiliary output) is compared leaf by leaf with the same rules; an entry of
        ``aux_tolerances``, keyed by a top-level key or index of the aux or by an item's
        label (``"aux['logps'][0]"``), gives those items a tolerance of their own, which
        wins over the marker, the arguments here and a budget. Every item is checked before
        failing, and the message names each one that differs.

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
        items: list[Item] = [
            self._item(label, actual, expected, golden, budget, extra, missing)
            for label, actual, expected, golden, missing in self._pair_items(
                actual_value, actual_grads, param_grads
            )
        ]
        # Aux leaves that cannot be compared as tensors (structure, non-numeric values).
        unpaired: list[ItemCheck] = []
        if aux is not None:
            self._aux_items(aux, aux_tolerances or {}, budget, extra, items, unpaired)
        elif aux_tolerances:
            raise ValueError("assert_close(): aux_tolerances= needs the actual aux, as aux=")
        checks = check_items(items, statistics=self.policy.statistics)  # one host read
        checks += unpaired
        if self.policy.recording is not None:
            self.policy.recording.add_checks(checks)
        if not all(check.passed for check in checks):
            # The device index too: under xdist each worker has its own (npu:0, npu:1).
            header = (
                f"Reference mismatch on {self.value.device} ({self.backend} backend, "
                f"{self.strategy} reference)"
            )
            raise AssertionError(format_failures(header, checks))

    def _item(
        self,
        label: str,
        actual: Any,
        expected: torch.Tensor,
        golden: torch.Tensor | None,
        budget: float | None,
        extra: tuple[ToleranceOverride, ...],
        missing: str = MISSING_HINT,
    ) -> Item:
        """The item to check: against the golden with a budget, else with the tolerance of
        the dtype it is compared at (see ComputeDtype)."""
        import torch

        compute = self.compute.dtype if self.compute is not None else None
        if budget is not None and golden is not None:
            return BudgetItem(label, actual, expected, golden, budget, compute, missing)
        dtype = expected.dtype
        if isinstance(actual, torch.Tensor):
            dtype = less_precise(actual.dtype, dtype)
        why = ""
        if self.compute is not None:
            dtype, why = self.compute.tolerance_dtype(dtype)
        resolved = self.policy.tolerance(dtype, extra, why)
        return ToleranceItem(label, actual, expected, resolved, missing)

    def _aux_items(
        self,
        aux: Any,
        tolerances: Mapping[AuxKey, Tolerance],
        budget: float | None,
        extra: tuple[ToleranceOverride, ...],
        items: list[Item],
        unpaired: list[ItemCheck],
    ) -> None:
        """The items of the aux, into ``items``; failed checks for leaves that cannot be
        compared as tensors into ``unpaired``."""
        __tracebackhide__ = True

        if self.aux is None:
            raise TypeError(
                "assert_close(aux=...): this reference has no aux; compute it with "
                "grad_reference(..., has_aux=True)"
            )
        leaves = pair_aux(aux, self.aux, self.golden.aux if self.golden else None)
        known = {leaf.key for leaf in leaves} | {leaf.label for leaf in leaves}
        for name, tolerance in tolerances.items():
            if name not in known:
                raise ValueError(
                    f"assert_close(): aux_tolerances names {name!r}, which is not in the aux; "
                    "use a top-level key or index, or an item's label: "
                    + ", ".join(leaf.label for leaf in leaves)
                )
            if not isinstance(tolerance, Tolerance):
                raise TypeError(
                    f"assert_close(): aux_tolerances[{name!r}] must be a "
                    f"pytest_gradref.Tolerance(rtol=..., atol=...), got {tolerance!r}"
                )
        for leaf in leaves:
            if leaf.problem is not None:
                unpaired.append(_failed(leaf.label, leaf.problem))
                continue
            expected = _as_tensor(leaf.expected, None)
            if expected is None:  # not numeric: equal or not
                if leaf.actual != leaf.expected:
                    unpaired.append(
                        _failed(
                            leaf.label,
                            f"{leaf.actual!r} differs from the reference's {leaf.expected!r}",
                        )
                    )
                continue
            actual = _as_tensor(leaf.actual, expected.device)
            golden = _as_tensor(leaf.golden, None) if is_inexact(expected.dtype) else None
            key: AuxKey | None = leaf.label if leaf.label in tolerances else leaf.key
            own = tolerances.get(key) if key is not None else None
            item_extra, item_budget = extra, budget
            if own is not None:
                source = f"assert_close(aux_tolerances={{{key!r}: ...}})"
                item_extra = (ToleranceOverride(own.rtol, own.atol, source), *extra)
                item_budget = None
            missing = "the actual aux holds None here"
            item_actual = leaf.actual if actual is None else actual
            items.append(
                self._item(
                    leaf.label, item_actual, expected, golden, item_budget, item_extra, missing
                )
            )

    def _pair_items(
        self,
        actual_value: torch.Tensor,
        actual_grads: ActualGrads,
        param_grads: ActualParamGrads,
    ) -> list[tuple[str, torch.Tensor | None, torch.Tensor, Any, str]]:
        """(label, actual, reference, golden or None, what a None actual means) for every
        item, validated."""
        __tracebackhide__ = True
        import torch

        golden = self.golden
        expected_grads = self.grads if isinstance(self.grads, tuple) else (self.grads,)
        items: list[tuple[str, torch.Tensor | None, torch.Tensor, Any, str]] = [
            ("value", actual_value, self.value, golden and golden.value, MISSING_HINT)
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
            for label, actual, expected, golden_grad in zip(
                self.grad_labels, actual_tuple, expected_grads, golden_grads
            ):
                items.append((label, actual, expected, golden_grad, MISSING_HINT))
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
                items.append((label, param_grads[name], expected, golden_grad, _no_grad(name)))
        return items


def _no_grad(name: str) -> str:
    """What a parameter's None gradient means, and the option that leaves it out."""
    prefix = name.rsplit(".", 1)[0] + "." if "." in name else name
    return (
        f"backward() did not reach parameter {name!r}. If the kernel leaves it untrained "
        "(a frozen reference model, say), check only the others: "
        f"grad_reference(..., params=lambda name, p: not name.startswith({prefix!r})) "
        "or params=[...names...]"
    )


def _failed(label: str, detail: str) -> ItemCheck:
    return ItemCheck(label, "-", math.nan, math.nan, "-", -math.inf, False, detail)


def _as_tensor(value: Any, device: torch.device | None) -> torch.Tensor | None:
    """An aux leaf as a tensor: itself, or a Python number as a 0-dim tensor (a float as
    float64, its precision) on ``device``; None for anything else."""
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (bool, int, float, complex)):
        dtype = torch.float64 if isinstance(value, float) and not isinstance(value, bool) else None
        return torch.tensor(value, dtype=dtype, device=device)
    return None


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
                f"{_describe(module)}; its parameters are {', '.join(named) or 'none'}"
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
    tensor keyword arguments, and the module's parameters (checked or not: a frozen bf16
    reference model rounds the loss too)."""
    import torch

    positions = tuple(i for i, arg in enumerate(args) if isinstance(arg, torch.Tensor))
    labels = _argument_labels(signature_source, len(args), positions)
    candidates = [
        (label.removeprefix("gradient of "), args[i]) for label, i in zip(labels, positions)
    ]
    candidates += [
        (f"keyword argument {name!r}", value)
        for name, value in kwargs.items()
        if isinstance(value, torch.Tensor)
    ]
    if module is not None:
        candidates += [(f"parameter {n!r}", p) for n, p in module.named_parameters()]
    least: ComputeDtype | None = None
    for source, tensor in candidates:
        dtype = tensor.dtype
        if is_inexact(dtype) and (least is None or epsilon(dtype) > epsilon(least.dtype)):
            least = ComputeDtype(dtype, source)
    return least


def _obtained_dtype(value: torch.Tensor, aux: Any) -> torch.dtype:
    """The least precise floating dtype among a result's value and aux tensors."""
    import torch
    from torch.utils._pytree import tree_leaves

    least = value.dtype
    for leaf in tree_leaves(aux):
        if isinstance(leaf, torch.Tensor) and is_inexact(leaf.dtype):
            least = less_precise(least, leaf.dtype)
    return least


def _check_golden_obtained(
    fn: Callable[..., Any], requested: torch.dtype, obtained: torch.dtype, policy: CheckPolicy
) -> None:
    """Warn, once per test, where fn returned a golden less precise than requested."""
    if epsilon(obtained) <= epsilon(requested):
        return
    recording = policy.recording
    if recording is not None:
        if recording.golden_shortfall is not None:
            return
        recording.golden_shortfall = (dtype_name(requested), dtype_name(obtained))
    warnings.warn(
        GoldenPrecisionWarning(
            f"golden={requested} was requested, but {_describe(fn)} returned {obtained}: it "
            f"casts inside (e.g. .float()), so the golden is only {dtype_name(obtained)}-"
            "precise and budgets are measured against that. Compute in at least the inputs' "
            "dtype, e.g. x.to(torch.promote_types(x.dtype, torch.float32)) for .float()"
        ),
        stacklevel=4,  # the test's line: here, compute_reference, GradReference, the test
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
    params: ParamSelection = None,
) -> Reference:
    """fn's value and gradients by ``strategy``; see the module docstring for guarantees.

    Under ``crosscheck`` both strategies run, ``default_strategy``'s result is returned and
    the disagreement per item is recorded on ``Reference.crosscheck``. With ``golden`` the
    primary strategy also runs on inputs upcast to that dtype (on ``golden_device`` when
    given, else where the inputs are); a golden that fn returns less precise than that is
    warned of (GoldenPrecisionWarning). ``params`` chooses a module's parameters
    differentiated and checked (names, or a predicate of name and parameter); by default
    those that require grad.
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
    selected: dict[str, torch.Tensor] = {}
    frozen: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    if isinstance(fn, torch.nn.Module):
        selected, frozen = _select_params(fn, params)
        buffers = {name: buffer.detach() for name, buffer in fn.named_buffers()}
    elif params is not None:
        raise TypeError(
            f"params= chooses an nn.Module's parameters, and {_describe(fn)} is not a module"
        )
    problem = _Problem(fn, args, dict(kwargs), positions, has_aux, selected, frozen, buffers)
    signature_source = fn.forward if isinstance(fn, torch.nn.Module) else fn
    labels = _argument_labels(signature_source, len(args), positions)
    compute = _compute_dtype(
        signature_source, args, kwargs, fn if isinstance(fn, torch.nn.Module) else None
    )

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
        crosscheck = tuple(
            _disagreement(*pair, policy, compute, primary, other_strategy) for pair in pairs
        )
    if policy.recording is not None:
        policy.recording.add_reference(primary, crosscheck or ())

    golden_result = None
    if golden is not None:
        upcast = _golden_problem(problem, golden, golden_device)
        computed = _STRATEGY_FUNCTIONS[primary](upcast)
        obtained = _obtained_dtype(computed.value, computed.aux)
        _check_golden_obtained(fn, golden, obtained, policy)
        golden_result = Golden(
            dtype=golden,
            device=computed.value.device,
            value=computed.value,
            arg_grads=computed.arg_grads,
            param_grads=computed.param_grads,
            aux=computed.aux,
            obtained=obtained,
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
        compute=compute,
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
        params: ParamSelection = None,
        **kwargs: Any,
    ) -> Reference:
        """fn(*args, **kwargs)'s value and its gradients w.r.t. ``args[argnums]``.

        fn may be an nn.Module: then gradients w.r.t. its parameters come too, in
        ``Reference.param_grads``: those that require grad, or those ``params`` names (a
        name, a list of names, or a predicate ``(name, parameter) -> bool``); ``argnums=()``
        asks for those alone. With ``golden=torch.float64`` the reference is also computed
        in that dtype, for ``Reference.assert_close(..., budget=k)``.
        """
        __tracebackhide__ = True
        return self._compute(self.strategy, fn, args, kwargs, argnums, has_aux, golden, params)

    def kernel(
        self,
        fn: Callable[..., Any],
        /,
        *args: Any,
        argnums: Argnums = 0,
        has_aux: bool = False,
        golden: torch.dtype | None = None,
        params: ParamSelection = None,
        **kwargs: Any,
    ) -> Reference:
        """Like calling the fixture, for a reference that is itself a kernel: another
        implementation with its own backward (an ``autograd.Function``), to compare two
        kernels where neither is a plain reference.

        It is computed by autograd on every backend, whatever the strategy in force: the
        kernel's backward computes its gradients either way, and ``grad_and_value`` cannot
        run a Function without ``setup_context``. Under ``--gradref-strategy=crosscheck``
        there is nothing to crosscheck; the test is counted in the summary as opted out.
        """
        __tracebackhide__ = True
        if self.strategy == "crosscheck" and self.policy.recording is not None:
            self.policy.recording.crosscheck_opt_out = "a kernel reference (grad_reference.kernel)"
        return self._compute("autograd", fn, args, kwargs, argnums, has_aux, golden, params)

    def _compute(
        self,
        strategy: StrategyChoice,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        argnums: Argnums,
        has_aux: bool,
        golden: torch.dtype | None,
        params: ParamSelection,
    ) -> Reference:
        """compute_reference under this fixture's policy, with the call's golden dtype or the
        marker's (on the CPU where the backend cannot compute it)."""
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
            strategy=strategy,
            default_strategy=self.default_strategy,
            policy=self.policy,
            params=params,
            golden=golden,
            golden_device=golden_device,
        )
