"""The gradref markers: their registration lines, parsing and validation.

Device markers become real ``xfail`` / ``skip`` marks during collection, so the report says
xfailed and skipped (never a pass that swallowed an exception).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from pytest_gradref.config.number_settings import number_problem
from pytest_gradref.config.strategies import STRATEGY_CHOICES, StrategyChoice
from pytest_gradref.config.tolerances import AuxKey, Tolerance, ToleranceOverride


@dataclass(frozen=True)
class MarkerSpec:
    """One gradref marker: its positional arguments, its keywords with their defaults (as
    the registration line shows them) and what it does. The registration line and the
    keyword check are both made from it."""

    name: str
    positional: tuple[str, ...]
    keywords: tuple[tuple[str, str | None], ...]  # (keyword, its default as shown; None: required)
    help: str

    @property
    def keyword_names(self) -> tuple[str, ...]:
        return tuple(keyword for keyword, _ in self.keywords)

    @property
    def line(self) -> str:
        """The line pytest registers (``--markers`` shows it)."""
        keywords = (k if default is None else f"{k}={default}" for k, default in self.keywords)
        return f"{self.name}({', '.join((*self.positional, *keywords))}): {self.help}"


MARKER_SPECS = (
    MarkerSpec(
        "gradref_xfail",
        ("*devices",),
        (("reason", None), ("raises", "None"), ("strict", "xfail_strict")),
        "expect the test to fail when the active gradref backend is one of devices; strict "
        "defaults to the xfail_strict ini option, as for pytest.mark.xfail.",
    ),
    MarkerSpec(
        "gradref_skip",
        ("*devices",),
        (("reason", None),),
        "skip the test when the active gradref backend is one of devices.",
    ),
    MarkerSpec(
        "gradref_only",
        ("*devices",),
        (("reason", "None"),),
        "run the test only when the active gradref backend is one of devices.",
    ),
    MarkerSpec(
        "gradref",
        (),
        (
            ("strategy", "None"),
            ("rtol", "None"),
            ("atol", "None"),
            ("golden", "None"),
            ("budget", "None"),
            ("rounded", "False"),
            ("check_dtype", "True"),
            ("aux_tolerances", "None"),
        ),
        "per-test reference strategy, tolerance overrides, golden dtype, error budget, whether "
        "the budget also counts from the reference rounded to the compute dtype at every step, "
        "whether a result less precise than its reference fails on its dtype, and tolerances "
        "of aux items by top-level key or label (as assert_close's).",
    ),
    MarkerSpec(
        "gradref_ranks",
        ("world_size",),
        (("timeout", "None"),),
        "run the test's body in world_size processes on torch.distributed, one rank each (the "
        "gradref_rank fixture says which), with the gradref backend's collective library (gloo "
        "on the CPU, NCCL on cuda, HCCL on npu); timeout, in seconds, overrides "
        "--gradref-rank-timeout for this test.",
    ),
)
MARKERS = {spec.name: spec for spec in MARKER_SPECS}
MARKER_LINES = tuple(spec.line for spec in MARKER_SPECS)
DEVICE_MARKERS = ("gradref_xfail", "gradref_skip", "gradref_only")
# Read by ranks/pytest_side.py, which runs such a test's body in its rank processes.
RANKS_MARKER = "gradref_ranks"
ALL_MARKERS = tuple(MARKERS)

_KEYWORDS: dict[str, tuple[str, ...]] = {name: spec.keyword_names for name, spec in MARKERS.items()}
# The keywords a marker cannot do without (those shown without a default).
_REQUIRED: dict[str, tuple[str, ...]] = {
    name: required
    for name, spec in MARKERS.items()
    if (required := tuple(k for k, default in spec.keywords if default is None))
}


class MarkerError(Exception):
    """A gradref marker used wrongly; the message says what is valid."""


def _check_keywords(mark: pytest.Mark) -> None:
    allowed = _KEYWORDS[mark.name]
    unknown = sorted(set(mark.kwargs) - set(allowed))
    if unknown:
        raise MarkerError(
            f"@pytest.mark.{mark.name} got unknown keyword(s) {', '.join(unknown)}; "
            f"valid keywords are {', '.join(allowed)}"
        )
    missing = [k for k in _REQUIRED.get(mark.name, ()) if k not in mark.kwargs]
    if missing:
        raise MarkerError(
            f"@pytest.mark.{mark.name} needs {', '.join(f'{k}=...' for k in missing)}"
        )


def _is_exception_types(value: object) -> bool:
    if isinstance(value, tuple):
        return bool(value) and all(_is_exception_types(v) for v in value)
    return isinstance(value, type) and issubclass(value, BaseException)


def device_mark(
    mark: pytest.Mark, known: Collection[str], active: str
) -> pytest.MarkDecorator | None:
    """The xfail/skip mark a device marker stands for on ``active``, or None."""
    _check_keywords(mark)
    devices = mark.args
    if not devices:
        raise MarkerError(f"@pytest.mark.{mark.name} needs at least one device name")
    for device in devices:
        if isinstance(device, (list, tuple, set, frozenset)):
            names = ", ".join(repr(d) for d in device)
            raise MarkerError(
                f"@pytest.mark.{mark.name} takes device names as separate arguments, not a "
                f"{type(device).__name__}: write @pytest.mark.{mark.name}({names}, ...)"
            )
        if not isinstance(device, str) or device not in known:
            raise MarkerError(
                f"@pytest.mark.{mark.name} names unknown device {device!r}; "
                f"registered gradref backends are {', '.join(sorted(known))}"
            )
    applies = active in devices
    reason = mark.kwargs.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise MarkerError(f"@pytest.mark.{mark.name}: reason must be a string, got {reason!r}")
    if mark.name == "gradref_xfail":
        # Checked on every backend, so a misuse shows up here and not only where it applies.
        strict = mark.kwargs.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise MarkerError(f"@pytest.mark.gradref_xfail: strict must be a bool, got {strict!r}")
        raises = mark.kwargs.get("raises")
        if raises is not None and not _is_exception_types(raises):
            raise MarkerError(
                "@pytest.mark.gradref_xfail: raises must be an exception class or a tuple of "
                f"them, got {raises!r}"
            )
        if not applies:
            return None
        why = f"[gradref {active}] {reason}"
        if strict is None:  # pytest then applies the xfail_strict ini option
            return pytest.mark.xfail(reason=why, raises=raises)
        return pytest.mark.xfail(reason=why, raises=raises, strict=strict)
    if mark.name == "gradref_skip":
        return pytest.mark.skip(reason=f"[gradref {active}] {reason}") if applies else None
    if applies:
        return None
    default = f"runs only on {', '.join(devices)}"
    return pytest.mark.skip(reason=f"[gradref {active}] {reason or default}")


@dataclass(frozen=True)
class TestOverrides:
    """What a ``gradref(...)`` marker sets for one test."""

    strategy: StrategyChoice | None = None
    tolerance: ToleranceOverride | None = None
    golden: Any = None  # a torch.dtype; typed loosely so this module needs no torch
    budget: float | None = None
    rounded: bool = False
    check_dtype: bool = True
    # assert_close's aux_tolerances for every assert_close of the test; its own win per item.
    aux_tolerances: Mapping[AuxKey, Tolerance] = field(default_factory=dict)


def parse_gradref_mark(mark: pytest.Mark | None) -> TestOverrides:
    if mark is None:
        return TestOverrides()
    _check_keywords(mark)
    if mark.args:
        raise MarkerError(
            "@pytest.mark.gradref takes keywords only: " + ", ".join(_KEYWORDS["gradref"])
        )
    kwargs = mark.kwargs
    strategy = kwargs.get("strategy")
    if strategy is not None and strategy not in STRATEGY_CHOICES:
        raise MarkerError(
            f"@pytest.mark.gradref got strategy={strategy!r}; valid values are "
            f"{', '.join(STRATEGY_CHOICES)}"
        )
    rtol, atol = kwargs.get("rtol"), kwargs.get("atol")
    for name, value in (("rtol", rtol), ("atol", atol)):
        problem = None if value is None else number_problem(value, minimum=0)
        if problem is not None:
            raise MarkerError(f"@pytest.mark.gradref got {name}={value!r}; it {problem}")
    tolerance = None
    if rtol is not None or atol is not None:
        tolerance = ToleranceOverride(rtol, atol, "the test's @pytest.mark.gradref marker")
    golden, budget = kwargs.get("golden"), kwargs.get("budget")
    if golden is not None and not getattr(golden, "is_floating_point", False):
        raise MarkerError(
            f"@pytest.mark.gradref got golden={golden!r}; it must be a floating torch.dtype "
            "such as torch.float64"
        )
    if budget is not None:
        problem = number_problem(budget, minimum=0, inclusive=False)
        if problem is not None:
            raise MarkerError(f"@pytest.mark.gradref got budget={budget!r}; it {problem}")
        if golden is None:
            raise MarkerError(
                "@pytest.mark.gradref got budget= without golden=: a budget is measured "
                "against a golden reference, so add golden=torch.float64"
            )
        if tolerance is not None:
            raise MarkerError("@pytest.mark.gradref takes either budget= or rtol=/atol=")
    rounded = kwargs.get("rounded", False)
    if not isinstance(rounded, bool):
        raise MarkerError(f"@pytest.mark.gradref got rounded={rounded!r}; it must be True or False")
    missing = [name for name, value in (("golden=", golden), ("budget=", budget)) if value is None]
    if rounded and missing:
        raise MarkerError(
            f"@pytest.mark.gradref got rounded=True without {' and '.join(missing)}: the "
            "rounded reference only widens an error budget against a golden reference, so "
            "write @pytest.mark.gradref(golden=torch.float64, budget=2, rounded=True)"
        )
    check_dtype = kwargs.get("check_dtype", True)
    if not isinstance(check_dtype, bool):
        raise MarkerError(
            f"@pytest.mark.gradref got check_dtype={check_dtype!r}; it must be True or False"
        )
    return TestOverrides(
        strategy=strategy,
        tolerance=tolerance,
        golden=golden,
        budget=budget,
        rounded=rounded,
        check_dtype=check_dtype,
        aux_tolerances=_aux_tolerances(kwargs.get("aux_tolerances")),
    )


def _aux_tolerances(value: object) -> Mapping[AuxKey, Tolerance]:
    """The marker's aux_tolerances, checked as far as they can be before the aux exists: a
    mapping of top-level keys or indices, or item labels, to Tolerance."""
    if value is None:
        return {}
    example = "aux_tolerances={'logps': pytest_gradref.Tolerance(rtol=1e-2, atol=1e-5)}"
    if not isinstance(value, Mapping):
        raise MarkerError(
            f"@pytest.mark.gradref got aux_tolerances={value!r}; it must be a mapping of an "
            f"aux's top-level key or index, or an item's label, to a Tolerance, e.g. {example}"
        )
    for key, tolerance in value.items():
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise MarkerError(
                f"@pytest.mark.gradref got aux_tolerances with key {key!r}; a key is a "
                "top-level key (str) or index (int) of the aux, or an item's label such as "
                f"\"aux['logps'][0]\", e.g. {example}"
            )
        if not isinstance(tolerance, Tolerance):
            raise MarkerError(
                f"@pytest.mark.gradref got aux_tolerances[{key!r}]={tolerance!r}; it must be a "
                f"pytest_gradref.Tolerance(rtol=..., atol=...), e.g. {example}"
            )
    return dict(value)
