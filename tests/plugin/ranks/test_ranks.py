"""Multi-rank tests (``@pytest.mark.gradref_ranks``): where each rank runs, and that a failing,
hung or crashed rank fails its test by name while the session goes on, also under -n 2.

The runs start rank processes (the first pool of a process a torch import, a later one a fork
per rank), so each generated run holds several scenarios."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from _forked_runs import runpytest_forked
from _pytester_sources import PEER_FAILS_FIRST

from pytest_gradref.config.markers import MarkerError
from pytest_gradref.config.resolution import Resolution
from pytest_gradref.config.settings import RANK_TIMEOUT_OPTION, Setting, parse_rank_timeout
from pytest_gradref.devices.backends import builtin_backend
from pytest_gradref.ranks import processes, pytest_side
from pytest_gradref.ranks.pytest_side import owned_devices, parse_ranks_mark, rank_devices

# --- where ranks run ----------------------------------------------------------------------------


def _resolution(name: str, device: str, simulated: bool = False) -> Resolution:
    return Resolution(
        backend=builtin_backend(name),
        device=torch.device(device),
        index=None,
        device_source="test",
        strategy=None,
        strategy_source="test",
        unavailable=(),
        simulated=simulated,
    )


def test_without_xdist_a_process_owns_every_visible_device() -> None:
    assert owned_devices(4, None, None) == ([0, 1, 2, 3], "this process")


def test_a_pinned_index_owns_that_device_alone() -> None:
    assert owned_devices(4, 2, (0, 2)) == ([2], "the device pinned by its index (2)")


def test_xdist_workers_split_the_devices_around_their_own() -> None:
    # Worker k's own device (xdist.assign_devices) is k: it owns every index k modulo W.
    assert owned_devices(4, None, (0, 2))[0] == [0, 2]
    assert owned_devices(4, None, (1, 2))[0] == [1, 3]
    assert owned_devices(2, None, (1, 4))[0] == [1]  # fewer devices than workers: shared
    assert owned_devices(2, None, (3, 4))[0] == [1]


def test_each_rank_takes_a_device_of_its_own() -> None:
    assert rank_devices(_resolution("cuda", "cuda:0"), 2, [1, 3], "w") == ("cuda:1", "cuda:3")


def test_too_few_devices_is_a_skip_that_names_the_counts() -> None:
    reason = rank_devices(_resolution("cuda", "cuda:1"), 4, [1, 3], "xdist worker gw1 (of 2)")
    assert reason == (
        "gradref_ranks(4) needs 4 cuda devices, one per rank; xdist worker gw1 (of 2) has 2 "
        "(cuda:1, cuda:3); run fewer xdist workers"
    )
    alone = rank_devices(_resolution("cuda", "cuda:0"), 2, [0], "this process")
    assert alone == (
        "gradref_ranks(2) needs 2 cuda devices, one per rank; this process has 1 (cuda:0); "
        "make more visible (CUDA_VISIBLE_DEVICES)"
    )


def test_cpu_and_simulated_ranks_share_the_devices() -> None:
    assert rank_devices(_resolution("cpu", "cpu"), 4, [0], "this process") == ("cpu",) * 4
    # The npu device type exists only once the simulation is installed: the cuda policy
    # stands in for a simulated device here.
    simulated = rank_devices(_resolution("cuda", "cuda:0", simulated=True), 4, [0, 1], "w")
    assert simulated == ("cuda:0", "cuda:1", "cuda:0", "cuda:1")


# --- the marker and the timeout setting ---------------------------------------------------------


@pytest.mark.parametrize(
    ("mark", "message"),
    [
        (pytest.mark.gradref_ranks(), "takes the number of ranks, got 0 positional arguments"),
        (pytest.mark.gradref_ranks(0), "got world_size=0; it must be an integer >= 1"),
        (pytest.mark.gradref_ranks(True), "got world_size=True"),
        (pytest.mark.gradref_ranks(2, timeout=0), "got timeout=0; it must be a number > 0"),
        (pytest.mark.gradref_ranks(2, ranks=2), "unknown keyword(s) ranks; valid keywords"),
    ],
)
def test_a_bad_marker_says_what_is_valid(mark: pytest.MarkDecorator, message: str) -> None:
    with pytest.raises(MarkerError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_ranks_mark(mark.mark)


def test_a_bad_marker_stops_the_run_naming_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        "import pytest\n\n@pytest.mark.gradref_ranks('two')\ndef test_x(gradref_rank):\n    pass\n"
    )
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: *test_x: @pytest.mark.gradref_ranks got world_size='two'; it must be *"]
    )


@pytest.mark.parametrize("source", ["cli", "env", "ini"])
def test_a_bad_rank_timeout_names_its_source(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    pytester.makepyfile("def test_nothing():\n    pass\n")
    args: list[str] = []
    if source == "cli":
        args, where = ["--gradref-rank-timeout=-1"], "the --gradref-rank-timeout option"
    elif source == "env":
        monkeypatch.setenv("GRADREF_RANK_TIMEOUT", "-1")
        where = "the GRADREF_RANK_TIMEOUT environment variable"
    else:
        pytester.makeini("[pytest]\ngradref_rank_timeout = -1\n")
        where = "the gradref_rank_timeout ini key in tox.ini"
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"ERROR: Invalid gradref rank timeout '-1' from {where}; it must be a positive "
            "number of seconds, e.g. 300"
        ]
    )


def test_the_rank_timeout_defaults_to_300_seconds() -> None:
    default = RANK_TIMEOUT_OPTION.default
    assert default is not None
    assert parse_rank_timeout(Setting(default, "the default", is_default=True)) == 300
    assert (
        parse_rank_timeout(Setting("2.5", "the GRADREF_RANK_TIMEOUT environment variable")) == 2.5
    )


def test_gradref_rank_needs_the_marker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(gradref_rank):\n    pass\n")
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*test_x: gradref_rank needs the test marked @pytest.mark.gradref_ranks(N)*"]
    )


# --- failures are the test's, by rank -----------------------------------------------------------

RANK_FAILURES = """
import os
import signal

