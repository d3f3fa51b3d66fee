"""``--gradref-baseline``: a run's precision against a baseline report, serial and under
xdist, and ``--gradref-baseline-fail``'s exit status."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_gradref.config.settings import BASELINE_REGRESSION_EXIT
from pytest_gradref.report.device_coverage import DeviceCoverage
from pytest_gradref.report.diff import Report, compare_reports, parse_report
from pytest_gradref.report.writer import ReportCollector

# A kernel whose gradient is off by a relative error the environment sets: the test passes at
# 2.5e-8 and at 1e-7 (float64's default tolerance is rtol = atol = 1e-7), but its error, some
# 10^8 rounding steps of float64 at the gradient's scale, grows fourfold. KERNEL_CHECKS=2
# compares a second time: items the baseline (written with one) lacks.
SKEWED_KERNEL = """
import os

import pytest
import torch


def loss(x, w):
    return torch.tanh(x @ w).square().sum()


@pytest.mark.parametrize("n", [3, 5, 7])
def test_kernel(grad_reference, n):
    x = torch.randn(n, 4, dtype=torch.float64)
    w = torch.randn(4, 2, dtype=torch.float64)
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = loss(xx, ww)
    out.backward()
    skew = float(os.environ.get("KERNEL_SKEW", "2.5e-8"))
    for _ in range(int(os.environ.get("KERNEL_CHECKS", "1"))):
        ref.assert_close(out, (xx.grad * (1 + skew), ww.grad))
"""


@pytest.fixture
def baseline(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> str:
    """The suite's report at a skew of 2.5e-8, as the baseline."""
    pytester.makepyfile(test_kernels=SKEWED_KERNEL)
    monkeypatch.setenv("KERNEL_SKEW", "2.5e-8")
    pytester.runpytest("--gradref-device=cpu", "--gradref-report=base.json").assert_outcomes(
        passed=3
    )
    return str(pytester.path / "base.json")


def test_unchanged_kernel_has_no_regression(pytester: pytest.Pytester, baseline: str) -> None:
    result = pytester.runpytest(
        "--gradref-device=cpu", f"--gradref-baseline={baseline}", "--gradref-baseline-fail"
    )
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(
        ["*gradref baseline*", "against *base.json: 9 items compared, 0 regressions*"]
    )


@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "2"]], ids=["serial", "xdist"])
def test_fourfold_error_growth_is_named(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, baseline: str, workers: list[str]
) -> None:
    monkeypatch.setenv("KERNEL_SKEW", "1e-7")
    args = ["--gradref-device=cpu", f"--gradref-baseline={baseline}", *workers]
    result = pytester.runpytest(*args)
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.OK  # named, but the session does not fail
    result.stdout.fnmatch_lines(
        [
            "against *base.json: 9 items compared, 3 regressions (error grown beyond 2x; errors"
            " within 4 rounding steps of their dtype at their scale count as noise; a"
            " half-precision item's normwise error drifts when it grows past 6 sigmas of its"
            " rounding noise)",
        ]
    )
    # Worst first: their order depends on the drawn numbers. The skew scales every element
    # alike, so the greatest and the normwise error grow alike, and the verdict names the one
    # a rounding made the larger.
    for n in (3, 5, 7):
        result.stdout.re_match_lines(
            [
                rf"  test_kernels.py::test_kernel\[{n}\]: gradient of argument 0 \(x\) "
                r"\(float64\): (normwise )?error grew 4x, \S+ -> \S+$"
            ]
        )
    assert "gradient of argument 1" not in result.stdout.str().split("gradref baseline")[-1]
    failing = pytester.runpytest(*args, "--gradref-baseline-fail")
    failing.assert_outcomes(passed=3)
    assert failing.ret == BASELINE_REGRESSION_EXIT
    failing.stdout.fnmatch_lines(["*3 regressions*; the session fails (exit status 6)"])
    # A looser threshold lets the same growth pass.
    loose = pytester.runpytest(*args, "--gradref-baseline-fail", "--gradref-baseline-threshold=5")
    assert loose.ret == pytest.ExitCode.OK


