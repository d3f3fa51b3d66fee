"""Coverage that did not happen: tests that ran without the gradref device are counted and
named, ``--gradref-strict-device`` fails such a run; under xdist the report says which device
each test ran on.

The simulated npu is process-global, so the runs that install it are subprocesses.
"""

from __future__ import annotations

import json

import pytest

from pytest_gradref import simulated

SIM = ("--gradref-simulate=npu", "--gradref-device=npu")
# Skipped, with the reason, where torch is too old for the simulation (CI's lower bounds).
needs_simulation = pytest.mark.skipif(
    simulated.unsupported_reason() is not None, reason=str(simulated.unsupported_reason())
)

MIXED = """
import pytest
import torch


@pytest.mark.parametrize("i", range(4))
def test_reference(i, grad_reference, gradref_device):
    x = torch.randn(3, device=gradref_device)
    ref = grad_reference(lambda t: (t * t).sum(), x)
    ref.assert_close((x * x).sum(), 2 * x + (i == 3))  # the last one is off by one


def test_device_only(gradref_device):
    assert torch.ones(1, device=gradref_device).device == gradref_device


@pytest.mark.gradref_skip("cuda", reason="a marker alone counts as using the device")
def test_marker_only():
    pass


def test_plain_torch():
    # What an unmodified test file does: its tensors land on the CPU whatever the run says.
    assert torch.ones(1).device.type == "cpu"


def test_no_torch():
    pass
"""


@needs_simulation
def test_under_xdist_the_summary_and_report_say_what_ran_where(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(MIXED)
    result = pytester.runpytest_subprocess("-n", "2", *SIM, "--gradref-report=report.json")
    result.assert_outcomes(passed=7, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*= gradref device coverage =*",
            "6 tests used the gradref device (npu:0, npu:1; simulated on CPU); 2 ran without "
            "it (no gradref fixture or marker: *)",
            "  without the device: test_under_xdist_*.py::test_no_torch",
            "  without the device: test_under_xdist_*.py::test_plain_torch",
        ]
    )
    # The failure names the device the test ran on, wherever the worker put it.
    result.stdout.re_match_lines([r"E\s+AssertionError: Reference mismatch on npu:[01] \(npu "])
    report = json.loads((pytester.path / "report.json").read_text())
    assert report["device"] == "npu:0"  # the controller's: the session's setting
    assert report["devices"] == ["npu:0", "npu:1"]
    assert {test["device"] for test in report["tests"]} <= {"npu:0", "npu:1"}
    coverage = report["device_coverage"]
    assert (coverage["used"], coverage["not_used"]) == (6, 2)
    assert [nodeid.split("::")[1] for nodeid in coverage["not_used_tests"]] == [
        "test_no_torch",
        "test_plain_torch",
    ]


@needs_simulation
def test_strict_device_fails_a_run_that_lost_coverage(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(MIXED)
    result = pytester.runpytest_subprocess(*SIM, "--gradref-strict-device", "-k", "not 3")
    result.assert_outcomes(passed=7)
    assert result.ret == 7
    result.stdout.fnmatch_lines(
        [
            "--gradref-strict-device: 2 tests ran without the gradref device, so the session "
            "fails (exit status 7). Give them the gradref_device fixture (or a gradref marker), "
            "deselect them, or run without --gradref-strict-device."
        ]
    )
    # From the environment, deselecting the two: the run passes.
    monkeypatch.setenv("GRADREF_STRICT_DEVICE", "true")
    passing = pytester.runpytest_subprocess(*SIM, "-k", "not 3 and not plain and not no_torch")
    passing.assert_outcomes(passed=5)
    assert passing.ret == pytest.ExitCode.OK
    passing.stdout.fnmatch_lines(["5 tests used the gradref device (npu:0; *); 0 ran without it *"])


def test_on_the_cpu_nothing_is_lost(pytester: pytest.Pytester) -> None:
    # Plain tensors land on the gradref device there: no section, and strict passes.
    pytester.makeini("[pytest]\ngradref_strict_device = true\n")
    pytester.makepyfile(MIXED)
    result = pytester.runpytest("--gradref-device=cpu", "-k", "not 3", "--gradref-report=r.json")
    result.assert_outcomes(passed=7)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.no_fnmatch_line("*gradref device coverage*")
    coverage = json.loads((pytester.path / "r.json").read_text())["device_coverage"]
    assert (coverage["used"], coverage["not_used"]) == (5, 2)


def test_a_bad_strict_value_names_its_source(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADREF_STRICT_DEVICE", "maybe")
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: Invalid value 'maybe' from the GRADREF_STRICT_DEVICE environment variable; "
            "valid values are true, 1, yes, false, 0, no"
        ]
    )
