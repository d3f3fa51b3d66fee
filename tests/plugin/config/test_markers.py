"""The device markers on an active and on an inactive backend, and marker misuse.

Device markers must become real xfail / skip marks: the report says xfailed and skipped, with
the reason, and an xfail that is not met is reported like pytest's own xfail would be.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

MARKED = """
import pytest


@pytest.mark.gradref_xfail("{active}", reason="known {active} bug")
def test_xfail_active():
    assert False


@pytest.mark.gradref_xfail("{inactive}", reason="known {inactive} bug")
def test_xfail_inactive_passes():
    pass


@pytest.mark.gradref_xfail("{inactive}", reason="known {inactive} bug")
def test_xfail_inactive_really_fails():
    assert False, "runs as a plain test where the backend is not listed"


@pytest.mark.gradref_xfail("{inactive}", "{active}", reason="listed among others")
def test_xfail_several_devices():
    assert False


@pytest.mark.gradref_xfail("{active}", reason="not actually broken")
def test_xfail_active_xpasses():
    pass


@pytest.mark.gradref_xfail("{active}", reason="strict", strict=True)
def test_xfail_strict_xpass_fails():
    pass


@pytest.mark.gradref_xfail("{active}", reason="raises ValueError", raises=ValueError)
def test_xfail_raises_matching():
    raise ValueError("expected")


@pytest.mark.gradref_xfail("{active}", reason="raises ValueError", raises=ValueError)
def test_xfail_raises_other_exception_fails():
    raise TypeError("not the expected exception")


@pytest.mark.gradref_skip("{active}", reason="crashes the {active} driver")
def test_skip_active():
    assert False


@pytest.mark.gradref_skip("{inactive}", reason="crashes the {inactive} driver")
def test_skip_inactive_runs():
    pass


@pytest.mark.gradref_only("{active}")
def test_only_active_runs():
    pass


@pytest.mark.gradref_only("{inactive}")
def test_only_inactive_skipped():
    assert False


@pytest.mark.gradref_only("{inactive}", reason="needs {inactive} bfloat16 atomics")
def test_only_inactive_with_reason():
    assert False


@pytest.mark.gradref_skip("{inactive}", reason="crashes the {inactive} driver")
class TestClassLevel:
    @pytest.mark.gradref_xfail("{active}", reason="class and function marks combine")
    def test_combined(self):
        assert False
"""

OUTCOMES = {"passed": 3, "failed": 3, "skipped": 3, "xfailed": 4, "xpassed": 1}


def _check_report(result: pytest.RunResult, active: str, inactive: str) -> None:
    result.assert_outcomes(**OUTCOMES)
    result.stdout.fnmatch_lines_random(
        [
            f"XFAIL *::test_xfail_active - [[]gradref {active}[]] known {active} bug",
            f"XFAIL *::test_xfail_several_devices - [[]gradref {active}[]] listed among others",
            f"XFAIL *::test_xfail_raises_matching - [[]gradref {active}[]] raises ValueError",
            f"XFAIL *::TestClassLevel::test_combined - [[]gradref {active}[]] class and *",
            f"XPASS *::test_xfail_active_xpasses - [[]gradref {active}[]] not actually broken",
            f"[[]XPASS(strict)[]] [[]gradref {active}[]] strict",
            "E       TypeError: not the expected exception",
            "E       AssertionError: runs as a plain test where the backend is not listed",
            f"SKIPPED [[]1[]] *: [[]gradref {active}[]] crashes the {active} driver",
            f"SKIPPED [[]1[]] *: [[]gradref {active}[]] runs only on {inactive}",
            f"SKIPPED [[]1[]] *: [[]gradref {active}[]] needs {inactive} bfloat16 atomics",
        ]
    )
    for name in (
        "test_xfail_strict_xpass_fails",
        "test_xfail_raises_other_exception_fails",
        "test_xfail_inactive_really_fails",
    ):
        result.stdout.fnmatch_lines([f"*::{name} FAILED*"])
    # What ran as a plain test, and passed.
    for name in (
        "test_xfail_inactive_passes",
        "test_skip_inactive_runs",
        "test_only_active_runs",
    ):
        result.stdout.fnmatch_lines([f"*::{name} PASSED*"])


def test_device_markers_on_cpu(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(MARKED.format(active="cpu", inactive="cuda"))
    result = pytester.runpytest("--gradref-device=cpu", "-rsxXf", "-v")
    _check_report(result, "cpu", "cuda")


def test_device_markers_follow_the_backend_name_not_the_placement(
    pytester: pytest.Pytester, npu_on_cpu: Callable[[str], None]
) -> None:
    # The npu policy placed on CPU tensors: markers see "npu", and "cpu" is inactive.
    npu_on_cpu("")
    pytester.makepyfile(MARKED.format(active="npu", inactive="cpu"))
    result = pytester.runpytest("--gradref-device=npu", "-rsxXf", "-v")
    _check_report(result, "npu", "cpu")


def test_xfail_strict_follows_the_xfail_strict_ini_option(pytester: pytest.Pytester) -> None:
    # Like pytest's own xfail: without strict=, the xfail_strict ini option decides; an
    # explicit strict= wins over it.
    pytester.makeini("[pytest]\nxfail_strict = true\n")
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gradref_xfail("cpu", reason="fixed meanwhile")
def test_follows_ini():
    pass

@pytest.mark.gradref_xfail("cpu", reason="flaky", strict=False)
def test_explicitly_lenient():
    pass
"""
    )
    result = pytester.runpytest("--gradref-device=cpu", "-rX")
    result.assert_outcomes(failed=1, xpassed=1)
    result.stdout.fnmatch_lines(["*_ test_follows_ini _*", "[[]XPASS(strict)[]] *fixed meanwhile"])


