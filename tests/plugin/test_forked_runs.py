"""The forked pytester runs (_forked_runs.py) give what pytester's subprocess runs give, and
the xdist workers of in-process runs, and the fork servers of forked runs, start as forks of
the zygote (_forked_python.py)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys

import _forked_python
import _forked_runs
import pytest
from _forked_python import forked_popen_args, forked_spawnv_passfds
from _forked_runs import runpytest_forked

from pytest_gradref.ranks import processes

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


def test_lists_its_open_descriptors():
    if os.path.isdir("/proc/self/fd"):
        print("\\nDESCRIPTORS", *sorted(map(int, os.listdir("/proc/self/fd"))))
"""


def test_outcomes_output_and_exit_status_match_a_subprocess_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_outcomes=OUTCOMES, helper_module="VALUE = 3\n")
    monkeypatch.setenv("FORKED_RUN_SETTING", "from the caller")
    # The device is named: where torch is imported already, as in a forked run, the plugin
    # resolves an automatic device as it is configured, which on a CUDA host opens the
    # driver's descriptors; a new interpreter waits for a test that needs the device.
    arguments = ("-p", "no:randomly", "-s", "--gradref-device=cpu")
    forked = runpytest_forked(pytester, *arguments)
    real = pytester.runpytest_subprocess(*arguments)
    for result in (forked, real):
        result.assert_outcomes(passed=3, failed=1)
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.stdout.fnmatch_lines(["*AssertionError: planted*"])
        result.stderr.fnmatch_lines(["to stderr"])
    # The same summary, warnings included: a module the zygote had imported that a run's
    # assertion rewriting wants (a plugin's) would be a warning only the forked run shows.
    assert forked.parseoutcomes() == real.parseoutcomes()
    # The same descriptors open: what the zygote passed is where the run expects it, and
    # nothing of the zygote's or of the handover is left open besides.
    descriptors = [
        [line for line in result.outlines if line.startswith("DESCRIPTORS")]
        for result in (forked, real)
    ]
    assert descriptors[0] == descriptors[1]
    assert descriptors[1] or not os.path.isdir("/proc/self/fd")


REWRITTEN_MODULES = """
import sys

from _pytest.assertion.rewrite import AssertionRewritingHook


def test_reports_its_modules():
    for name, module in sorted(sys.modules.items()):
        loader = getattr(module, "__loader__", None)
        print("MODULE", name, isinstance(loader, AssertionRewritingHook))
"""


def _rewritten_by_module(result: pytest.RunResult) -> dict[str, bool]:
    fields = (line.split() for line in result.outlines if line.startswith("MODULE "))
    return {name: rewritten == "True" for _, name, rewritten in fields}


def test_modules_are_rewritten_as_in_a_subprocess_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_modules=REWRITTEN_MODULES)
    forked = _rewritten_by_module(runpytest_forked(pytester, "-p", "no:randomly", "-s"))
    real = _rewritten_by_module(pytester.runpytest_subprocess("-p", "no:randomly", "-s"))
    # The plugins' modules are among them: the comparison below covers what the zygote
    # imports (on pytest 9.1 or later; before, the runs import them as a new interpreter does).
    assert real["xdist.plugin"]
    assert forked["xdist.plugin"]
    # Every module both runs imported (the forked run imported more, before it started) was
    # rewritten in one exactly where it was in the other.
    differing = {name for name in forked.keys() & real.keys() if forked[name] != real[name]}
    assert not differing, f"rewritten in one run only: {sorted(differing)}"


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


def test_xdist_workers_of_an_in_process_run_are_forks_of_the_zygote(
    pytester: pytest.Pytester,
) -> None:
    # A worker execnet started itself would be a child of the controller, this process.
    pytester.makepyfile(
        """
import os
import pytest


@pytest.mark.parametrize("i", range(2))
def test_record_the_parent(i, worker_id):
    with open(f"parent-{worker_id}-{i}", "w") as handle:
        handle.write(str(os.getppid()))
"""
    )
    pytester.runpytest("-n", "2", "-p", "no:randomly").assert_outcomes(passed=2)
    parents = {int(path.read_text()) for path in pytester.path.glob("parent-*")}
    assert parents
    assert os.getpid() not in parents


