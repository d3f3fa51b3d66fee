"""--gradref-threads: each test process's CPU thread count, split among xdist workers.

The generated runs are subprocesses: a thread count is process-global, and this process's own
must not change under the tests that follow.
"""

from __future__ import annotations

import pytest

from pytest_gradref.config.threads import SPLIT_CHOICE, TORCH_CHOICE, plan_threads

# A test that reports the thread count of its process and of a process it starts.
THREAD_PROBE = """
import os
import subprocess
import sys

import torch


def test_threads(gradref_device):
    child = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True, text=True, check=True,
    )
    print(f"THREADS own={torch.get_num_threads()} child={child.stdout.strip()}")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = len(os.sched_getaffinity(0))
    expected = int(os.environ["EXPECTED_THREADS"]) or max(cores // workers, 1)
    assert torch.get_num_threads() == expected
    assert int(child.stdout) == expected
"""


@pytest.mark.parametrize(
    ("choice", "workers", "omp", "count"),
    [
        (SPLIT_CHOICE, 2, None, 8),
        (SPLIT_CHOICE, 3, None, 5),
        (SPLIT_CHOICE, 32, None, 1),  # at least one each
        (SPLIT_CHOICE, None, None, None),  # one test process: torch's own count
        (SPLIT_CHOICE, 2, "4", None),  # the environment's choice stands
        (TORCH_CHOICE, 2, None, None),
        (3, None, None, 3),
        (3, 2, "4", 3),  # an explicit count wins
    ],
)
def test_plan(choice: int | str, workers: int | None, omp: str | None, count: int | None) -> None:
    assert plan_threads(choice, workers, 16, omp).count == count


@pytest.mark.skipif(
    not hasattr(__import__("os"), "sched_getaffinity"), reason="needs os.sched_getaffinity"
)
def test_split_among_xdist_workers(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_probe=THREAD_PROBE)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("EXPECTED_THREADS", "0")  # the cores divided among the workers
    result = pytester.runpytest_subprocess(
        "-n", "2", "--gradref-threads=split", "-p", "no:randomly", "-s"
    )
    result.assert_outcomes(passed=1)
    # Any device: the thread count is the CPU's on a GPU host too.
    result.stdout.fnmatch_lines(["gw? -> * (*; *thread(s): split: * cores among 2 xdist workers)"])


def test_a_count_is_applied_without_xdist(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_probe=THREAD_PROBE)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # an explicit count wins over the environment
    monkeypatch.setenv("EXPECTED_THREADS", "1")
    monkeypatch.setenv("GRADREF_THREADS", "1")
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:xdist")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["gradref: device=* threads=1 (1 thread(s), from *)"])


def test_the_default_leaves_torch_alone(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_probe=THREAD_PROBE)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("EXPECTED_THREADS", "2")
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:randomly")
    result.assert_outcomes(passed=1)
    assert "thread(s)" not in result.stdout.str()


@pytest.mark.parametrize("value", ["0", "-1", "half", "1.5"])
def test_a_bad_value_is_a_usage_error(pytester: pytest.Pytester, value: str) -> None:
    pytester.makeini(f"[pytest]\ngradref_threads = {value}\n")
    pytester.makepyfile(test_probe="def test_nothing():\n    pass\n")
    # In process: the value is refused before any thread count is applied.
    result = pytester.runpytest_inprocess("-p", "no:xdist")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"*Invalid gradref threads {value!r} from the gradref_threads ini key*torch, split or*"]
    )
