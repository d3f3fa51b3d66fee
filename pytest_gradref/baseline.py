"""Precision against a baseline report during a run: ``--gradref-baseline=BASE.json``.

At the end of the session (on the xdist controller, which holds every test's records) the
run's report is compared item by item with the baseline, as ``pytest-gradref diff`` compares
two files: the terminal summary names the items whose error grew beyond the threshold, and
``--gradref-baseline-fail`` makes them fail the session with its own exit status.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from pytest_gradref.diff import (
    DEFAULT_THRESHOLD,
    MIN_THRESHOLD,
    Diff,
    Report,
    UnusableInput,
    compare,
    load_report,
    parse_report,
)
from pytest_gradref.diff_output import noise_phrase
from pytest_gradref.numbers import number_problem
from pytest_gradref.report import ReportCollector
from pytest_gradref.settings import (
    BASELINE_FAIL_OPTION,
    BASELINE_OPTION,
    BASELINE_REGRESSION_EXIT,
    BASELINE_THRESHOLD_OPTION,
)
from pytest_gradref.state import is_xdist_worker


# eq=False keeps the identity hash: pluggy keys registered plugins by their hash (pytest 8.0
# hashes them when it parses their fixtures), and a dataclass with eq is unhashable.
@dataclass(eq=False)
class BaselineGate:
    """A plugin object: the baseline, read when the run starts, and its comparison with the
    run's records at the end."""

    baseline: Report
    collector: ReportCollector
    threshold: float
    fail: bool
    diff: Diff | None = None
    problem: str = ""

    @classmethod
    def from_config(cls, config: pytest.Config, collector: ReportCollector) -> BaselineGate:
        """The gate of this run; a usage error for an unusable baseline or threshold."""
        path = config.getoption(BASELINE_OPTION.dest)
        threshold = config.getoption(BASELINE_THRESHOLD_OPTION.dest)
        if threshold is None:
            threshold = DEFAULT_THRESHOLD
        problem = number_problem(threshold, minimum=MIN_THRESHOLD)
        if problem is not None:
            raise pytest.UsageError(f"--gradref-baseline-threshold {problem}, got {threshold:g}")
        try:
            baseline = load_report(path)
        except UnusableInput as error:
            raise pytest.UsageError(f"--gradref-baseline: {error}") from None
        if baseline.base_seed != collector.base_seed:
            raise pytest.UsageError(
                f"--gradref-baseline: {path} was written with base seed {baseline.base_seed}, "
                f"this run uses {collector.base_seed}: the tests draw other numbers, so their "
                f"errors are not comparable; run with --gradref-seed={baseline.base_seed} or "
                "write the baseline again"
            )
        return cls(
            baseline, collector, threshold, bool(config.getoption(BASELINE_FAIL_OPTION.dest))
        )

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if is_xdist_worker(session.config):
            return
        run = {**self.collector.run_fields(session.config), "tests": self.collector.tests()}
        try:
            self.diff = compare(
                self.baseline, parse_report(run, "this run"), threshold=self.threshold
            )
        except UnusableInput as error:
            self.problem = str(error)
        failed = self.problem or (self.diff is not None and self.diff.regressions)
        if self.fail and failed and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = BASELINE_REGRESSION_EXIT

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        terminalreporter.section("gradref baseline")
        for line in self.summary_lines():
            terminalreporter.write_line(line)

    def summary_lines(self) -> list[str]:
        source = self.baseline.path
        if self.problem:
            return [f"not compared with {source}: {self.problem}"]
        if self.diff is None:
            return []
        diff = self.diff
        regressions = diff.regressions
        lines = [
            f"against {source}: {len(diff.items)} items compared, {len(regressions)} "
            f"{'regression' if len(regressions) == 1 else 'regressions'} (error grown beyond "
            f"{diff.threshold:g}x; {noise_phrase(diff.noise)})"
            + (
                f"; the session fails (exit status {BASELINE_REGRESSION_EXIT})"
                if regressions and self.fail
                else ""
            )
        ]
        for item in regressions:
            lines.append(
                f"  {item.nodeid}: {item.label} ({item.dtype}): {item.regression}, "
                f"{item.before:.3g} -> {item.after:.3g}"
            )
        for missing in diff.only_in_base:
            lines.append(f"  missing from this run: {missing.describe()}")
        return lines