import pytest
import torch
import torch.distributed as dist


def pid(name, gradref_rank):
    with open(os.path.join(os.environ["RANKS_OUT"], f"{name}-{gradref_rank.rank}"), "w") as f:
        f.write(str(os.getpid()))


@pytest.mark.gradref_ranks(2)
def test_all_reduce(gradref_rank, gradref_device):
    assert dist.get_rank() == gradref_rank.rank
    assert dist.get_world_size() == gradref_rank.world_size == 2
    assert gradref_device == gradref_rank.device
    total = torch.tensor([gradref_rank.rank + 1.0], device=gradref_device)
    dist.all_reduce(total)
    assert total.item() == 3.0
    pid("first", gradref_rank)


@pytest.mark.gradref_ranks(2)
def test_only_rank_1_fails(gradref_rank):
    seen = gradref_rank.rank
    assert seen == 0, "a rank-dependent bug"


@pytest.mark.gradref_ranks(2)
def test_hangs(gradref_rank):
    t = torch.ones(1)
    if gradref_rank.rank == 0:
        dist.all_reduce(t)  # waits for rank 1
    else:
        dist.recv(t, src=0)  # waits for a send that never comes


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSEGV], ids=["kill", "segv"])
@pytest.mark.gradref_ranks(2)
def test_crashes(gradref_rank, signum):
    if gradref_rank.rank == 1:
        os.kill(os.getpid(), signum)
    dist.barrier()


@pytest.fixture
def not_picklable():
    return lambda: None


@pytest.mark.gradref_ranks(2)
def test_takes_a_fixture_that_cannot_travel(gradref_rank, not_picklable):
    pass


@pytest.mark.gradref_ranks(2, timeout=3)
def test_leaves_a_collective_unmatched(gradref_rank):
    if gradref_rank.rank == 0:
        dist.all_reduce(torch.ones(1), async_op=True)  # never waited for, never matched


@pytest.mark.gradref_ranks(2)
def test_skips_in_the_ranks(gradref_rank):
    pytest.skip("not here")


@pytest.mark.gradref_ranks(2)
def test_after_the_failures(gradref_rank):
    dist.barrier()
    pid("after", gradref_rank)


