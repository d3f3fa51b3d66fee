"""The reference a test receives and its ``assert_close``.

``Reference`` holds the value, gradients, aux and golden that compute_reference produced
(computation.py) and checks a kernel's results against them: it pairs each actual item with
its reference, asks verdict/criterion.py whether it takes a budget or a tolerance
(tolerances.py), has check_items (verdict/judge.py) judge them all, and fails with every item
that differs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import torch

from pytest_gradref.config.number_settings import check_number
from pytest_gradref.config.strategies import Strategy
from pytest_gradref.config.tolerances import AuxKey, CheckPolicy, Tolerance, ToleranceOverride
from pytest_gradref.reference.auxiliary import (
    UNCHECKED,
    AuxLeaf,
    AuxValue,
    aux_items,
    leaf_tensor,
    pair_aux,
)
from pytest_gradref.reference.differentiation import Outputs, value_items
from pytest_gradref.reference.golden import Golden
from pytest_gradref.reference.recording import Disagreement, Recording
from pytest_gradref.verdict.budget_item import BudgetItem
from pytest_gradref.verdict.checks import MISSING_HINT, ItemCheck, format_failures
from pytest_gradref.verdict.criterion import budget_for
from pytest_gradref.verdict.dtypes import ComputeDtype
from pytest_gradref.verdict.judge import Item, check_items
from pytest_gradref.verdict.tolerance_item import ToleranceItem
from pytest_gradref.warning_types import ZeroGradientWarning, user_stacklevel

if TYPE_CHECKING:
    from pytest_gradref.reference.differentiation import Result
    from pytest_gradref.reference.rounding import Rounded

ActualGrads = Union["torch.Tensor", Sequence[Union["torch.Tensor", None]], None]
ActualParamGrads = Union[Mapping[str, Union["torch.Tensor", None]], "torch.nn.Module", None]


@dataclass(frozen=True)
class GradientArgument:
    """A differentiated argument: its position in the call, as argnums counts it, and its
    name where the function's signature gives one. Its gradient's item label is made from
    it, never parsed back."""

    position: int
    name: str | None

    @property
    def label(self) -> str:
        suffix = f" ({self.name})" if self.name else ""
        return f"gradient of argument {self.position}{suffix}"


@dataclass(frozen=True, eq=False)
class Reference:
    """A reference value (a scalar loss, or a tensor output) and its gradients.

    Attributes:
        value: the loss, or the tensor output, detached.
        grads: gradients w.r.t. ``args[argnums]``: one tensor when argnums is an int, else a
            tuple aligned with argnums (empty for a value-only reference, ``argnums=()``).
            For a tensor output, the vector-Jacobian product with ``cotangent``.
        param_grads: gradients w.r.t. the named parameters when fn is an nn.Module.
        aux: fn's auxiliary output when ``has_aux=True``.
        strategy: the strategy that produced value and grads.
        backend: the backend whose policy chose it.
        crosscheck: under the crosscheck strategy, the disagreement per item between
            autograd and grad_and_value; else None.
        golden: the same computed in a higher precision, when ``golden=`` was asked for.
        compute: the least precise floating dtype among the inputs, differentiated or not
            (a module's parameters included), which every item's tolerance follows (None where
            no input is floating).
        rounded: the same with every floating-point result rounded to the compute dtype,
            when ``rounded=True`` was asked for; a budget then counts from the larger of its
            error and the reference's.
        recording: where the test's checks are recorded for the report (None: nowhere).
        cotangent: for a tensor output, the cotangent its gradients are taken with (drawn,
            seeded, of the output's shape and dtype, unless the test gave one), for the
            kernel's own backward: ``out.backward(ref.cotangent)``; None for a scalar loss.
    """

    value: Outputs
    grads: torch.Tensor | tuple[torch.Tensor, ...]
    param_grads: Mapping[str, torch.Tensor]
    aux: Any
    strategy: Strategy
    backend: str
    crosscheck: tuple[Disagreement, ...] | None
    golden: Golden | None
    # What each gradient in ``grads`` is the gradient of, and its item's label (the argument's
    # label, with the slice where a rank holds one).
    grad_arguments: tuple[GradientArgument, ...]
    grad_labels: tuple[str, ...]
    policy: CheckPolicy
    compute: ComputeDtype | None = None
    rounded: Rounded | None = None
    recording: Recording | None = field(default=None, repr=False)
    # For a tensor output: what its gradients are the vector-Jacobian product with, for the
    # kernel's own backward (``out.backward(ref.cotangent)``); None for a scalar loss.
    cotangent: Outputs | None = None

    def assert_close(
        self,
        actual_value: torch.Tensor | Sequence[torch.Tensor],
        actual_grads: ActualGrads = None,
        *,
        param_grads: ActualParamGrads = None,
        aux: Any = None,
        aux_tolerances: Mapping[AuxKey, Tolerance] | None = None,
        rtol: float | None = None,
        atol: float | None = None,
        budget: float | None = None,
        check_dtype: bool | None = None,
    ) -> None:
        """Assert that a kernel's value, gradients and aux match this reference.

        An actual result less precise than its reference fails on its dtype, unless
        ``check_dtype=False`` (here or on the marker) says the kernel returns a lower
        precision on purpose; it is then judged at the reference's precision.

        With a golden reference (which the default verdict computes for every reference of
        inputs less precise than float64) and no tolerance given, each item passes when its
        error against the golden, greatest and normwise, is at most k times the same-dtype
        reference's own error plus a floor (verdict/budget_item.py): k is ``budget=``, else
        the marker's budget, else the session's default budget (2). With a rounded reference
        (``rounded=True``) k times the larger of the two references' errors. ``rtol``/``atol``
        here or on the marker compare with that tolerance instead, at the least precise of
        the reference's dtype and the compute dtype (that of the least precise input,
        differentiated or not); so does a reference without a golden (float64 inputs, or
        ``--gradref-verdict=tolerance``), with its backend's tolerance for that dtype.
        ``aux`` (the kernel's auxiliary output) is compared leaf by leaf with the same rules;
        an entry of ``aux_tolerances``, keyed by a top-level key or index of the aux or by an
        item's label (``"aux['logps'][0]"``), gives those items a tolerance of their own,
        which wins over rtol/atol (here or on the marker) and a budget. The marker's
        ``aux_tolerances`` apply to every assert_close of the test that compares an aux;
        an entry here wins over the marker's for the same item. A reference with an aux
        needs ``aux=``: the kernel's aux, or ``pytest_gradref.UNCHECKED`` to leave it
        uncompared on purpose (recorded in the report). Every item is checked before failing,
        and the message names each one that differs.

        Each setting here (``rtol``, ``atol``, ``budget``, ``check_dtype``,
        ``aux_tolerances``) can also be given for the whole test on
        ``@pytest.mark.gradref(...)`` (a budget there beside ``golden=``); the arguments
        here win over the marker's.

        Raises:
            AssertionError: an item differs beyond its tolerance or budget.
            TypeError, ValueError: the arguments do not line up with the reference (among
                them a reference's aux left out of ``aux=``).
        """
        # pytest then ends a failure's traceback at the test's line, as torch.testing does;
        # the helpers below hide their frames too (--full-trace shows them).
        __tracebackhide__ = True
        if budget is not None and (rtol is not None or atol is not None):
            raise ValueError("assert_close() takes either budget= or rtol=/atol=, not both")
        if check_dtype is None:
            check_dtype = self.policy.check_dtype
        elif not isinstance(check_dtype, bool):
            raise TypeError(
                f"assert_close(): check_dtype must be True or False, got {check_dtype!r}"
            )
        tolerance_given = rtol is not None or atol is not None
        budget = budget_for(
            self.policy,
            budget=budget,
            tolerance_given=tolerance_given,
            has_golden=self.golden is not None,
        )
        if budget is None and self.rounded is not None:
            raise ValueError(
                "this reference was computed with rounded=True, which only widens an error "
                "budget, and assert_close() compares "
                + ("with rtol=/atol=" if tolerance_given else "without one")
                + ": pass budget=k (or set it in @pytest.mark.gradref) or leave rounded out"
            )
        for name, value in (("rtol", rtol), ("atol", atol)):
            if value is not None:  # checked here, so that the message names the argument
                check_number(value, name, minimum=0)
        extra: tuple[ToleranceOverride, ...] = ()
        if tolerance_given:
            extra = (ToleranceOverride(rtol, atol, "the assert_close() arguments"),)
        items: list[Item] = [
            self._item(
                label, actual, expected, golden, budget, extra, check_dtype, missing, rounded
            )
            for label, actual, expected, golden, rounded, missing in self._pair_items(
                actual_value, actual_grads, param_grads
            )
        ]
        # Aux leaves that cannot be compared as tensors (structure, non-numeric values).
        unpaired: list[ItemCheck] = []
        if aux is UNCHECKED:
            self._leave_aux_unchecked(aux_tolerances)
        elif aux is not None:
            self._aux_items(aux, aux_tolerances or {}, budget, extra, check_dtype, items, unpaired)
        elif self.aux is not None:
            raise TypeError(
                "assert_close(): this reference has an aux (grad_reference(..., has_aux=True): "
                f"{_aux_labels(self.aux)}) but no aux= was given, so it would go unchecked. "
                "Pass the kernel's aux as aux= to compare it item by item, or "
                "aux=pytest_gradref.UNCHECKED to leave it uncompared on purpose (the report "
                "records it as unchecked)"
            )
        elif aux_tolerances:
            raise ValueError("assert_close(): aux_tolerances= needs the actual aux, as aux=")
        checks = check_items(items, statistics=self.policy.statistics)  # one host read
        checks = self._judge_with_spread(items, checks)
        self._warn_of_zero_gradients(checks)
        checks += unpaired
        if self.recording is not None:
            self.recording.add_checks(checks)
        if not all(check.passed for check in checks):
            # The device index too: under xdist each worker has its own (npu:0, npu:1).
            header = (
                f"Reference mismatch on {value_items(self.value)[0][1].device} "
                f"({self.backend} backend, "
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
        check_dtype: bool,
        missing: str = MISSING_HINT,
        rounded: torch.Tensor | None = None,
    ) -> Item:
        """The item to check: against the golden with a budget (counted from the rounded
        reference too, where there is one), else with the tolerance of the dtype it is
        compared at: the reference's, or the compute dtype where less precise (see
        ComputeDtype). A less precise actual is judged at that dtype all the same."""
        compute = self.compute.dtype if self.compute is not None else None
        if budget is not None and golden is not None:
            condition = None
            if label == "value" and self.golden is not None:
                condition = self.golden.value_condition
            return BudgetItem(
                label,
                actual,
                expected,
                golden,
                budget,
                compute,
                missing,
                rounded,
                check_dtype=check_dtype,
                condition=condition,
            )
        dtype, why = (
            (expected.dtype, "")
            if self.compute is None
            else self.compute.tolerance_dtype(expected.dtype)
        )
        resolved = self.policy.tolerance(dtype, extra, why)
        return ToleranceItem(label, actual, expected, resolved, missing, check_dtype)

    def _judge_with_spread(self, items: Sequence[Item], checks: list[ItemCheck]) -> list[ItemCheck]:
        """The checks, with each item that asks for it (a budget item that failed on its
        errors) judged again against the rounding spread (spread.py: the reference's randomly
        rounded runs, run once per reference, here, where the first item needs them): its
        reference's error is one draw of rounding noise, the runs' errors are many."""
        spread = self.golden.spread if self.golden is not None else None
        again = [
            position
            for position, (item, check) in enumerate(zip(items, checks))
            if item.needs_spread(check)
        ]
        if spread is None or not again:
            return checks
        runs = [self._run_items(result) for result in spread.results()]
        retried: list[Item] = []
        for position in again:
            item = items[position]
            samples = tuple(run[item.label] for run in runs if item.label in run)
            retried.append(item.with_spread(samples))
        checks = list(checks)
        for position, check in zip(again, check_items(retried)):
            checks[position] = check
        return checks

    def _warn_of_zero_gradients(self, checks: Sequence[ItemCheck]) -> None:
        """A ZeroGradientWarning for each gradient whose scale, read with the checks, is 0:
        the golden's (or, without one, the reference's) greatest magnitude."""
        gradients = {*self.grad_labels, *(parameter_label(name) for name in self.param_grads)}
        for check in checks:
            if check.label in gradients and check.scale == 0 and check.numel > 0:
                warnings.warn(
                    ZeroGradientWarning(
                        f"the reference's {check.label} is zero everywhere"
                        + (", and so is its golden's" if self.golden is not None else "")
                        + ": does the reference use this input differentiably? An argmax, a "
                        "comparison, .detach(), .item() or an integer cast on its path leaves "
                        "no gradient, and the kernel's gradient is then checked against "
                        "zeros. Where zeros are right, filter ZeroGradientWarning"
                    ),
                    stacklevel=user_stacklevel(),
                )

    def _run_items(self, run: Result) -> dict[str, torch.Tensor]:
        """A run of the golden computation (a rounding spread's), item by item, by label."""
        found = {**dict(value_items(run.value)), **dict(zip(self.grad_labels, run.arg_grads))}
        found.update((parameter_label(name), grad) for name, grad in run.param_grads.items())
        if self.aux is not None:
            for leaf in pair_aux(run.aux, self.aux, None):
                tensor = leaf_tensor(leaf.actual, None)
                if leaf.problem is None and tensor is not None:
                    found[leaf.label] = tensor
        return found

    def _leave_aux_unchecked(self, aux_tolerances: Mapping[AuxKey, Tolerance] | None) -> None:
        """aux=UNCHECKED: validated, and the aux's items recorded as not compared."""
        __tracebackhide__ = True
        if self.aux is None:
            raise TypeError(
                "assert_close(aux=pytest_gradref.UNCHECKED): this reference has no aux to "
                "leave unchecked; drop aux=, or compute it with grad_reference(..., has_aux=True)"
            )
        if aux_tolerances:
            raise ValueError(
                "assert_close(): aux_tolerances= has nothing to apply to under "
                "aux=pytest_gradref.UNCHECKED; pass the kernel's aux as aux= to compare it"
            )
        if self.recording is not None:
            leaves = pair_aux(self.aux, self.aux, None)
            self.recording.add_unchecked_aux(leaf.label for leaf in leaves)

    def _aux_items(
        self,
        aux: Any,
        tolerances: Mapping[AuxKey, Tolerance],
        budget: float | None,
        extra: tuple[ToleranceOverride, ...],
        check_dtype: bool,
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
        leaves = pair_aux(
            aux,
            self.aux,
            self.golden.aux if self.golden else None,
            self.rounded.aux if self.rounded else None,
        )
        known = {leaf.key for leaf in leaves} | {leaf.label for leaf in leaves}
        marker = self.policy.aux_tolerances
        for name in (*tolerances, *marker):
            if name not in known:
                where = (
                    "assert_close(): aux_tolerances"
                    if name in tolerances
                    else "the test's @pytest.mark.gradref(aux_tolerances=...)"
                )
                raise ValueError(
                    f"{where} names {name!r}, which is not in the aux; "
                    "use a top-level key or index, or an item's label: "
                    + ", ".join(leaf.label for leaf in leaves)
                )
        for name, tolerance in tolerances.items():
            if not isinstance(tolerance, Tolerance):
                raise TypeError(
                    f"assert_close(): aux_tolerances[{name!r}] must be a "
                    f"pytest_gradref.Tolerance(rtol=..., atol=...), got {tolerance!r}"
                )

        def item(
            leaf: AuxLeaf,
            actual: Any,
            expected: torch.Tensor,
            golden: torch.Tensor | None,
            rounded: torch.Tensor | None,
        ) -> Item:
            item_extra, item_budget = extra, budget
            own = _aux_tolerance(leaf.label, leaf.key, tolerances, marker)
            if own is not None:
                # Its own tolerance wins over a budget (see criterion.budget_for).
                item_extra = (ToleranceOverride(own[0].rtol, own[0].atol, own[1]), *extra)
                item_budget = None
            missing = "the actual aux holds None here"
            return self._item(
                leaf.label,
                actual,
                expected,
                golden,
                item_budget,
                item_extra,
                check_dtype,
                missing,
                rounded,
            )

        for found in aux_items(leaves, item):
            if not isinstance(found, AuxValue):
                items.append(found)
            elif not found.passed:
                unpaired.append(_failed(found.leaf.label, found.detail))

    def _pair_items(
        self,
        actual_value: torch.Tensor | Sequence[torch.Tensor],
        actual_grads: ActualGrads,
        param_grads: ActualParamGrads,
    ) -> list[tuple[str, torch.Tensor | None, torch.Tensor, Any, Any, str]]:
        """(label, actual, reference, golden or None, rounded reference or None, what a None
        actual means) for every item, validated."""
        __tracebackhide__ = True
        golden, rounded = self.golden, self.rounded
        expected_grads = self.grads if isinstance(self.grads, tuple) else (self.grads,)
        outputs = value_items(self.value)
        if isinstance(self.value, tuple):
            if isinstance(actual_value, torch.Tensor) or len(actual_value) != len(outputs):
                given = (
                    "a tensor"
                    if isinstance(actual_value, torch.Tensor)
                    else f"{len(actual_value)} values"
                )
                raise TypeError(
                    f"assert_close(): this reference has {len(outputs)} outputs "
                    f"({', '.join(label for label, _ in outputs)}): its function returned a "
                    f"tuple of tensors; pass the kernel's as a tuple of {len(outputs)} tensors, "
                    f"in the same order, not {given}. If the tuple is a loss and what it "
                    "reports beside it, compute the reference with has_aux=True: the rest of "
                    "the tuple is then auxiliary output"
                )
            actual_values: list[Any] = list(actual_value)
        else:
            actual_values = [actual_value]
        no_values: list[Any] = [None] * len(outputs)
        golden_values = [v for _, v in value_items(golden.value)] if golden else no_values
        rounded_values = [v for _, v in value_items(rounded.value)] if rounded else no_values
        items: list[tuple[str, torch.Tensor | None, torch.Tensor, Any, Any, str]] = [
            (label, actual, expected, golden_value, rounded_value, MISSING_HINT)
            for (label, expected), actual, golden_value, rounded_value in zip(
                outputs, actual_values, golden_values, rounded_values
            )
        ]
        if not expected_grads and not self.param_grads and actual_grads is not None:
            raise TypeError(
                "assert_close(): this reference holds no gradients (argnums=(): a value-only "
                "reference), but actual_grads were given; drop them, or compute the reference "
                "with the inputs to differentiate in argnums"
            )
        if expected_grads:
            if actual_grads is None:
                # Either no gradients were passed, or a leaf's .grad that backward() left None.
                raise TypeError(
                    f"assert_close(): actual_grads is None, but this reference holds "
                    f"{len(expected_grads)} gradient(s) ({', '.join(self.grad_labels)}): pass "
                    "the kernel's gradients as actual_grads. If you passed a tensor's .grad, "
                    f"it is None: {MISSING_HINT}"
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
            nothing = (None,) * len(expected_grads)
            golden_grads = golden.arg_grads if golden else nothing
            rounded_grads = rounded.arg_grads if rounded else nothing
            for label, actual, expected, golden_grad, rounded_grad in zip(
                self.grad_labels, actual_tuple, expected_grads, golden_grads, rounded_grads
            ):
                items.append((label, actual, expected, golden_grad, rounded_grad, MISSING_HINT))
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
                rounded_grad = rounded.param_grads[name] if rounded else None
                label = parameter_label(name)
                items.append(
                    (label, param_grads[name], expected, golden_grad, rounded_grad, _no_grad(name))
                )
        return items


def _aux_tolerance(
    label: str,
    key: AuxKey | None,
    given: Mapping[AuxKey, Tolerance],
    marker: Mapping[AuxKey, Tolerance],
) -> tuple[Tolerance, str] | None:
    """An aux item's own tolerance and where it came from: assert_close's aux_tolerances
    before the marker's, each by the item's label before its top-level key or index."""
    for table, where in (
        (given, "assert_close(aux_tolerances={{{!r}: ...}})"),
        (marker, "the test's @pytest.mark.gradref(aux_tolerances={{{!r}: ...}}) marker"),
    ):
        for name in (label, key):
            if name is not None and name in table:
                return table[name], where.format(name)
    return None


def parameter_label(name: str) -> str:
    """A module parameter's gradient item: "gradient of parameter 'weight'"."""
    return f"gradient of parameter {name!r}"


def _no_grad(name: str) -> str:
    """What a parameter's None gradient means, and the option that leaves it out."""
    prefix = name.rsplit(".", 1)[0] + "." if "." in name else name
    return (
        f"backward() did not reach parameter {name!r}. If the kernel leaves it untrained "
        "(a frozen reference model, say), check only the others: "
        f"grad_reference(..., params=lambda name, p: not name.startswith({prefix!r})) "
        "or params=[...names...]"
    )


def _aux_labels(aux: Any, shown: int = 4) -> str:
    """The first items of an aux by label, for a message."""
    labels = [leaf.label for leaf in pair_aux(aux, aux, None)]
    more = f" and {len(labels) - shown} more" if len(labels) > shown else ""
    return ", ".join(labels[:shown]) + more


def _failed(label: str, detail: str) -> ItemCheck:
    return ItemCheck(label, "-", math.nan, math.nan, "-", -math.inf, False, detail)