def test_markers_alone_pull_in_the_plugin(pytester: pytest.Pytester) -> None:
    # A test with a device marker but no gradref fixture is still converted.
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gradref_skip("cpu", reason="no fixture needed")
def test_marked_only():
    assert False
"""
    )
    result = pytester.runpytest("--gradref-device=cpu", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED [[]1[]] *: [[]gradref cpu[]] no fixture needed"])


def test_markers_are_registered_with_their_signatures(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines_random(
        [
            "@pytest.mark.gradref_xfail(*devices, reason, raises=None, strict=xfail_strict): *",
            "@pytest.mark.gradref_skip(*devices, reason): *",
            "@pytest.mark.gradref_only(*devices, reason=None): *",
            "@pytest.mark.gradref(strategy=None, rtol=None, atol=None*): *",
        ]
    )
    # Registered, so --strict-markers accepts them.
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gradref(strategy="autograd")
@pytest.mark.gradref_only("cpu")
def test_strict(grad_reference):
    pass
"""
    )
    pytester.runpytest("--strict-markers", "--gradref-device=cpu").assert_outcomes(passed=1)


@pytest.mark.parametrize(
    ("decorator", "message"),
    [
        pytest.param(
            '@pytest.mark.gradref_xfail("tpu", reason="r")',
            "@pytest.mark.gradref_xfail names unknown device 'tpu'; registered gradref "
            "backends are cpu, cuda, mps, npu, xpu",
            id="xfail-unknown-device",
        ),
        pytest.param(
            '@pytest.mark.gradref_skip("cuda", "gpu", reason="r")',
            "@pytest.mark.gradref_skip names unknown device 'gpu'; registered gradref "
            "backends are cpu, cuda, mps, npu, xpu",
            id="skip-unknown-device",
        ),
        pytest.param(
            '@pytest.mark.gradref_xfail(["npu", "cuda"], reason="r")',
            "@pytest.mark.gradref_xfail takes device names as separate arguments, not a list: "
            "write @pytest.mark.gradref_xfail('npu', 'cuda', ...)",
            id="xfail-device-list",
        ),
        pytest.param(
            "@pytest.mark.gradref_only(torch.device('cpu'))",
            "@pytest.mark.gradref_only names unknown device device(type='cpu'); registered *",
            id="only-device-object",
        ),
        pytest.param(
            '@pytest.mark.gradref_xfail("cpu", reason="r", run=False)',
            "@pytest.mark.gradref_xfail got unknown keyword(s) run; valid keywords are "
            "reason, raises, strict",
            id="xfail-unknown-keyword",
        ),
        pytest.param(
            '@pytest.mark.gradref_skip("cpu", reason="r", condition=True)',
            "@pytest.mark.gradref_skip got unknown keyword(s) condition; valid keywords are reason",
            id="skip-unknown-keyword",
        ),
        pytest.param(
            '@pytest.mark.gradref_only("cpu", devices=["cuda"])',
            "@pytest.mark.gradref_only got unknown keyword(s) devices; valid keywords are reason",
            id="only-unknown-keyword",
        ),
        pytest.param(
            '@pytest.mark.gradref_xfail("cpu")',
            "@pytest.mark.gradref_xfail needs reason=...",
            id="xfail-no-reason",
        ),
        pytest.param(
            '@pytest.mark.gradref_skip("cpu")',
            "@pytest.mark.gradref_skip needs reason=...",
            id="skip-no-reason",
        ),
        pytest.param(
            "@pytest.mark.gradref_only()",
            "@pytest.mark.gradref_only needs at least one device name",
            id="only-no-device",
        ),
        pytest.param(
            '@pytest.mark.gradref_xfail("cpu", reason="r", strict="yes")',
            "@pytest.mark.gradref_xfail: strict must be a bool, got 'yes'",
            id="xfail-strict-not-bool",
        ),
        # Checked where the marker does not apply too, not only on the listed backend.
        pytest.param(
            '@pytest.mark.gradref_xfail("cuda", reason="r", strict="yes")',
            "@pytest.mark.gradref_xfail: strict must be a bool, got 'yes'",
            id="xfail-strict-not-bool-inactive",
        ),
        pytest.param(
            '@pytest.mark.gradref_xfail("cuda", reason="r", raises="ValueError")',
            "@pytest.mark.gradref_xfail: raises must be an exception class or a tuple of them, "
            "got 'ValueError'",
            id="xfail-raises-not-a-class",
        ),
        pytest.param(
            '@pytest.mark.gradref_skip("cuda", reason=42)',
            "@pytest.mark.gradref_skip: reason must be a string, got 42",
            id="skip-reason-not-str",
        ),
        pytest.param(
            '@pytest.mark.gradref(strategy="backward")',
            "@pytest.mark.gradref got strategy='backward'; valid values are autograd, "
            "grad_and_value, crosscheck",
            id="gradref-bad-strategy",
        ),
        pytest.param(
            "@pytest.mark.gradref(tolerance=1e-3)",
            "@pytest.mark.gradref got unknown keyword(s) tolerance; valid keywords are "
            "strategy, rtol, atol*",
            id="gradref-unknown-keyword",
        ),
        pytest.param(
            '@pytest.mark.gradref("autograd")',
            "@pytest.mark.gradref takes keywords only: strategy, rtol, atol*",
            id="gradref-positional",
        ),
        pytest.param(
            "@pytest.mark.gradref(rtol=-1e-3)",
            "@pytest.mark.gradref got rtol=-0.001; it must be a number >= 0",
            id="gradref-negative-rtol",
        ),
        pytest.param(
            '@pytest.mark.gradref(atol="1e-3")',
            "@pytest.mark.gradref got atol='1e-3'; it must be a number >= 0",
            id="gradref-string-atol",
        ),
    ],
)
def test_marker_misuse_is_a_usage_error(
    pytester: pytest.Pytester, decorator: str, message: str
) -> None:
    pytester.makepyfile(
        f"""
import pytest
import torch

def test_fine(grad_reference):
    pass

{decorator}
def test_misused(grad_reference):
    pass
"""
    )
    result = pytester.runpytest("--gradref-device=cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: *::test_misused: {message}"])
    result.stdout.no_fnmatch_line("*passed*")