def test_xdist_workers_of_a_forked_run_start_on_its_path(pytester: pytest.Pytester) -> None:
    # xdist gives its local workers the sys.path it saw when imported: in a run forked from
    # the zygote that was the zygote's (its script's folder first), not the run's.
    pytester.makepyfile(
        """
import os
import sys


def test_record_the_path(worker_id):
    with open(f"path-{worker_id}", "w") as handle:
        handle.write(os.pathsep.join(sys.path))
"""
    )
    runpytest_forked(pytester, "-n", "2", "-p", "no:randomly").assert_outcomes(passed=1)
    (recorded,) = pytester.path.glob("path-gw*")
    path = recorded.read_text().split(os.pathsep)
    assert path[0] == str(pytester.path)  # as `python -m pytest` in the run's folder starts
    assert str(_forked_runs.ZYGOTE_SCRIPT.parent) not in path


def test_the_zygote_starts_in_the_environment_of_before_the_tests(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[dict[str, str]] = []

    class Started:
        def __init__(self, args: list[str], env: dict[str, str], **options: object) -> None:
            started.append(env)
            self.stdout = self

        def readline(self) -> str:
            return "ready\n"

        def poll(self) -> None:
            return None

        def kill(self) -> None:
            pass

    monkeypatch.setattr(_forked_runs.subprocess, "Popen", Started)
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # read once, when torch loads
    _forked_runs._Zygote().socket_path()
    assert started == [_forked_runs.ZYGOTE_ENVIRONMENT]
    assert started[0].get("OMP_NUM_THREADS") != "7"


def test_a_worker_interpreter_named_in_tx_is_left_alone() -> None:
    execnet = pytest.importorskip("execnet")
    from execnet import gateway_io

    patched = forked_popen_args(gateway_io.popen_args, lambda: "/nowhere/socket")
    named = patched(execnet.XSpec("popen//python=/opt/python3"))
    assert named[0] == "/opt/python3"
    forked = patched(execnet.XSpec("popen"))
    assert forked[:5] == [sys.executable, "-I", "-S", _forked_python.SCRIPT, "/nowhere/socket"]
    assert forked[5:] == gateway_io.popen_args(execnet.XSpec("popen"))[1:]


FORK_SERVER = """
import multiprocessing
import os


def report_the_parent(path):
    with open(path, "w") as handle:
        handle.write(str(os.getppid()))


def test_forks_a_process_from_the_fork_server():
    context = multiprocessing.get_context("forkserver")
    process = context.Process(target=report_the_parent, args=("server.pid",))
    process.start()
    process.join()
    assert process.exitcode == 0
    with open("server.pid") as handle:
        server = int(handle.read())
    with open(f"/proc/{server}/stat") as handle:
        parent = int(handle.read().rsplit(")", 1)[1].split()[1])
    print("\\nRUN", os.getpid(), os.getpgid(0), "SERVER", parent, os.getpgid(server))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_the_fork_server_of_a_forked_run_is_a_fork_of_the_zygote(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_fork_server=FORK_SERVER)
    result = runpytest_forked(pytester, "-p", "no:randomly", "-s")
    result.assert_outcomes(passed=1)
    line = next(line for line in result.outlines if line.startswith("RUN "))
    _, run, run_group, _, server_parent, server_group = line.split()
    # One the run started itself would be its child; this one is the zygote's, in the run's
    # process group all the same, so that what ends the run's group ends it too.
    assert server_parent != run
    assert server_group == run_group


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_the_fork_server_of_this_test_process_is_a_fork_of_the_zygote() -> None:
    # The server the plugin's ranks fork from in this process (conftest.py), started as the
    # plugin starts it: a fork of the zygote, under the zygote's waiter for it (_zygote.py),
    # where a new interpreter's parent would be this process.
    assert processes.start_method() == "forkserver"
    with multiprocessing.get_context("forkserver").Pool(1) as pool:
        server = pool.apply(os.getppid)
    assert _parent(_parent(server)) == _forked_runs.zygote.pid


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[1])


def test_only_the_fork_server_is_started_as_a_fork() -> None:
    started: list[list[str]] = []

    def spawnv_passfds(path: str, args: list[str], passfds: tuple[int, ...]) -> int:
        started.append(args)
        return 0

    patched = forked_spawnv_passfds(spawnv_passfds, lambda: "/nowhere/socket")
    server = "from multiprocessing.forkserver import main; main(7, 5, ['torch'], **{})"
    patched(sys.executable, [sys.executable, "-B", "-c", server], (7, 5))
    spawned = [sys.executable, "-c", "from multiprocessing.spawn import spawn_main"]
    patched(sys.executable, spawned, (9,))
    assert started == [
        [
            sys.executable,
            "-I",
            "-S",
            _forked_python.SCRIPT,
            "--keep-fds=5,7",
            "/nowhere/socket",
            "-B",
            "-c",
            server,
        ],
        spawned,
    ]