@pytest.mark.gradref_ranks(2)
def test_on_the_same_ranks(gradref_rank):
    pid("again", gradref_rank)
"""


def test_failing_hung_and_crashed_ranks_fail_their_tests(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    out_dir = pytester.mkdir("out")
    monkeypatch.setenv("RANKS_OUT", str(out_dir))
    written = pytester.makepyfile(test_failures=RANK_FAILURES).read_text().splitlines()

    def line(code: str) -> int:
        return next(number for number, text in enumerate(written, 1) if code in text)

    # The timeout comes from the setting: short, for the hung test.
    result = pytester.runpytest(
        "-p", "no:randomly", "-rs", "--gradref-rank-timeout=3", "--gradref-device=cpu"
    )
    result.assert_outcomes(passed=3, failed=6, skipped=1)
    pids = {
        n: {(out_dir / f"{n}-{r}").read_text() for r in (0, 1)} for n in ("first", "after", "again")
    }
    assert all(len(ranks) == 2 for ranks in pids.values())
    # The session went on, on new ranks (ranks do not outlive a failure); passing tests share
    # their ranks.
    assert not pids["first"] & pids["after"]
    assert pids["after"] == pids["again"]
    out = result.stdout
    # A failing rank: its rank, then its traceback, ending at the test's line.
    out.fnmatch_lines(
        [
            "*_ test_only_rank_1_fails _*",
            "gradref_ranks(2) on cpu (gloo): rank 1 failed (AssertionError); rank 0 passed",
            "*_ rank 1 of 2 on cpu: failed _*",
            "*def test_only_rank_1_fails(gradref_rank):",
            '>       assert seen == 0, "a rank-dependent bug"',
            "E       AssertionError: a rank-dependent bug",
            "E       assert 1 == 0",
            f"test_failures.py:{line('assert seen')}: AssertionError",
        ]
    )
    # A hang: both ranks ended after the timeout, each with its stack at the test's line.
    out.fnmatch_lines(
        [
            "*_ test_hangs _*",
            "gradref_ranks(2) on cpu (gloo): rank 0 hung: no outcome within the 3 s rank "
            "timeout; rank 1 hung: no outcome within the 3 s rank timeout",
            "*_ rank 0 of 2 on cpu: hung _*",
            "Python stack of rank 0 when it was ended:",
            "*in all_reduce",
            f'  File "*test_failures.py", line {line("dist.all_reduce(t)")} in test_hangs',
            "*_ rank 1 of 2 on cpu: hung _*",
            "Python stack of rank 1 when it was ended:",
            "*in recv",
            f'  File "*test_failures.py", line {line("dist.recv(t")} in test_hangs',
            "The rank timeout is 3 s, from the --gradref-rank-timeout option.*",
        ]
    )
    # Crashes: the rank and the signal, and the stack where faulthandler could write one.
    out.fnmatch_lines(
        [
            "*_ test_crashes[[]kill[]] _*",
            "gradref_ranks(2) on cpu (gloo): rank 1 crashed: killed by signal SIGKILL (9)*",
            "*_ rank 1 of 2 on cpu: crashed _*",
            "(rank 1 left no Python stack: SIGKILL cannot be caught)",
        ]
    )
    out.fnmatch_lines(
        [
            "*_ test_crashes[[]segv[]] _*",
            "gradref_ranks(2) on cpu (gloo): rank 1 crashed: killed by signal SIGSEGV (11)*",
            "Python stack of rank 1 when it crashed:",
            "Fatal Python error: Segmentation fault",
            f'  File "*test_failures.py", line {line("os.kill(")} in test_crashes',
        ]
    )
    # Every rank passed, but one left a collective the other never met.
    out.fnmatch_lines(
        [
            "*_ test_leaves_a_collective_unmatched _*",
            "gradref_ranks(2) on cpu (gloo): rank ? passed, but did not meet the others at the "
            "end-of-test barrier: a collective or send/recv that one rank left unmatched*",
        ]
    )
    out.fnmatch_lines(["SKIPPED [[]1[]] test_failures.py:*: rank 0 of 2: not here"])
    out.fnmatch_lines(
        [
            "*_ test_takes_a_fixture_that_cannot_travel _*",
            "fixture 'not_picklable' gives a function, which cannot be sent to the rank "
            "processes (*). A gradref_ranks test's body runs in processes of its own*",
        ]
    )


# --- side by side under xdist -------------------------------------------------------------------

SIDE_BY_SIDE = """
import json
import os
import time

