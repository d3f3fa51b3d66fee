"""The forked pytester runs (_forked_runs.py) give what pytester's subprocess runs give."""

from __future__ import annotations

import signal

import pytest
from _forked_runs import runpytest_forked

OUTCOMES = """
import os
import sys

import pytest


def test_passes():
    assert os.environ["FORKED_RUN_SETTING"] == "from the caller"


def test_fails():
    print("to stderr", file=sys.stderr)
    assert False, "planted"


def test_sees_the_generated_module():
    import helper_module

    assert helper_module.VALUE == 3
"""


def test_outcomes_output_and_exit_status_match_a_subprocess_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_outcomes=OUTCOMES, helper_module="VALUE = 3\n")
    monkeypatch.setenv("FORKED_RUN_SETTING", "from the caller")
    forked = runpytest_forked(pytester, "-p", "no:randomly", "-s")
    real = pytester.runpytest_subprocess("-p", "no:randomly", "-s")
    for result in (forked, real):
        result.assert_outcomes(passed=2, failed=1)
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.stdout.fnmatch_lines(["*AssertionError: planted*"])
        result.stderr.fnmatch_lines(["to stderr"])


def test_a_run_killed_by_a_signal_says_so(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        "import os, signal\n\n\ndef test_dies():\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    assert runpytest_forked(pytester).ret == -signal.SIGKILL


def test_a_run_past_its_timeout_is_ended(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("import time\n\n\ndef test_sleeps():\n    time.sleep(60)\n")
    with pytest.raises(pytester.TimeoutExpired, match="1 second timeout expired"):
        runpytest_forked(pytester, timeout=1)
    # The zygote serves the next run.
    pytester.makepyfile("def test_quick():\n    pass\n")
    runpytest_forked(pytester).assert_outcomes(passed=1)
