"""Multi-rank tests under torchrun: each launcher process is one rank and the plugin spawns
none (launcher.py).

The parsing and the checks that refuse a session are tested in this process; the rest runs the
way users launch it: ``torchrun --nproc-per-node=2 -m pytest`` on one host, and two torchrun
agents that meet over a c10d rendezvous as two nodes would."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _pytester_sources import PEER_FAILS_FIRST

from pytest_gradref.ranks.launcher import (
    PEER_GRACE_S,
    LaunchedRank,
    first_difference,
    launched_rank,
    refuse_reordering,
)

LAUNCHED = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def test_a_process_no_launcher_started_is_not_a_rank() -> None:
    assert launched_rank({}) is None
    # RANK alone is too common a name to mean a launcher.
    assert launched_rank({"RANK": "3"}) is None


def test_a_rank_knows_its_node() -> None:
    assert launched_rank({**LAUNCHED, "GROUP_RANK": "1"}) == LaunchedRank(1, 2, 1, 1)
    assert launched_rank({**LAUNCHED, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}) == (
        LaunchedRank(3, 4, 1, 1)
    )
    assert launched_rank(LAUNCHED) == LaunchedRank(1, 2, 1, 0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"MASTER_PORT": ""},
            "a launcher set RANK=1, WORLD_SIZE=2, LOCAL_RANK=1 but not MASTER_PORT",
        ),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
        ({"RANK": "2"}, "RANK=2 is outside 0 to WORLD_SIZE - 1"),
    ],
)
def test_a_launcher_environment_that_cannot_work_is_a_usage_error(
    changes: dict[str, str], message: str
) -> None:
    with pytest.raises(pytest.UsageError, match=message):
        launched_rank({**LAUNCHED, **changes})


def test_the_first_difference_of_two_collections_is_named() -> None:
    assert first_difference(["a", "b", "c"], ["a", "c", "b"]) == "test 2 is b here and c there"
    assert (
        first_difference(["a"], ["a", "b"])
        == "one collected 1 tests, the other 2 (the first extra: b)"
    )


@pytest.mark.parametrize(
    ("args", "option"),
    [(("-n", "2", "-p", "no:randomly"), "drop -n/--dist"), ((), "add -p no:randomly")],
)
def test_plugins_that_reorder_the_ranks_tests_are_refused(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], option: str
) -> None:
    if "randomly" in option:  # the test environment installs it; a bare host may not
        pytest.importorskip("pytest_randomly", reason="only pytest-randomly's order is refused")
    for name, value in LAUNCHED.items():
        monkeypatch.setenv(name, value)
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: under a launcher (torchrun: rank 1 of 2 *{option}*"])


@pytest.mark.parametrize(
    ("args", "refused"),
    [
        # A --dist in a project's addopts, with no -n or --tx: pytest-xdist starts no workers,
        # so each rank runs every test itself.
        (("--dist", "worksteal"), False),
        (("--dist", "load", "--tx", "popen"), True),
        (("-n", "2"), True),
    ],
    ids=["dist-without-workers", "dist-with-tx", "n"],
)
def test_xdist_is_refused_only_where_it_would_start_workers(
    pytester: pytest.Pytester, args: tuple[str, ...], refused: bool
) -> None:
    config = pytester.parseconfig(*args, "-p", "no:randomly")
    launched = launched_rank(LAUNCHED)
    if refused:
        with pytest.raises(pytest.UsageError, match="drop -n/--dist"):
            refuse_reordering(config, launched)
    else:
        refuse_reordering(config, launched)


# Each rank writes what it saw of each test; the tests read it back by rank.
CONFTEST = """
import json, os

def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome == "skipped":
        with open(f"outcomes-{os.environ['RANK']}.jsonl", "a") as out:
            text = str(report.longrepr) if report.failed or report.skipped else ""
            out.write(json.dumps([report.nodeid.split("::")[1], report.outcome, text]) + "\\n")
"""

TENSOR_PARALLEL = """
import os

import pytest
import torch
import torch.distributed as dist


def loss(x, w):
    return torch.tanh(x @ w.T).square().sum()


@pytest.mark.parametrize("bug", ["none", "missing_all_reduce"])
@pytest.mark.gradref_ranks(2)
def test_vocab_parallel(gradref_rank, gradref_device, grad_reference, bug):
    with open(f"bodies-{os.getpid()}", "a") as out:
        out.write(f"{gradref_rank.rank} {gradref_rank.world_size} {os.environ['RANK']}\\n")
    x = torch.randn(4, 8, device=gradref_device)
    w = torch.randn(6, 8, device=gradref_device)
    ref = grad_reference(loss, x, w, argnums=(0, 1), shards={"w": 0})
    xl = x.clone().requires_grad_()
    wl = gradref_rank.shard(w).requires_grad_()
    out = loss(xl, wl)
    out.backward()
    total = out.detach()
    dist.all_reduce(total, group=gradref_rank.group)
    gx = xl.grad
    if bug != "missing_all_reduce":
        dist.all_reduce(gx, group=gradref_rank.group)
    ref.assert_close(total, (gx, wl.grad))