import pytest
import torch
import torch.distributed as dist


@pytest.mark.parametrize("i", [0, 1])
@pytest.mark.gradref_ranks(2)
def test_side_by_side(i, gradref_rank, worker_id):
    out = os.environ["RANKS_OUT"]
    open(os.path.join(out, f"started-{i}"), "w").close()
    # Each test waits until the other one has started: only two tests running at once pass.
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, f"started-{1 - i}")):
        assert time.monotonic() < deadline, "the other test never started"
        time.sleep(0.05)
    total = torch.tensor([float(gradref_rank.rank + 1)])
    dist.all_reduce(total)
    record = {"worker": worker_id, "pid": os.getpid(), "total": total.item()}
    with open(os.path.join(out, f"{i}-{gradref_rank.rank}.json"), "w") as handle:
        json.dump(record, handle)
"""


def test_two_multi_rank_tests_run_side_by_side_under_xdist(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = pytester.mkdir("out")
    monkeypatch.setenv("RANKS_OUT", str(out))
    pytester.makepyfile(test_side=SIDE_BY_SIDE)
    result = pytester.runpytest("-p", "no:randomly", "-n", "2", "--gradref-device=cpu")
    result.assert_outcomes(passed=2)
    records = [json.loads((out / f"{i}-{r}.json").read_text()) for i in (0, 1) for r in (0, 1)]
    assert {record["total"] for record in records} == {3.0}
    assert {records[0]["worker"], records[2]["worker"]} == {"gw0", "gw1"}
    assert len({record["pid"] for record in records}) == 4  # four ranks, each a process


@pytest.mark.parametrize("max_pools", [pytest_side.MAX_POOLS, 1])
def test_interleaved_world_sizes_keep_their_pools(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, max_pools: int
) -> None:
    # 2, 3, 2, 3 ranks in turn, as a parametrized suite orders them: each world size's ranks
    # are started once, not again whenever the world size changes; past the most pools kept,
    # the least recently used is ended.
    monkeypatch.setattr(pytest_side, "MAX_POOLS", max_pools)
    pytester.makepyfile(
        test_pools="""
import os

import pytest

def _body(gradref_rank, tag):
    with open(f"{tag}-{gradref_rank.world_size}-{gradref_rank.rank}-{os.getpid()}", "w"):
        pass

@pytest.mark.gradref_ranks(2)
def test_a2(gradref_rank):
    _body(gradref_rank, "a")

@pytest.mark.gradref_ranks(3)
def test_a3(gradref_rank):
    _body(gradref_rank, "a")

@pytest.mark.gradref_ranks(2)
def test_b2(gradref_rank):
    _body(gradref_rank, "b")

@pytest.mark.gradref_ranks(3)
def test_b3(gradref_rank):
    _body(gradref_rank, "b")
"""
    )
    result = pytester.runpytest("-p", "no:randomly", "--gradref-device=cpu")
    result.assert_outcomes(passed=4)
    ran = [path.name.split("-") for path in pytester.path.glob("[ab]-*")]
    assert len(ran) == 10  # 2 + 3 ranks, twice
    pids: dict[tuple[str, str], set[str]] = {}
    for _, size, rank, pid in ran:
        pids.setdefault((size, rank), set()).add(pid)
    # Each rank of each world size ran both of its tests in one process, or with one pool
    # kept, each test in a pool of its own.
    processes = 1 if max_pools > 1 else 2
    assert all(len(found) == processes for found in pids.values()), pids


RANK_WARNINGS = """
import warnings

import pytest


class KernelWarning(UserWarning):
    pass


@pytest.mark.gradref_ranks(2)
def test_warns(gradref_rank):
    warnings.warn(f"slow path taken on rank {gradref_rank.rank}", KernelWarning)


