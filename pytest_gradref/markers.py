"""The gradref markers: their registration lines, parsing and validation.

Device markers become real ``xfail`` / ``skip`` marks during collection, so the report says
xfailed and skipped (never a pass that swallowed an exception).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import pytest

from pytest_gradref.compare import ToleranceOverride
from pytest_gradref.reference import STRATEGY_CHOICES, StrategyChoice

MARKER_LINES = (
    "gradref_xfail(*devices, reason, raises=None, strict=False): expect the test to fail "
    "when the active gradref backend is one of devices.",
    "gradref_skip(*devices, reason): skip the test when the active gradref backend is one "
    "of devices.",
    "gradref_only(*devices, reason=None): run the test only when the active gradref backend "
    "is one of devices.",
    "gradref(strategy=None, rtol=None, atol=None): per-test reference strategy and "
    "tolerance overrides.",
)
DEVICE_MARKERS = ("gradref_xfail", "gradref_skip", "gradref_only")
ALL_MARKERS = (*DEVICE_MARKERS, "gradref")

_KEYWORDS: dict[str, tuple[str, ...]] = {
    "gradref_xfail": ("reason", "raises", "strict"),
    "gradref_skip": ("reason",),
    "gradref_only": ("reason",),
    "gradref": ("strategy", "rtol", "atol"),
}
_REQUIRED: dict[str, tuple[str, ...]] = {"gradref_xfail": ("reason",), "gradref_skip": ("reason",)}


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


def device_mark(
    mark: pytest.Mark, known: Collection[str], active: str
) -> pytest.MarkDecorator | None:
    """The xfail/skip mark a device marker stands for on ``active``, or None."""
    _check_keywords(mark)
    devices = mark.args
    if not devices:
        raise MarkerError(f"@pytest.mark.{mark.name} needs at least one device name")
    for device in devices:
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
        if not applies:
            return None
        strict = mark.kwargs.get("strict", False)
        if not isinstance(strict, bool):
            raise MarkerError(f"@pytest.mark.gradref_xfail: strict must be a bool, got {strict!r}")
        return pytest.mark.xfail(
            reason=f"[gradref {active}] {reason}", raises=mark.kwargs.get("raises"), strict=strict
        )
    if mark.name == "gradref_skip":
        return pytest.mark.skip(reason=f"[gradref {active}] {reason}") if applies else None
    if applies:
        return None
    default = f"runs only on {', '.join(devices)}"
    return pytest.mark.skip(
        reason=f"[gradref {active}] {reason or default} (active backend: {active})"
    )


@dataclass(frozen=True)
class TestOverrides:
    """What a ``gradref(...)`` marker sets for one test."""

    strategy: StrategyChoice | None = None
    tolerance: ToleranceOverride | None = None


def parse_gradref_mark(mark: pytest.Mark | None) -> TestOverrides:
    if mark is None:
        return TestOverrides()
    _check_keywords(mark)
    if mark.args:
        raise MarkerError("@pytest.mark.gradref takes keywords only: strategy=, rtol=, atol=")
    strategy: Any = mark.kwargs.get("strategy")
    if strategy is not None and strategy not in STRATEGY_CHOICES:
        raise MarkerError(
            f"@pytest.mark.gradref got strategy={strategy!r}; valid values are "
            f"{', '.join(STRATEGY_CHOICES)}"
        )
    tolerance = None
    rtol, atol = mark.kwargs.get("rtol"), mark.kwargs.get("atol")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
        ):
            raise MarkerError(
                f"@pytest.mark.gradref got {name}={value!r}; it must be a number >= 0"
            )
    if rtol is not None or atol is not None:
        tolerance = ToleranceOverride(rtol, atol, "the test's @pytest.mark.gradref marker")
    return TestOverrides(strategy=strategy, tolerance=tolerance)
