"""The object the ``grad_reference`` fixture hands a test: ``GradReference``.

It computes references under the test's policy (strategy, tolerances, golden dtype, where the
golden is computed, whether a rounded reference is computed too) and records them in the test's
Recording; plugin.py builds it from the session's setup and the test's marker.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pytest_gradref.config.strategies import Strategy, StrategyChoice
from pytest_gradref.config.tolerances import CheckPolicy, dtype_name
from pytest_gradref.reference.computation import Argnums, ParamSelection, compute_reference
from pytest_gradref.reference.differentiation import Outputs
from pytest_gradref.reference.recording import Recording
from pytest_gradref.reference.result import Reference
from pytest_gradref.verdict.criterion import candidate_golden
from pytest_gradref.warning_types import user_stacklevel


@dataclass(frozen=True)
class GradReference:
    """The ``grad_reference`` fixture: computes references under the test's policy.

    ``golden`` is the test's default golden dtype and ``rounded`` whether it asks for a
    rounded reference (from its marker); ``golden_on_cpu`` names the dtypes the backend cannot
    compute on its device, whose goldens go to the CPU. ``recording`` is the test's record for
    the report, which every reference and its checks add to (None: nothing is recorded).
    """

    strategy: StrategyChoice
    default_strategy: Strategy
    policy: CheckPolicy
    golden: torch.dtype | None = None
    golden_on_cpu: frozenset[str] = frozenset()
    rounded: bool = False
    # Deprecated: the default verdict's golden is the policy's (CheckPolicy.default_golden);
    # given here, it is set there, with a DeprecationWarning.
    default_golden: torch.dtype | None = None
    recording: Recording | None = None

    def __post_init__(self) -> None:
        if self.default_golden is not None:
            warnings.warn(
                "GradReference(default_golden=...) is deprecated and will be removed in the "
                "next release: set it on the policy, "
                "CheckPolicy(default_golden=..., default_budget=...)",
                DeprecationWarning,
                stacklevel=user_stacklevel(),
            )
            policy = self.policy.with_default_golden(self.default_golden)
            object.__setattr__(self, "policy", policy)
            object.__setattr__(self, "default_golden", None)

    def __repr__(self) -> str:
        # Short: pytest and Hypothesis print a test's arguments (a falsifying example, a
        # failing test's locals), and the policy's tables and recording run to dozens of lines.
        fields = f"backend={self.policy.backend!r}, strategy={self.strategy!r}"
        if self.golden is not None:
            fields += f", golden={self.golden}"
        if self.rounded:
            fields += ", rounded=True"
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
        rounded: bool | None = None,
        cotangent: Outputs | None = None,
        **kwargs: Any,
    ) -> Reference:
        """fn(*args, **kwargs)'s value and its gradients w.r.t. ``args[argnums]``.

        fn returns a scalar loss, or a tensor output (a per-token loss, a norm's output):
        then the gradients are the vector-Jacobian product with ``cotangent``, by default a
        seeded draw of the output's shape and dtype, ``Reference.cotangent``, which the
        kernel's backward takes too (``out.backward(ref.cotangent)``). ``argnums=()`` on a
        function gives fn's value and aux alone (a value-only reference).

        fn may be an nn.Module: then gradients w.r.t. its parameters come too, in
        ``Reference.param_grads``: those that require grad, or those ``params`` names (a
        name, a list of names, or a predicate ``(name, parameter) -> bool``); ``argnums=()``
        asks for those alone. With ``golden=torch.float64`` the reference is also computed
        in that dtype, for ``Reference.assert_close(..., budget=k)``; with ``rounded=True``
        also with every floating-point result rounded to the compute dtype (the least precise
        floating input's, differentiated or not), and a budget then counts from the larger of
        the two references' errors. ``golden`` and ``rounded`` left as None take the marker's.
        """
        __tracebackhide__ = True
        return self._compute(
            self.strategy, fn, args, kwargs, argnums, has_aux, golden, params, rounded, cotangent
        )

    def kernel(
        self,
        fn: Callable[..., Any],
        /,
        *args: Any,
        argnums: Argnums = 0,
        has_aux: bool = False,
        golden: torch.dtype | None = None,
        params: ParamSelection = None,
        rounded: bool | None = None,
        cotangent: Outputs | None = None,
        **kwargs: Any,
    ) -> Reference:
        """Like calling the fixture, for a reference that is itself a kernel: another
        implementation with its own backward (an ``autograd.Function``), to compare two
        kernels where neither is a plain reference.

        It is computed by autograd on every backend, whatever the strategy in force: the
        kernel's backward computes its gradients either way, and ``grad_and_value`` cannot
        run a Function without ``setup_context``. Under ``--gradref-strategy=crosscheck``
        there is nothing to crosscheck in it: the summary counts the test as opted out, or as
        crosschecked in part where it also computes a crosschecked reference.
        ``rounded=True`` rounds the kernel's own operations, its backward's included.
        No golden is computed unless asked for (``golden=`` or the marker's): a kernel need
        not run in float64, so the default verdict compares with the dtype's tolerance here.
        """
        __tracebackhide__ = True
        if self.strategy == "crosscheck" and self.recording is not None:
            self.recording.crosscheck_opt_out = "a kernel reference (grad_reference.kernel)"
        return self._compute(
            "autograd",
            fn,
            args,
            kwargs,
            argnums,
            has_aux,
            golden,
            params,
            rounded,
            cotangent,
            kernel=True,
        )

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
        rounded: bool | None,
        cotangent: Outputs | None,
        kernel: bool = False,
    ) -> Reference:
        """compute_reference under this fixture's policy, with the call's golden dtype and
        rounding or the marker's (the golden on the CPU where the backend cannot compute it);
        ``kernel`` for a reference that is itself a kernel."""
        __tracebackhide__ = True
        golden = golden if golden is not None else self.golden
        golden_device = None
        wanted = candidate_golden(self.policy, golden, kernel=kernel)
        if wanted is not None and dtype_name(wanted) in self.golden_on_cpu:
            golden_device = torch.device("cpu")
        reference = compute_reference(
            fn,
            args,
            kwargs,
            argnums=argnums,
            has_aux=has_aux,
            strategy=strategy,
            default_strategy=self.default_strategy,
            policy=self.policy,
            recording=self.recording,
            params=params,
            golden=golden,
            golden_device=golden_device,
            rounded=rounded if rounded is not None else self.rounded,
            cotangent=cotangent,
            kernel=kernel,
        )
        if self.recording is not None:
            # After the reference, which validated the arguments and never changes them.
            self.recording.add_inputs(fn, args, kwargs)
        return reference