@pytest.mark.filterwarnings("ignore:left out by the marker")
@pytest.mark.gradref_ranks(2)
def test_warns_what_its_marker_ignores(gradref_rank):
    warnings.warn("left out by the marker")
"""


OTHER_PLUGINS_NOTICE = """
def pytest_configure(config):
    config.issue_config_time_warning(UserWarning("another plugin's notice"), stacklevel=2)
"""


@pytest.mark.parametrize("error", [False, True], ids=["summary", "W-error"])
def test_a_ranks_warnings_reach_the_summary_or_fail_it_under_w_error(
    pytester: pytest.Pytester, error: bool
) -> None:
    pytester.makepyfile(test_rank_warnings=RANK_WARNINGS)
    args = ["-p", "no:randomly", "--gradref-device=cpu"]
    if error:
        # Another plugin's warning at configure time (pytest-benchmark's under xdist) would
        # be an internal error under a filter for every module: this one names the test's.
        pytester.makeconftest(OTHER_PLUGINS_NOTICE)
        args += ["-W", "error::UserWarning:test_rank_warnings"]
    result = pytester.runpytest(*args)
    if not error:
        # Each rank's warning, with its class and the rank that raised it, in the summary.
        result.assert_outcomes(passed=2, warnings=2)
        result.stdout.fnmatch_lines(
            [
                "*= warnings summary =*",
                "test_rank_warnings.py::test_warns",
                "*test_rank_warnings.py:*: KernelWarning: rank 0: slow path taken on rank 0",
                "*test_rank_warnings.py:*: KernelWarning: rank 1: slow path taken on rank 1",
            ]
        )
    else:
        # -W error makes the warning each rank's failure; the marker's filter still wins.
        result.assert_outcomes(passed=1, failed=1)
        result.stdout.fnmatch_lines(
            ["gradref_ranks(2) on cpu (gloo): rank ? failed (KernelWarning); rank ? failed *"]
        )
    result.stdout.no_fnmatch_line("*left out by the marker*")


RANK_OUTPUT = """
import os
import sys

import pytest


@pytest.mark.gradref_ranks(2)
def test_prints_then_fails_on_rank_1(gradref_rank):
    print(f"python stdout of rank {gradref_rank.rank}")
    os.write(2, f"native stderr of rank {gradref_rank.rank}\\n".encode())
    sys.stderr.flush()
    assert gradref_rank.rank == 0
"""


def test_a_failed_tests_output_is_shown_rank_by_rank(pytester: pytest.Pytester) -> None:
    # What each rank wrote, from Python or through its file descriptors, in a section of its
    # own: interleaved in one stream, the ranks' lines could not be told apart.
    pytester.makepyfile(test_rank_output=RANK_OUTPUT)
    result = pytester.runpytest("-p", "no:randomly", "--gradref-device=cpu")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*- Captured stdout rank 0 call -*",
            "python stdout of rank 0",
            "*- Captured stderr rank 0 call -*",
            "native stderr of rank 0",
            "*- Captured stdout rank 1 call -*",
            "python stdout of rank 1",
            "*- Captured stderr rank 1 call -*",
            "native stderr of rank 1",
        ]
    )


def test_a_peer_that_fails_before_a_collective_ends_the_test_soon(
    pytester: pytest.Pytester,
) -> None:
    # Rank 1 fails before the all-reduce rank 0 waits in: the test ends within seconds,
    # naming rank 1's failure first, not at the 300 s rank timeout.
    pytester.makepyfile(test_peer=PEER_FAILS_FIRST)
    start = time.monotonic()
    result = pytester.runpytest("-p", "no:randomly", "--gradref-device=cpu")
    elapsed = time.monotonic() - start
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["gradref_ranks(2) on cpu (gloo): rank 1 failed (AssertionError); rank 0 *"]
    )
    assert elapsed < 30


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_new_pool_sees_the_controllers_environment_of_now(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    # Ranks forked from the fork server start with its environment, the controller's when the
    # first pool started; a later pool's ranks see what the controller set since, as spawned
    # ranks do. Spawned ranks are what a platform without a fork server (Windows) starts:
    # forced here, so that path runs too.
    assert processes.start_method() == "forkserver"  # this suite's platforms have one
    monkeypatch.setattr(processes, "start_method", lambda: method)
    # The generated run is in process: the variable it sets is removed again at teardown.
    monkeypatch.setenv("GRADREF_TEST_LATE", "")
    monkeypatch.delenv("GRADREF_TEST_LATE")
    pytester.makepyfile(
        test_environment="""
