"""Coverage that did not happen: tests that ran without the gradref device (declared by no
gradref fixture or marker, and no tensor allocated on it) are counted and named,
``--gradref-strict-device`` fails such a run; under xdist the report says which device each
test ran on.

The simulated npu is process-global, so the runs that install it are subprocesses.
"""

from __future__ import annotations

import json
import re

import pytest
from _forked_runs import runpytest_forked

from pytest_gradref.devices import simulated

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


@pytest.mark.gradref
def test_needs_no_device():
    pass


def infer_device():
    # A third-party suite's own device detection, as transformers' testing utilities do it.
    npu = getattr(torch, "npu", None)
    return "npu" if npu is not None and npu.is_available() else "cpu"


def test_finds_the_device_itself():
    # No gradref fixture or marker: on the simulated npu its tensors land there all the same.
    assert torch.ones(2, device=infer_device()).sum().item() == 2


def test_plain_torch():
    # What an unmodified test file does: its tensors land on the CPU whatever the run says.
    assert torch.ones(1).device.type == "cpu"


def test_no_torch():
    pass
"""

# A second file, so that --dist=loadfile hands each of the two workers one file with a failure.
SECOND = """
import torch


def test_off_by_one(grad_reference, gradref_device):
    x = torch.randn(3, device=gradref_device)
    grad_reference(lambda t: (t * t).sum(), x).assert_close((x * x).sum(), 2 * x + 1)
"""


def failures(stdout: str) -> dict[str, tuple[str, str]]:
    """Per failure section (by the test's name): the xdist worker that ran the test and the
    device its assert_close message names."""
    sections = re.split(r"^_{3,} (\S+) _{3,}$", stdout, flags=re.MULTILINE)
    found = {}
    for name, body in zip(sections[1::2], sections[2::2]):
        worker = re.search(r"^\[(gw\d+)\] ", body, re.MULTILINE)
        device = re.search(
            r"^E\s+AssertionError: Reference mismatch on (\S+) \(", body, re.MULTILINE
        )
        assert worker is not None, body
        assert device is not None, body
        found[name] = (worker[1], device[1])
    return found


@needs_simulation
def test_under_xdist_the_summary_and_report_say_what_ran_where(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mixed=MIXED, test_second=SECOND)
    result = runpytest_forked(
        pytester, "-n", "2", "--dist=loadfile", *SIM, "--gradref-report=report.json"
    )
    result.assert_outcomes(passed=9, failed=2)
    result.stdout.fnmatch_lines(
        [
            "*= gradref device coverage =*",
            "9 tests used the gradref device (npu:0, npu:1; simulated on CPU), 1 of them without "
            "a gradref fixture or marker (they allocated on it); 2 ran without it (no gradref "
            "fixture or marker and no tensor allocated on the device: tests that ran on the CPU "
            "and tests that never touch torch alike; @pytest.mark.gradref with no arguments on "
            "a test that needs no device, or deselecting it, clears --gradref-strict-device)",
            "  without the device: test_mixed.py::test_no_torch",
            "  without the device: test_mixed.py::test_plain_torch",
        ]
    )
    report = json.loads((pytester.path / "report.json").read_text())
    # Each failure names the device its worker took (gw0 npu:0, gw1 npu:1) and the report
    # records; loadfile gives each worker one of the two files, so both devices fail once.
    failed = {
        record["nodeid"].split("::")[1]: record["device"]
        for record in report["tests"]
        if record["outcome"] == "failed"
    }
    assert failed.keys() == {"test_reference[3]", "test_off_by_one"}
    seen = failures(result.stdout.str())
    assert seen.keys() == failed.keys()
    for name, (worker, device) in seen.items():
        assert device == failed[name] == f"npu:{worker.removeprefix('gw')}", name
    assert sorted(failed.values()) == ["npu:0", "npu:1"]
    assert report["device"] == "npu:0"  # the controller's: the session's setting
    assert report["devices"] == ["npu:0", "npu:1"]
    assert {test["device"] for test in report["tests"]} == {"npu:0", "npu:1"}
    coverage = report["device_coverage"]
    assert (coverage["used"], coverage["not_used"], coverage["used_undeclared"]) == (9, 2, 1)
    assert coverage["allocations_counted"] is True
    assert [nodeid.split("::")[1] for nodeid in coverage["not_used_tests"]] == [
        "test_no_torch",
        "test_plain_torch",
    ]


@needs_simulation
def test_strict_device_fails_a_run_that_lost_coverage(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(MIXED)
    result = runpytest_forked(pytester, *SIM, "--gradref-strict-device", "-k", "not 3")
    result.assert_outcomes(passed=9)
    assert result.ret == 7
    result.stdout.fnmatch_lines(
        [
            "--gradref-strict-device: 2 tests ran without the gradref device, so the session "
            "fails (exit status 7). Give them the gradref_device fixture, mark those that need "
            "no device @pytest.mark.gradref, deselect them, or run without "
            "--gradref-strict-device."
        ]
    )
    # From the environment, deselecting the two that ran without it; the test that found the
    # npu itself stays: the run passes.
    monkeypatch.setenv("GRADREF_STRICT_DEVICE", "true")
    passing = runpytest_forked(pytester, *SIM, "-k", "not 3 and not plain and not no_torch")
    passing.assert_outcomes(passed=7)
    assert passing.ret == pytest.ExitCode.OK
    passing.stdout.fnmatch_lines(
        [
            "7 tests used the gradref device (npu:0; simulated on CPU), 1 of them without a "
            "gradref fixture or marker (they allocated on it); 0 ran without it"
        ]
    )


def test_on_the_cpu_nothing_is_lost(pytester: pytest.Pytester) -> None:
    # Plain tensors land on the gradref device there: no section, and strict passes.
    pytester.makeini("[pytest]\ngradref_strict_device = true\n")
    pytester.makepyfile(MIXED)
    result = pytester.runpytest("--gradref-device=cpu", "-k", "not 3", "--gradref-report=r.json")
    result.assert_outcomes(passed=9)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.no_fnmatch_line("*gradref device coverage*")
    coverage = json.loads((pytester.path / "r.json").read_text())["device_coverage"]
    # Nothing is observed on the CPU (it costs nothing there): declared use alone counts.
    assert (coverage["used"], coverage["not_used"], coverage["used_undeclared"]) == (6, 3, 0)
    assert coverage["allocations_counted"] is False


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