@pytest.mark.gradref_ranks(2)
def test_fails_on_rank_1_only(gradref_rank):
    assert gradref_rank.rank == 0, "rank 1's planted failure"


@pytest.mark.gradref_ranks(1)
def test_on_the_first_rank(gradref_rank):
    assert gradref_rank.world_size == 1


@pytest.mark.gradref_ranks(3)
def test_three_ranks(gradref_rank):
    pass


def test_unmarked():
    pass
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--max-restarts=0", *args]


def _in_the_test_folder(path: Path) -> dict[str, str]:
    """The environment with temporary files in ``path``: torchrun keeps the log folder it
    makes for each job (torchelastic_*), which would pile up in the system's."""
    return {**os.environ, "TMPDIR": str(path)}


PYTEST = ["-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", "--gradref-device=cpu"]


def _two_ranks(path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """pytest under ``torchrun --standalone --nproc-per-node=2`` in ``path`` (the rendezvous
    on a port torchrun binds itself: a port picked here and bound later could be taken in
    between by another test's ranks): the run and its output."""
    try:
        done = subprocess.run(
            _torchrun("--standalone", "--nproc-per-node=2", *PYTEST, *args),
            cwd=path,
            env=_in_the_test_folder(path),
            capture_output=True,
            text=True,
            timeout=240,
        )
    except subprocess.TimeoutExpired as expired:
        output = [part for part in (expired.stdout, expired.stderr) if part]
        text = "".join(p.decode() if isinstance(p, bytes) else p for p in output)
        pytest.fail(f"torchrun ran past 240 s; its output so far:\n{text}", pytrace=False)
    return done, done.stdout + done.stderr


def _outcomes(path: Path, rank: int) -> dict[str, tuple[str, str]]:
    lines = (path / f"outcomes-{rank}.jsonl").read_text().splitlines()
    return {name: (outcome, text) for name, outcome, text in map(json.loads, lines)}


def _bodies(path: Path) -> list[tuple[int, ...]]:
    """(rank, world size, RANK) of every body run, one list per process."""
    runs = []
    for file in sorted(path.glob("bodies-*")):
        ranks = {tuple(map(int, line.split())) for line in file.read_text().splitlines()}
        assert len(ranks) == 1, f"one process ran the bodies of several ranks: {ranks}"
        runs.append(ranks.pop())
    return sorted(runs)


def _check_two_ranks(path: Path, output: str) -> None:
    """What both layouts of a two-rank job must show."""
    # Each body ran once per rank, in the launcher's own processes: no pool of the plugin's.
    assert _bodies(path) == [(0, 2, 0), (1, 2, 1)]
    for rank in (0, 1):
        outcomes = _outcomes(path, rank)
        assert outcomes["test_vocab_parallel[none]"][0] == "passed"
        # The planted missing all-reduce fails on both ranks, each on its own gradient.
        outcome, text = outcomes["test_vocab_parallel[missing_all_reduce]"]
        assert outcome == "failed"
        assert "gradient of argument 0 (x)" in text
        assert outcomes["test_unmarked"][0] == "passed"
    # A failure on one rank fails the test on every rank, naming it and its message.
    assert _outcomes(path, 1)["test_fails_on_rank_1_only"][0] == "failed"
    outcome, text = _outcomes(path, 0)["test_fails_on_rank_1_only"]
    assert outcome == "failed"
    assert "gradref_ranks(2) under the launcher: rank(s) 1 failed" in text
    assert "rank 1: AssertionError: rank 1's planted failure" in text
    assert "rank 0: 2 failed, 3 passed, 1 skipped" in output  # rank 0's summary of every rank
    assert "rank 1: 2 failed, 2 passed, 2 skipped" in output


NONE = "test_tp.py::test_vocab_parallel[none]"
ITEMS = ("value", "gradient of argument 0 (x)")  # and w's shard, named by rank


def test_each_process_torchrun_starts_is_one_rank(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_tp=TENSOR_PARALLEL)
    # A baseline with the test but none of its items: the gate says how many items this run
    # has, which counts every rank's.
    empty = {"format_version": 3, "tests": [{"nodeid": NONE, "items": []}]}
    (pytester.path / "baseline.json").write_text(json.dumps(empty))
    done, output = _two_ranks(
        pytester.path, "-rs", "--gradref-report=report.json", "--gradref-baseline=baseline.json"
    )
    assert done.returncode != 0, output
    assert "torchrun: rank 0 of 2 (local rank 0, node 0)" in output
    assert "torchrun: rank 1 of 2 (local rank 1, node 0)" in output
    _check_two_ranks(pytester.path, output)
    # A test for fewer ranks runs on the first ones; one for more skips, with the counts.
    assert _outcomes(pytester.path, 0)["test_on_the_first_rank"][0] == "passed"
    outcome, text = _outcomes(pytester.path, 1)["test_on_the_first_rank"]
    assert outcome == "skipped"
    assert (
        "Skipped: [gradref] gradref_ranks(1) runs on ranks 0 to 0 of the 2 the launcher "
        "started; this is rank 1"
    ) in text
    # Rank 0 writes one report of every rank's items, each labelled with its rank, as a
    # spawned multi-rank test's record holds them; the other rank says so.
    report = json.loads((pytester.path / "report.json").read_text())
    assert report["world_size"] == 2
    tests = {test["nodeid"]: test for test in report["tests"]}
    assert tests[NONE]["ranks"] == [0, 1]
    assert [item["label"] for item in tests[NONE]["items"]] == [
        f"rank {rank}: {what}"
        for rank, rows in ((0, "[0:3]"), (1, "[3:6]"))
        for what in (*ITEMS, f"gradient of argument 1 (w), shard {rank} of 2 along dim 0 {rows}")
    ]
    assert tests[NONE]["outcome"] == "passed"
    assert tests[NONE.replace("none", "missing_all_reduce")]["outcome"] == "failed"
    assert not list(pytester.path.glob("report.rank*"))
    assert output.count("gradref report written to report.json") == 1
    assert "gradref: rank 0 writes every rank's records to report.json" in output
    # Rank 0 gates them all; the other rank says so.
    assert output.count("nothing judged against baseline.json") == 1
    assert f"{NONE}: 0 in baseline.json, {2 * (len(ITEMS) + 1)} in this run" in output
    assert "gradref: rank 0 gates every rank's records on baseline.json" in output
    for rank in (0, 1):
        assert (
            "gradref_ranks(3) needs 3 ranks; the launcher started 2"
            in (_outcomes(pytester.path, rank)["test_three_ranks"][1])
        )


def test_two_torchrun_agents_meet_as_two_nodes(pytester: pytest.Pytester) -> None:
    # What two nodes run, each with its --node-rank, here on the loopback address.
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_tp=TENSOR_PARALLEL)
    port = _free_port()
    agents = [
        subprocess.Popen(
            _torchrun(
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=gradref-two-nodes",
                *PYTEST,
            ),
            cwd=pytester.path,
            env=_in_the_test_folder(pytester.path),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    output = "".join(outputs)
    assert all(agent.returncode != 0 for agent in agents), output
    # Each agent is a node of its own (torchrun numbers them in the order they join).
    nodes = sorted(
        line.split("node ")[1].rstrip(")")
        for line in output.splitlines()
        if line.startswith("torchrun: rank")
    )
    assert nodes == ["0", "1"], output
    _check_two_ranks(pytester.path, output)


def test_ranks_that_collect_different_tests_fail_before_any_runs(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_tp="""
import os

def test_everywhere():
    pass

if os.environ["RANK"] == "1":
    def test_on_rank_1_only():
        pass
"""
    )
    done, output = _two_ranks(pytester.path)
    assert done.returncode != 0
    # Each rank stops with the error, naming the other; torchrun ends the other rank as soon as
    # one exits, so the rank that exits second may be ended before it prints its line.
    lines = [
        f"ERROR: torchrun: rank {rank} of 2 (local rank {rank}, node 0): rank {1 - rank} "
        "collected other tests than this rank: one collected 1 tests, the other 2 (the first "
        "extra: test_tp.py::test_on_rank_1_only)"
        for rank in (0, 1)
    ]
    assert any(line in output for line in lines), output
    assert " passed" not in output


def test_a_hung_rank_prints_its_stack_and_ends_the_job(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_tp="""
import pytest
import torch
import torch.distributed as dist


@pytest.mark.gradref_ranks(2, timeout=3)
def test_rank_1_skips_the_all_reduce(gradref_rank):
    if gradref_rank.rank == 0:
        dist.all_reduce(torch.ones(1))
"""
    )
    done, output = _two_ranks(pytester.path)
    assert done.returncode != 0
    assert (
        "torchrun: rank 0 of 2 (local rank 0, node 0): test_tp.py::"
        "test_rank_1_skips_the_all_reduce ran past the rank timeout of 3 s (from its "
        "@pytest.mark.gradref_ranks(timeout=...)); this rank's stack, then its process ends:"
    ) in output
    # The stack shows where the hung rank waits: in the test's all-reduce.
    assert re.search(r'File ".*test_tp.py", line \d+ in test_rank_1_skips_the_all_reduce', output)


def test_a_crashed_rank_ends_the_job_naming_it(pytester: pytest.Pytester) -> None:
    # Rank 1's process dies in the test (a kernel's segfault would): torchrun
    # (--max-restarts=0) ends the job, rank 0 waiting in the all-reduce included, and names
    # the rank and its signal; nothing reads as a pass.
    pytester.makepyfile(
        test_tp="""
import os
import signal

import pytest
import torch
import torch.distributed as dist


@pytest.mark.gradref_ranks(2)
def test_rank_1_crashes(gradref_rank):
    if gradref_rank.rank == 1:
        os.kill(os.getpid(), signal.SIGABRT)
    dist.all_reduce(torch.ones(1))
"""
    )
    start = time.monotonic()
    done, output = _two_ranks(pytester.path)
    assert done.returncode != 0
    assert time.monotonic() - start < 60, output
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s+exitcode\s*:\s*-6", output), output
    assert "Signal 6 (SIGABRT)" in output, output
    assert " passed" not in output


def test_a_peer_that_fails_before_a_collective_ends_the_job_soon(
    pytester: pytest.Pytester,
) -> None:
    # Rank 1 fails before the all-reduce that rank 0 waits in: rank 0 is ended by its rank
    # timeout, 3 s here (PEER_GRACE_S after rank 1's outcome where that comes first), with the
    # failed peer named, not as a rank that hung on its own.
    source = PEER_FAILS_FIRST.replace("gradref_ranks(2)", "gradref_ranks(2, timeout=3)")
    assert source != PEER_FAILS_FIRST
    pytester.makepyfile(test_tp=source)
    start = time.monotonic()
    done, output = _two_ranks(pytester.path)
    elapsed = time.monotonic() - start
    assert done.returncode != 0
    assert (
        "torchrun: rank 0 of 2 (local rank 0, node 0): test_tp.py::test_rank_1_fails_first: "
        "rank 1 failed, and this rank was still in the test at its rank timeout of 3 s (from "
        "its @pytest.mark.gradref_ranks(timeout=...)), most likely waiting for it in a "
        "collective; this rank's stack, then its process ends:"
    ) in output, output
    assert re.search(r'File ".*test_tp.py", line \d+ in test_rank_1_fails_first', output)
    assert elapsed < 30 + PEER_GRACE_S


class _Ended(Exception):
    pass


class _PeerOutcomes:
    """A launcher store where every peer's outcome of the test is ``outcome`` (or none yet)."""

    def __init__(self, outcome: str | None) -> None:
        self.outcome = outcome

    def check(self, keys: list[str]) -> bool:
        return self.outcome is not None

    def get(self, key: str) -> bytes:
        return json.dumps({"outcome": self.outcome}).encode()


@pytest.mark.parametrize(
    ("peer", "seconds", "why"),
    [
        # A failed peer, the rank timeout far off: ended PEER_GRACE_S after the failure.
        (
            "failed",
            60.0,
            "t.py::test: rank 1 failed, and this rank was still in the test "
            "0.2 s later, most likely waiting for it in a collective",
        ),
        # A failed peer and a rank timeout shorter than the grace: ended at the timeout, put
        # down to the peer, as spawned ranks are.
        (
            "failed",
            0.1,
            "t.py::test: rank 1 failed, and this rank was still in the test at its "
            "rank timeout of 0.1 s (from the marker), most likely waiting for it in a collective",
        ),
        # No peer failed: the rank hung on its own.
        (None, 0.1, "t.py::test ran past the rank timeout of 0.1 s (from the marker)"),
    ],
    ids=["grace", "timeout-after-a-peer-failed", "timeout"],
)
def test_the_watchdog_names_why_it_ends_a_rank(
    monkeypatch: pytest.MonkeyPatch, peer: str | None, seconds: float, why: str
) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist

    from pytest_gradref.ranks import launcher

    store = _PeerOutcomes(peer)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(launcher, "PEER_GRACE_S", 0.2)
    monkeypatch.setattr(launcher, "_WATCH_POLL_S", 0.02)
    ended: list[str] = []

    def end(reason: str) -> None:
        ended.append(reason)
        raise _Ended

    hooks = object.__new__(launcher.LauncherHooks)  # only the watchdog is exercised
    monkeypatch.setattr(hooks, "_end", end, raising=False)
    context = SimpleNamespace(rank=0, world_size=2)
    with pytest.raises(_Ended):
        hooks._watch("t.py::test", "key", context, seconds, "the marker", threading.Event())
    assert ended == [why]