def test_marker_names_a_third_party_backend(pytester: pytest.Pytester) -> None:
    # Registered backends are valid marker devices, whether or not they are active.
    pytester.makeconftest(
        """
from pytest_gradref import Backend

def pytest_gradref_register_backends(registry):
    registry.register(Backend(name="widget", device_type="cpu", probe=lambda: "unplugged"))
"""
    )
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gradref_xfail("widget", reason="widget rounding")
def test_runs_on_cpu(grad_reference):
    pass

@pytest.mark.gradref_skip("tpu", reason="r")
def test_unknown(grad_reference):
    pass
"""
    )
    result = pytester.runpytest("--gradref-device=cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: *::test_unknown: *unknown device 'tpu'; registered gradref backends are "
            "cpu, cuda, mps, npu, widget, xpu"
        ]
    )
    # The error is the last thing printed: pytest writes its summary ("no tests ran") to
    # stdout first, then the usage error to stderr, with nothing after it.
    assert [line for line in result.stderr.lines if line.strip()][-1].startswith("ERROR: ")
    assert "no tests ran" in [line for line in result.outlines if line.strip()][-1]
    # Misuse is an error even in a test that -k deselects: the marker is wrong everywhere.
    assert pytester.runpytest("--gradref-device=cpu", "-k", "runs_on_cpu").ret == 4
    pytester.makepyfile(
        """
import pytest

@pytest.mark.gradref_xfail("widget", reason="widget rounding")
def test_runs_on_cpu(grad_reference):
    pass
"""
    )
    pytester.runpytest("--gradref-device=cpu").assert_outcomes(passed=1)
