"""What one test's references checked and how its strategies disagreed, kept for the report.

``Recording`` is the per-test record the report and the terminal summary read; a Hypothesis
test's record keeps its tightest example. ``Disagreement`` is one crosscheck measurement.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pytest_gradref.compare import ItemCheck
from pytest_gradref.strategies import Strategy


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
    # Per test: the aux items an assert_close(aux=UNCHECKED) left uncompared, by label.
    aux_unchecked: list[str] = field(default_factory=list)
    # The worst finished example while another one runs; None outside an example.
    _kept: tuple[list[ItemCheck], list[Disagreement], list[str]] | None = None

    def add_checks(self, checks: Sequence[ItemCheck]) -> None:
        self._enter_example()
        self.checks.extend(checks)

    def add_reference(self, strategy: str, disagreements: Sequence[Disagreement]) -> None:
        self._enter_example()
        self.strategies.append(strategy)
        self.disagreements.extend(disagreements)

    def add_unchecked_aux(self, labels: Iterable[str]) -> None:
        self.aux_unchecked.extend(label for label in labels if label not in self.aux_unchecked)

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
