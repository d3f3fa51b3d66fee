"""Precision against a baseline report during a run: ``--gradref-baseline=BASE.json``.

At the end of the session (on the xdist controller, which holds every test's records) the
run's report is compared item by item with the baseline, as ``pytest-gradref diff`` compares
two files: the terminal summary names the items whose error grew beyond the threshold, and
``--gradref-baseline-fail`` makes them fail the session with its own exit status. A baseline
that judged nothing (no test in common, or no item) is never a pass: the summary warns, and
``--gradref-baseline-fail`` fails the session with the same status.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from pytest_gradref.config.settings import BASELINE_REFRESH_INI, BASELINE_REGRESSION_EXIT, Settings
from pytest_gradref.config.state import is_xdist_worker
from pytest_gradref.report.diff import (
    INPUTS_FORMAT,
    Diff,
    Report,
    UnusableInput,
    compare_reports,
    load_report,
    parse_report,
)
from pytest_gradref.report.diff_output import noise_phrase
from pytest_gradref.report.writer import ReportCollector


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
    # The project's command that writes the baseline again (the gradref_baseline_refresh ini
    # key), named where the run has items the baseline lacks.
    refresh: str = ""

    @classmethod
    def from_settings(cls, settings: Settings, collector: ReportCollector) -> BaselineGate:
        """The gate of this run (``settings.baseline`` names the baseline, and
        ``read_settings`` validated the threshold); a usage error for an unusable baseline."""
        path = settings.baseline
        assert path is not None, "a gate needs --gradref-baseline"
        try:
            baseline = load_report(path)
        except UnusableInput as error:
            raise pytest.UsageError(f"--gradref-baseline: {error}") from None
        # A baseline with input fingerprints is judged by them at the end, whatever the seeds
        # (a suite that seeds its own tests draws the same numbers under any seed); an older
        # one by its base seed, before any test runs.
        if baseline.format_version < INPUTS_FORMAT and baseline.base_seed != collector.base_seed:
            used = "seeding off" if collector.base_seed is None else collector.base_seed
            raise pytest.UsageError(
                f"--gradref-baseline: {path} was written with base seed {baseline.base_seed}, "
                f"this run uses {used}: the tests draw other numbers, so their "
                f"errors are not comparable; run with --gradref-seed={baseline.base_seed} or "
                "write the baseline again"
            )
        return cls(
            baseline,
            collector,
            settings.baseline_threshold,
            settings.baseline_fail,
            refresh=settings.baseline_refresh,
        )

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if is_xdist_worker(session.config):
            return
        run = {**self.collector.run_fields(session.config), "tests": self.collector.tests()}
        try:
            self.diff = compare_reports(
                self.baseline, parse_report(run, "this run"), threshold=self.threshold
            )
        except UnusableInput as error:
            self.problem = str(error)
        if self.diff is not None and not self.problem:
            self.problem = self.diff.nothing_compared()
        failed = self.problem or (
            self.diff is not None and (self.diff.regressions or self.ungated())
        )
        # A run that collected nothing judged nothing: pytest's "no tests collected" (5),
        # which CI scripts often accept, becomes the gate's failure too.
        judged_status = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if self.fail and failed and session.exitstatus in judged_status:
            session.exitstatus = BASELINE_REGRESSION_EXIT

    def ungated(self) -> list[str]:
        """The tests and items this run recorded that the baseline lacks: no change of theirs
        can be judged, so a gate that let them by would pass on them unseen."""
        if self.diff is None:
            return []
        with_items = {r["nodeid"] for r in self.collector.tests() if r.get("items")}
        return [
            missing.describe()
            for missing in self.diff.only_in_new
            if missing.label is not None or missing.nodeid in with_items
        ]

    def refresh_hint(self) -> str:
        """How to write the baseline again: the project's own command (the ini key) or the
        option that writes it."""
        if self.refresh:
            return f"refresh the baseline with `{self.refresh}` and commit it"
        return (
            f"write the baseline again from this suite with --gradref-report={self.baseline.path} "
            f"(set the {BASELINE_REFRESH_INI} ini key to name the project's refresh command)"
        )

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        terminalreporter.section("gradref baseline")
        markup = {"red" if self.fail else "yellow": True} if self.problem else {}
        for line in self.summary_lines():
            terminalreporter.write_line(line, **markup)

    def summary_lines(self) -> list[str]:
        source = self.baseline.path
        if self.problem:  # nothing was judged: never a line that reads as a pass
            consequence = (
                f"the session fails (exit status {BASELINE_REGRESSION_EXIT})"
                if self.fail
                else "this run's precision went unchecked (--gradref-baseline-fail fails it)"
            )
            return [f"WARNING: nothing judged against {source}: {self.problem}; {consequence}"]
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
        ungated = self.ungated()
        if ungated:
            consequence = (
                f"; the session fails (exit status {BASELINE_REGRESSION_EXIT})" if self.fail else ""
            )
            lines.append(
                f"{len(ungated)} tests or items of this run are not in the baseline, so no "
                f"change of theirs is gated: {self.refresh_hint()}{consequence}"
            )
            shown = 10
            lines += [f"  not in the baseline: {name}" for name in ungated[:shown]]
            if len(ungated) > shown:
                lines.append(f"  ... and {len(ungated) - shown} more")
        return lines
