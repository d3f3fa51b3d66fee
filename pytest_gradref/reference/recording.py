"""What one test's references checked and how its strategies disagreed, kept for the report.

``Recording`` is the per-test record the report and the terminal summary read; a Hypothesis
test's record keeps its tightest example. ``Disagreement`` is one crosscheck measurement.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytest_gradref.config.strategies import Strategy
from pytest_gradref.verdict.checks import ItemCheck

if TYPE_CHECKING:
    from pytest_gradref.reference.inputs import SampledInputs


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
    An example's inputs come from Hypothesis, not from torch's seed, and which one is kept
    depends on the kernel's errors: its references get no fingerprint (the diff falls back to
    the seeds for them, as before fingerprints).
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
    # The seed gradref gave torch's generators for this test (None where seeding is off), the
    # device family whose generators it seeded, and whether references' inputs are sampled
    # for a fingerprint (where a report or a baseline compares them).
    seed: int | None = None
    device_type: str = "cpu"
    fingerprint: bool = False
    # Per test: the seed torch's generators held when the references were computed (the
    # first one that is not gradref's, where a generator was reseeded), and whether one was
    # reseeded after gradref seeded it (None where gradref did not seed).
    torch_seed: int | None = None
    reseeded: bool | None = None
    # Each reference's sampled inputs, in order (None: no fingerprint).
    inputs: list[SampledInputs | None] = field(default_factory=list)
    # The ranks whose items the record holds, each labelled "rank r: ..." (a multi-rank
    # test's); None for a test that ran in one process.
    ranks: list[int] | None = None
    # The worst finished example while another one runs; None outside an example.
    _kept: (
        tuple[list[ItemCheck], list[Disagreement], list[str], list[SampledInputs | None]] | None
    ) = None

    def add_checks(self, checks: Sequence[ItemCheck]) -> None:
        self._enter_example()
        self.checks.extend(checks)

    def add_reference(self, strategy: str, disagreements: Sequence[Disagreement]) -> None:
        self._enter_example()
        self.strategies.append(strategy)
        self.disagreements.extend(disagreements)

    def add_unchecked_aux(self, labels: Iterable[str]) -> None:
        self.aux_unchecked.extend(label for label in labels if label not in self.aux_unchecked)

    def add_inputs(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> None:
        """A reference computed from these inputs: torch's seeds now, and its inputs sampled
        for a fingerprint where one is wanted (outside a Hypothesis example)."""
        from pytest_gradref.reference.inputs import generator_seeds, sample_inputs

        self._enter_example()
        seeds = generator_seeds(self.device_type)
        moved = [seed for seed in seeds if seed != self.seed] if self.seed is not None else []
        if self.torch_seed is None or (moved and not self.reseeded):
            self.torch_seed = moved[0] if moved else seeds[0]
        if self.seed is not None:
            self.reseeded = bool(self.reseeded or moved)
        in_example = self._kept is not None
        sampled = sample_inputs(fn, args, kwargs) if self.fingerprint and not in_example else None
        self.inputs.append(sampled)

    def _enter_example(self) -> None:
        from pytest_gradref.reference.hypothesis_examples import call_at_example_end

        if self._kept is None and call_at_example_end(self._leave_example):
            self._kept = (self.checks, self.disagreements, self.strategies, self.inputs)
            self.checks, self.disagreements, self.strategies, self.inputs = [], [], [], []

    def _leave_example(self) -> None:
        kept, self._kept = self._kept, None
        if kept is not None and kept[0] and _tightness(kept[0]) < _tightness(self.checks):
            self.checks, self.disagreements, self.strategies, self.inputs = kept


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