import os

import pytest

@pytest.mark.gradref_ranks(1)
def test_first_pool(gradref_rank):
    assert "GRADREF_TEST_LATE" not in os.environ

def test_the_controller_sets_a_variable():
    os.environ["GRADREF_TEST_LATE"] = "set"

@pytest.mark.gradref_ranks(2)
def test_second_pool(gradref_rank):
    assert os.environ["GRADREF_TEST_LATE"] == "set"
"""
    )
    result = pytester.runpytest("-p", "no:randomly", "--gradref-device=cpu")
    result.assert_outcomes(passed=3)


def test_forked_ranks_begin_with_dynamo_imported(pytester: pytest.Pytester) -> None:
    # A rank's first custom operator, torch.func transform or compiled call imports
    # torch._dynamo (a second or so): the fork server imports it once, so the ranks forked
    # from it, the first pool's and a new pool's after a failure, begin with it.
    pytester.makepyfile(
        test_imports="""
import sys

import pytest

@pytest.mark.gradref_ranks(2)
def test_first_pool(gradref_rank):
    assert "torch._dynamo" in sys.modules

@pytest.mark.gradref_ranks(2)
def test_rank_1_fails(gradref_rank):
    assert gradref_rank.rank == 0

@pytest.mark.gradref_ranks(2)
def test_a_new_pool(gradref_rank):
    assert "torch._dynamo" in sys.modules
"""
    )
    result = pytester.runpytest("-p", "no:randomly", "--gradref-device=cpu")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["FAILED test_imports.py::test_rank_1_fails - *"])


# The fork server's imports, then whether CUDA is initialised and which NVIDIA device files are
# open (the driver opens them when it initialises).
FORKSERVER_IMPORTS_PROBE = """
import contextlib
import importlib
import os

import torch

from pytest_gradref.ranks.processes import FORKSERVER_PRELOAD

for name in FORKSERVER_PRELOAD:
    importlib.import_module(name)
opened = []
for fd in os.listdir("/proc/self/fd"):
    with contextlib.suppress(OSError):  # the listing's own descriptor is closed by now
        opened.append(os.readlink(f"/proc/self/fd/{fd}"))
print(torch.cuda.is_initialized(), [path for path in opened if "nvidia" in path])
"""


@pytest.mark.gradref_only("cuda", reason="ranks forked for CUDA devices need it uninitialised")
def test_the_fork_servers_imports_initialise_no_accelerator() -> None:
    # A rank forked from a process that initialised CUDA cannot use it. A new interpreter:
    # this one may have initialised it already.
    done = subprocess.run(
        [sys.executable, "-c", FORKSERVER_IMPORTS_PROBE], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False []"


def test_ranks_end_when_their_controller_is_killed(pytester: pytest.Pytester) -> None:
    # The controller dies without telling its ranks (SIGKILL): they leave within seconds, on
    # their own, whether their parent is the controller or the fork server.
    pytester.makepyfile(
        test_orphans="""
import os
import signal

import pytest

@pytest.mark.gradref_ranks(2)
def test_ranks_write_their_pids(gradref_rank):
    with open(f"rank-{gradref_rank.rank}.pid", "w") as handle:
        handle.write(str(os.getpid()))

def test_the_controller_dies():
    os.kill(os.getpid(), signal.SIGKILL)
"""
    )
    result = runpytest_forked(pytester, "-p", "no:randomly", "--gradref-device=cpu")
    assert result.ret == -signal.SIGKILL
    pids = [int(path.read_text()) for path in sorted(pytester.path.glob("rank-*.pid"))]
    assert len(pids) == 2
    deadline = time.monotonic() + 15
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(pid) for pid in pids), f"ranks {pids} outlived their controller"


def _running(pid: int) -> bool:
    """Whether a process runs (a zombie, ended but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