def test_missing_tests_are_listed(pytester: pytest.Pytester, baseline: str) -> None:
    result = pytester.runpytest(
        "--gradref-device=cpu", f"--gradref-baseline={baseline}", "-k", "not 7"
    )
    result.assert_outcomes(passed=2, deselected=1)
    result.stdout.fnmatch_lines(["*missing from this run: test_kernels.py::test_kernel[[]7[]]"])


def test_failed_test_is_a_regression_that_fails_the_session(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, baseline: str
) -> None:
    # A test that fails already fails the session: its own status stays.
    monkeypatch.setenv("KERNEL_SKEW", "1e-3")
    result = pytester.runpytest(
        "--gradref-device=cpu", f"--gradref-baseline={baseline}", "--gradref-baseline-fail"
    )
    result.assert_outcomes(failed=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*3 regressions*", "*now fails*"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gradref-baseline=absent.json"], "*--gradref-baseline: absent.json: cannot read it*"),
        (
            ["--gradref-baseline=base.json", "--gradref-baseline-threshold=0.5"],
            "*--gradref-baseline-threshold must be a number >= 1, got 0.5*",
        ),
        (
            ["--gradref-baseline=base.json", "--gradref-baseline-threshold=nan"],
            "*--gradref-baseline-threshold must be a number >= 1, got nan*",
        ),
    ],
    # Another seed is judged by the inputs' fingerprints: test_suite_seeding.py.
    ids=["unreadable", "threshold", "nan-threshold"],
)
def test_unusable_baseline_is_a_usage_error(
    pytester: pytest.Pytester, baseline: str, args: list[str], message: str
) -> None:
    result = pytester.runpytest("--gradref-device=cpu", *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_every_registered_plugin_object_is_hashable(
    pytester: pytest.Pytester, baseline: str
) -> None:
    # pytest 8.0 hashes each registered plugin object (a dataclass with eq is unhashable and
    # crashed the session there); later releases do not, so the main env checks it directly.
    config = pytester.parseconfigure(
        "-p",
        "xdist",
        "--gradref-device=cpu",
        "--gradref-report=r.json",
        f"--gradref-baseline={baseline}",
    )
    ours = {
        name: plugin
        for name, plugin in config.pluginmanager.list_name_plugin()
        if name.startswith("gradref")
    }
    assert {"gradref-report", "gradref-baseline", "gradref-xdist"} <= set(ours)
    for name, plugin in ours.items():
        assert isinstance(hash(plugin), int), name


@pytest.mark.parametrize(
    "gate_option", ["--gradref-baseline-fail", "--gradref-baseline-threshold=3"]
)
def test_a_gate_option_without_a_baseline_is_a_usage_error(
    pytester: pytest.Pytester, gate_option: str
) -> None:
    pytester.makepyfile(test_kernels=SKEWED_KERNEL)
    result = pytester.runpytest("--gradref-device=cpu", gate_option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    flag = gate_option.split("=")[0]
    result.stderr.fnmatch_lines(
        [
            f"ERROR: {flag} needs --gradref-baseline=BASE.json, the report to "
            f"compare the run with; add --gradref-baseline, or drop {flag}"
        ]
    )
    result.stdout.no_fnmatch_line("*passed*")


OTHER_SUITE = """
import torch


def test_other(grad_reference):
    x = torch.randn(4, dtype=torch.float64)
    grad_reference(lambda t: t.exp().sum(), x).assert_close(x.exp().sum(), x.exp())


def test_plain():
    pass
"""
# A suite whose test computes a reference and compares nothing: its record holds no item.
COMPARES_NOTHING = """
import torch


def test_reference_only(grad_reference):
    grad_reference(lambda t: t.exp().sum(), torch.randn(4, dtype=torch.float64))
"""


@pytest.mark.parametrize(
    ("run", "why"),
    [
        (
            ["test_other.py"],
            "no test in common: *base.json holds 3 tests (e.g. test_kernels.py::test_kernel[[]3[]]"
            "), this run 1 test (e.g. test_other.py::test_other); compare reports of the same "
            "suite, written from the same rootdir (node ids are relative to it)",
        ),
        (
            ["test_other.py", "-k", "plain"],
            "this run holds no test record (no test in it used grad_reference); compare reports "
            "of runs whose tests check references",
        ),
    ],
    ids=["no-test-in-common", "no-test-recorded"],
)
def test_a_baseline_that_judges_nothing_fails_the_gate(
    pytester: pytest.Pytester, baseline: str, run: list[str], why: str
) -> None:
    pytester.makepyfile(test_other=OTHER_SUITE)
    args = ["--gradref-device=cpu", f"--gradref-baseline={baseline}", *run]
    failing = pytester.runpytest(*args, "--gradref-baseline-fail")
    assert failing.ret == BASELINE_REGRESSION_EXIT
    failing.stdout.fnmatch_lines(
        [f"WARNING: nothing judged against *base.json: {why}; the session fails (exit status 6)"]
    )
    # Without -fail the run passes, and says that nothing was judged: never "0 regressions".
    warned = pytester.runpytest(*args)
    assert warned.ret == pytest.ExitCode.OK
    warned.stdout.fnmatch_lines(
        [
            f"WARNING: nothing judged against *base.json: {why}; this run's precision went "
            "unchecked (--gradref-baseline-fail fails it)"
        ]
    )
    assert "regressions" not in warned.stdout.str()


@pytest.mark.parametrize(
    "selection", [["-k", "nomatch"], ["empty"]], ids=["k-nomatch", "empty-dir"]
)
def test_a_gated_run_that_collects_nothing_exits_6(
    pytester: pytest.Pytester, baseline: str, selection: list[str]
) -> None:
    # pytest's own status would be 5 (no tests collected), which CI scripts often accept: the
    # gate's status replaces it, as the line says.
    pytester.mkdir("empty")
    result = pytester.runpytest(
        "--gradref-device=cpu",
        f"--gradref-baseline={baseline}",
        "--gradref-baseline-fail",
        *selection,
    )
    assert result.ret == BASELINE_REGRESSION_EXIT
    result.stdout.fnmatch_lines(
        ["WARNING: nothing judged against *base.json: *; the session fails (exit status 6)"]
    )
    # Ungated, the run keeps pytest's own status.
    warned = pytester.runpytest(
        "--gradref-device=cpu", f"--gradref-baseline={baseline}", *selection
    )
    assert warned.ret == pytest.ExitCode.NO_TESTS_COLLECTED


def test_tests_in_common_without_items_fail_the_gate(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_compares_nothing=COMPARES_NOTHING)
    pytester.runpytest("--gradref-device=cpu", "--gradref-report=base.json").assert_outcomes(
        passed=1
    )
    result = pytester.runpytest(
        "--gradref-device=cpu", "--gradref-baseline=base.json", "--gradref-baseline-fail"
    )
    result.assert_outcomes(passed=1)
    assert result.ret == BASELINE_REGRESSION_EXIT
    result.stdout.fnmatch_lines(
        [
            "WARNING: nothing judged against base.json: 1 test in common, but no item in both "
            "(e.g. test_compares_nothing.py::test_reference_only: 0 in base.json, 0 in this run); "
            "a test records an item for each value it compares (assert_close), none where it "
            "fails, skips or returns before comparing: let those tests compare; the session "
            "fails (exit status 6)"
        ]
    )


@pytest.mark.parametrize("refresh", ["bash scripts/refresh_precision_baseline.sh", None])
def test_tests_and_items_the_baseline_lacks_fail_the_gate(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, baseline: str, refresh: str | None
) -> None:
    # A test the baseline lacks (test_other) and, in each kernel test, a second comparison's
    # items: no change of theirs could be judged, so a gate that let them by would pass on them
    # unseen. test_plain records nothing and is not named.
    pytester.makepyfile(test_other=OTHER_SUITE)
    if refresh is not None:
        pytester.makeini(f"[pytest]\ngradref_baseline_refresh = {refresh}\n")
        hint = f"refresh the baseline with `{refresh}` and commit it"
    else:
        hint = (
            f"write the baseline again from this suite with --gradref-report={baseline} (set the "
            "gradref_baseline_refresh ini key to name the project's refresh command)"
        )
    monkeypatch.setenv("KERNEL_CHECKS", "2")
    args = ["--gradref-device=cpu", f"--gradref-baseline={baseline}"]
    ungated = [
        "  not in the baseline: test_other.py::test_other",
        *(
            f"  not in the baseline: test_kernels.py::test_kernel[[]{n}[]]: {label} #2"
            for n in (3, 5, 7)
            for label in ("value", "gradient of argument 0 (x)", "gradient of argument 1 (w)")
        ),
    ]
    failing = pytester.runpytest(*args, "--gradref-baseline-fail")
    failing.assert_outcomes(passed=5)
    assert failing.ret == BASELINE_REGRESSION_EXIT
    failing.stdout.fnmatch_lines(
        [
            "against *base.json: 9 items compared, 0 regressions *",
            "10 tests or items of this run are not in the baseline, so no change of theirs is "
            f"gated: {hint}; the session fails (exit status 6)",
            *ungated,
        ]
    )
    assert "test_plain" not in failing.stdout.str().split("gradref baseline")[-1]
    # Without -fail the run passes, and the same lines say what went ungated.
    warned = pytester.runpytest(*args)
    warned.assert_outcomes(passed=5)
    assert warned.ret == pytest.ExitCode.OK
    warned.stdout.fnmatch_lines(
        [
            "10 tests or items of this run are not in the baseline, so no change of theirs is "
            f"gated: {hint}",
            *ungated,
        ]
    )
    assert "the session fails" not in warned.stdout.str()


def test_a_test_that_records_no_items_is_not_ungated(
    pytester: pytest.Pytester, baseline: str
) -> None:
    # A new test that computes a reference and compares nothing (a record without items), and
    # one that never asks for a reference (no record): neither has a change to gate.
    pytester.makepyfile(test_compares_nothing=COMPARES_NOTHING, test_other=OTHER_SUITE)
    result = pytester.runpytest(
        "--gradref-device=cpu",
        f"--gradref-baseline={baseline}",
        "--gradref-baseline-fail",
        "-k",
        "kernel or reference_only or plain",
    )
    result.assert_outcomes(passed=5, deselected=1)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["against *base.json: 9 items compared, 0 regressions *"])
    assert "not in the baseline" not in result.stdout.str()


def test_a_launched_runs_records_gate_as_one(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, baseline: str
) -> None:
    """Under a launcher rank 0 merges every rank's records (merge_ranks) before its report and
    gate read them: a regression on rank 1 alone is one, named by its rank."""
    monkeypatch.setenv("KERNEL_SKEW", "1e-7")
    pytester.runpytest("--gradref-device=cpu", "--gradref-report=grown.json").assert_outcomes(
        passed=3
    )
    base = json.loads(Path(baseline).read_text())
    grown = json.loads((pytester.path / "grown.json").read_text())

    def launched(by_rank: list[list[dict[str, Any]]]) -> Report:
        collector = ReportCollector(None, base["base_seed"], DeviceCoverage(strict=False))
        collector.merge_ranks(by_rank, ["cpu"] * len(by_rank))
        assert collector.world_size == len(by_rank)
        return parse_report({**base, "world_size": 2, "tests": collector.tests()}, "run")

    diff = compare_reports(
        launched([base["tests"], base["tests"]]), launched([base["tests"], grown["tests"]])
    )
    assert len(diff.items) == 18  # 9 items on each of two ranks
    regressed = {(item.nodeid, item.label) for item in diff.regressions}
    assert regressed == {
        (f"test_kernels.py::test_kernel[{n}]", "rank 1: gradient of argument 0 (x)")
        for n in (3, 5, 7)
    }
    # A test one rank failed is failed in the merged record; the ranks are listed.
    failed = [dict(record, outcome="failed") for record in base["tests"]]
    record = launched([base["tests"], failed]).tests["test_kernels.py::test_kernel[3]"]
    assert (record["outcome"], record["ranks"]) == ("failed", [0, 1])
