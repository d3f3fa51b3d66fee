"""Multi-rank tests under a launcher: when torchrun (or any launcher that sets RANK, WORLD_SIZE
and LOCAL_RANK with MASTER_ADDR and MASTER_PORT) starts pytest, each launcher process is one
rank, and the plugin spawns none of its own.

The session joins the default process group once (``init_method="env://"``), on the backend's
collective library, with LOCAL_RANK choosing the device, and leaves it at the end. A
``gradref_ranks(N)`` test runs its body in place: on the whole world where N is the world size,
on the first N ranks where N is smaller (the others skip it, saying so), nowhere where N is
larger (every rank skips it, with the counts). Unmarked tests run on every rank, as usual.

Every rank must run the same tests in the same order, so xdist and reordering plugins are
refused at configure time and the collected node ids are compared across ranks before any test
runs. After a marked test, its ranks exchange outcomes over the launcher's store (not a
collective, which a rank stuck in an unmatched one would never reach): a failure on any rank
fails the test on every rank, naming the ranks that failed and what they said. A rank that
runs past the rank timeout prints its stack and ends its process, which ends the launcher's job.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import sys
import threading
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gradref.config.markers import RANKS_MARKER
from pytest_gradref.config.settings import DeviceRequest, Setting, Settings, parse_device
from pytest_gradref.ranks.pytest_side import RankHooks, parse_ranks_mark

if TYPE_CHECKING:
    import torch.distributed

    from pytest_gradref.config.resolution import Resolution
    from pytest_gradref.config.state import GradrefState
    from pytest_gradref.ranks.worker import RankContext
    from pytest_gradref.report.device_coverage import DeviceCoverage
    from pytest_gradref.report.writer import ReportCollector

# What a launcher sets in each process it starts (torchrun sets them all, and more).
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")
# The rank's context, on the item of a gradref_ranks test this rank runs.
launched_context_key = pytest.StashKey["RankContext"]()
# The store's keys for one run of one test: a rerun (pytest-rerunfailures) gets fresh ones.
_OUTCOME_PREFIX = "gradref/outcome"
_outcome_key = pytest.StashKey[str]()
_EXCHANGE_GRACE_S = 60.0
# How long a rank may stay in a test after a peer failed it before it is ended as waiting for
# that peer, at most the test's rank timeout (as spawned ranks are, processes.FAILURE_GRACE_S);
# and how often the watchdog looks.
PEER_GRACE_S = 10.0
_WATCH_POLL_S = 0.5


@dataclass(frozen=True)
class LaunchedRank:
    """Who this process is in the launcher's job."""

    rank: int
    world_size: int
    local_rank: int
    node: int

    def header(self) -> str:
        return (
            f"torchrun: rank {self.rank} of {self.world_size} (local rank {self.local_rank}, "
            f"node {self.node})"
        )


def launched_rank(environ: Mapping[str, str]) -> LaunchedRank | None:
    """This process's rank where a launcher started it; None where RANK, WORLD_SIZE and
    LOCAL_RANK are not all set. A usage error where they are but cannot be used."""
    if not all(environ.get(name) for name in RANK_VARIABLES):
        return None
    launcher = ", ".join(f"{name}={environ[name]}" for name in RANK_VARIABLES)
    missing = [name for name in RENDEZVOUS_VARIABLES if not environ.get(name)]
    if missing:
        raise pytest.UsageError(
            f"a launcher set {launcher} but not {' or '.join(missing)}: the ranks meet at "
            "MASTER_ADDR:MASTER_PORT (init_method='env://'); start pytest with torchrun, or "
            "set both"
        )
    numbers = {}
    for name in RANK_VARIABLES:
        try:
            numbers[name] = int(environ[name])
        except ValueError:
            raise pytest.UsageError(
                f"{name}={environ[name]!r} is not an integer ({launcher}); a launcher sets "
                "RANK, WORLD_SIZE and LOCAL_RANK to whole numbers"
            ) from None
    rank, world_size, local_rank = (numbers[name] for name in RANK_VARIABLES)
    if not 0 <= rank < world_size:
        raise pytest.UsageError(f"RANK={rank} is outside 0 to WORLD_SIZE - 1 ({launcher})")
    # torchrun names the node (its agent's rank) GROUP_RANK; elsewhere it follows from how many
    # ranks each node starts.
    per_node = int(environ.get("LOCAL_WORLD_SIZE") or 0)
    node = int(environ.get("GROUP_RANK") or (rank // per_node if per_node else 0))
    return LaunchedRank(rank, world_size, local_rank, node)


def refuse_reordering(config: pytest.Config, launched: LaunchedRank) -> None:
    """A usage error where a plugin would give the ranks different tests or orders."""
    where = f"under a launcher ({launched.header()})"
    # As pytest-xdist decides: it distributes only where it has workers (-n or --tx), so a
    # --dist in a project's addopts, without them, leaves each rank whole.
    distributes = config.getoption("dist", "no") != "no" and config.getoption("tx", None)
    if config.getoption("numprocesses", None) or distributes:
        raise pytest.UsageError(
            f"{where} each launcher process is one rank and runs every test itself; "
            "pytest-xdist would split the tests among workers of each rank: drop -n/--dist "
            "(or add -p no:xdist)"
        )
    if config.pluginmanager.hasplugin("randomly") and config.getoption(
        "randomly_reorganize", False
    ):
        raise pytest.UsageError(
            f"{where} every rank must run the tests in the same order; pytest-randomly "
            "shuffles them in each process: add -p no:randomly (or --randomly-dont-reorganize)"
        )


def left_to_rank_zero(settings: Settings, launched: LaunchedRank) -> list[str]:
    """What a rank other than 0 leaves to rank 0, which gathers every rank's records, writes
    the one report and judges them against the baseline (the other ranks still record, for
    rank 0, but write and judge nothing)."""
    if launched.rank == 0:
        return []
    left = []
    if settings.report is not None:
        left.append(f"rank 0 writes every rank's records to {settings.report}")
    if settings.baseline is not None:
        left.append(f"rank 0 gates every rank's records on {settings.baseline}")
    return left


def first_difference(mine: Sequence[str], theirs: Sequence[str]) -> str:
    """Where two ranks' collections part, in words."""
    for index, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return f"test {index + 1} is {a} here and {b} there"
    shorter, longer = (mine, theirs) if len(mine) < len(theirs) else (theirs, mine)
    extra = longer[len(shorter)]
    return f"one collected {len(shorter)} tests, the other {len(longer)} (the first extra: {extra})"


class LauncherHooks(RankHooks):
    """The hooks of a session a launcher started: one rank per process, no pool."""

    def __init__(
        self,
        config: pytest.Config,
        state: GradrefState,
        launched: LaunchedRank,
        deferred: Sequence[str] = (),
    ) -> None:
        super().__init__(config, state)
        self.launched = launched
        self.deferred = list(deferred)  # the report's and the gate's work rank 0 does
        self._groups: dict[int, torch.distributed.ProcessGroup] = {}
        self._runs: dict[str, int] = {}
        self._collective_name = ""
        self._counts: list[dict[str, int]] = []

    def pytest_report_header(self) -> str:
        return self.launched.header()

    def pytest_sessionstart(self) -> None:
        """Join the launcher's process group, on this rank's device."""
        from datetime import timedelta

        import torch.distributed as dist

        resolution = self._pin_local_device()
        collective = "gloo" if resolution.simulated else resolution.backend.collective_backend
        if collective is None:
            raise pytest.UsageError(
                f"{self.launched.header()}: the {resolution.backend.name} backend declares no "
                "collective_backend, so its ranks cannot form a process group (a backend "
                "declares one with Backend(collective_backend=...))"
            )
        if resolution.device.type != "cpu":
            resolution.backend.activate(resolution.device)
        dist.init_process_group(
            collective, init_method="env://", timeout=timedelta(seconds=self.timeout.seconds)
        )
        self._collective_name = collective

    def _pin_local_device(self) -> Resolution:
        """The session's device: LOCAL_RANK's where the request names no index."""
        resolution = self.state.resolution()
        request = self.state.device_request
        if resolution.device.type == "cpu" or request.index is not None:
            return resolution
        name = f"{resolution.backend.name}:{self.launched.local_rank}"
        local: DeviceRequest = parse_device(
            Setting(name, f"LOCAL_RANK={self.launched.local_rank}"), self.state.registry
        )
        self.state.device_request = local
        self.state.resolved = None
        return self.state.resolution()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Check the markers, then that every rank collected the same tests in one order."""
        super().pytest_collection_modifyitems(items)
        import torch.distributed as dist

        ids = [item.nodeid for item in items]
        digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()
        digests: list[str | None] = [None] * self.launched.world_size
        dist.all_gather_object(digests, digest)
        if len(set(digests)) == 1:
            return
        collections: list[list[str] | None] = [None] * self.launched.world_size
        dist.all_gather_object(collections, ids)
        other = next(r for r, d in enumerate(digests) if d != digest)
        theirs = collections[other]
        assert theirs is not None
        raise pytest.UsageError(
            f"{self.launched.header()}: rank {other} collected other tests than this rank: "
            f"{first_difference(ids, theirs)}. Every rank must run the same tests in the "
            "same order: give every rank the same arguments, files and plugins"
        )

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Give a marked test this rank's context, or skip it where this rank has no part."""
        mark = item.get_closest_marker(RANKS_MARKER)
        if mark is None:
            return
        needed = parse_ranks_mark(mark).world_size
        world = self.launched.world_size
        if needed > world:
            raise pytest.skip.Exception(
                f"[gradref] gradref_ranks({needed}) needs {needed} ranks; the launcher started "
                f"{world}",
                _use_item_location=True,
            )
        group = self._group(needed)  # every rank creates a subgroup, its members or not
        if self.launched.rank >= needed:
            raise pytest.skip.Exception(
                f"[gradref] gradref_ranks({needed}) runs on ranks 0 to {needed - 1} of the "
                f"{world} the launcher started; this is rank {self.launched.rank}",
                _use_item_location=True,
            )
        from pytest_gradref.ranks.worker import RankContext  # on-demand, as in RankHooks

        device = self.state.resolution().device
        item.stash[launched_context_key] = RankContext(
            self.launched.rank, needed, device, group, self._collective_name
        )

    def _group(self, size: int) -> torch.distributed.ProcessGroup:
        import torch.distributed as dist

        if size not in self._groups:
            group = dist.group.WORLD if size == self.launched.world_size else None
            self._groups[size] = group or dist.new_group(ranks=list(range(size)))
        return self._groups[size]

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> bool | None:
        return None  # pytest calls the test here: this process is the rank

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, Any]:
        """Watch a marked test's body: end this rank's process, printing its stack, where it
        runs past the rank timeout, or goes on for PEER_GRACE_S (at most the rank timeout)
        after a peer failed (it then waits in a collective the failed rank will never join)."""
        context = item.stash.get(launched_context_key, None)
        if context is None:
            return (yield)
        run = self._runs[item.nodeid] = self._runs.get(item.nodeid, 0) + 1
        key = item.stash[_outcome_key] = f"{_OUTCOME_PREFIX}/{item.nodeid}/{run}"
        seconds, source = self._timeout(item)
        done = threading.Event()
        watchdog = threading.Thread(
            target=self._watch, args=(item.nodeid, key, context, seconds, source, done)
        )
        watchdog.daemon = True
        watchdog.start()
        try:
            return (yield)
        finally:
            done.set()
            watchdog.join()

    def _watch(
        self,
        nodeid: str,
        key: str,
        context: RankContext,
        seconds: float,
        source: str,
        done: threading.Event,
    ) -> None:
        import time

        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        peers = [f"{key}/{rank}" for rank in range(context.world_size) if rank != context.rank]
        grace = min(seconds, PEER_GRACE_S)
        start = time.monotonic()
        failed_at = None
        while not done.wait(_WATCH_POLL_S):
            now = time.monotonic()
            if failed_at is None:
                for peer in peers:
                    if store.check([peer]) and json.loads(store.get(peer))["outcome"] == "failed":
                        failed_at, failed = now, peer.rsplit("/", 1)[1]
                        break
            # Once a peer failed, this rank's end is put down to it, whichever limit is reached
            # first: it most likely waits for that peer.
            if failed_at is not None and now - failed_at > grace:
                self._end(
                    f"{nodeid}: rank {failed} failed, and this rank was still in the test "
                    f"{grace:g} s later, most likely waiting for it in a collective"
                )
            if now - start > seconds:
                if failed_at is not None:
                    self._end(
                        f"{nodeid}: rank {failed} failed, and this rank was still in the test at "
                        f"its rank timeout of {seconds:g} s (from {source}), most likely "
                        "waiting for it in a collective"
                    )
                self._end(f"{nodeid} ran past the rank timeout of {seconds:g} s (from {source})")

    def _timeout(self, item: pytest.Item) -> tuple[float, str]:
        """A marked test's rank timeout and where it comes from."""
        mark = item.get_closest_marker(RANKS_MARKER)
        assert mark is not None
        request = parse_ranks_mark(mark)
        if request.timeout is not None:
            return request.timeout, "its @pytest.mark.gradref_ranks(timeout=...)"
        return self.timeout.seconds, self.timeout.source

    def _end(self, why: str) -> None:
        """End this rank's process, saying why and printing its stack: the launcher then
        ends the job (torchrun with --max-restarts=0)."""
        # pytest captures the test's output into files this process's end would lose: give
        # the terminal back first.
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        if capture is not None:
            capture.suspend_global_capture(in_=False)
        stderr = sys.__stderr__ or sys.stderr
        print(
            f"\n{self.launched.header()}: {why}; this rank's stack, then its process ends:",
            file=stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=stderr, all_threads=True)
        stderr.flush()
        os._exit(1)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        """After a marked test's body, fail it on every rank where any rank failed it."""
        report = yield
        context = item.stash.get(launched_context_key, None)
        if context is None or call.when != "call":
            return report
        mine = {"outcome": report.outcome, "text": _brief(report)}
        key = item.stash[_outcome_key]
        # Longer than the rank timeout: a hung peer is ended by its own watchdog, which ends
        # the job, before this rank stops waiting for it and goes on to the next collective.
        outcomes = self._exchange(key, context, mine, self._timeout(item)[0] + _EXCHANGE_GRACE_S)
        failed = {r: o for r, o in outcomes.items() if o["outcome"] == "failed"}
        others = {r: o for r, o in failed.items() if r != context.rank}
        if not others:
            return report
        ranks = ", ".join(str(r) for r in sorted(failed))
        lines = [f"gradref_ranks({context.world_size}) under the launcher: rank(s) {ranks} failed"]
        for rank, outcome in sorted(others.items()):
            lines.append(f"rank {rank}: {outcome['text']}")
        if report.failed:
            report.sections.append(("gradref: the other ranks", "\n".join(lines)))
        else:
            report.outcome = "failed"
            report.longrepr = "\n".join(lines)
        return report

    def _exchange(
        self, key: str, context: RankContext, mine: dict[str, str], seconds: float
    ) -> dict[int, dict[str, str]]:
        """Every member rank's outcome of one test run, through the launcher's store."""
        from datetime import timedelta

        import torch.distributed as dist

        # The default group's store: the one every rank of the job reached at init.
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{key}/{context.rank}", json.dumps(mine))
        keys = [f"{key}/{rank}" for rank in range(context.world_size)]
        try:
            store.wait(keys, timedelta(seconds=seconds))
        except RuntimeError as error:  # a rank hung, and will be ended by its own timeout
            missing = [k.rsplit("/", 1)[1] for k in keys if not store.check([k])]
            return {
                **{
                    int(rank): {"outcome": "failed", "text": f"no outcome: {error}"}
                    for rank in missing
                },
                context.rank: mine,
            }
        return {rank: json.loads(store.get(keys[rank])) for rank in range(context.world_size)}

    @pytest.hookimpl(tryfirst=True)  # before the report is written and the gate judges
    def pytest_sessionfinish(self) -> None:
        """Gather every rank's counts for rank 0's summary and its records for rank 0's report
        and gate, then leave the group."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        stats = getattr(reporter, "stats", {})
        mine = {key: len(value) for key, value in stats.items() if key}
        counts: list[dict[str, int] | None] = [None] * self.launched.world_size
        dist.all_gather_object(counts, mine)
        self._counts = [c or {} for c in counts]
        self._gather_records()
        # gather_object returns on a sending rank once its send is queued, while rank 0 may
        # still be receiving; a rank that destroyed the group then could hang both ranks in
        # destroy_process_group (torch 2.6 with gloo, under load: 4 of 15 jobs, none of 24
        # with the barrier). The barrier lets every rank finish its traffic first.
        dist.barrier()
        dist.destroy_process_group()

    def _gather_records(self) -> None:
        """Every rank's test records and devices, onto rank 0's report collector."""
        import torch.distributed as dist

        plugins = self.config.pluginmanager
        collector: ReportCollector | None = plugins.get_plugin("gradref-report")
        coverage: DeviceCoverage | None = plugins.get_plugin("gradref-device-coverage")
        assert collector is not None, "registered by plugin.pytest_configure"
        assert coverage is not None, "registered by plugin.pytest_configure"
        mine = (collector.records, coverage.devices())
        gathered: list[tuple[list[dict[str, Any]], list[str]] | None] | None = None
        if self.launched.rank == 0:
            gathered = [None] * self.launched.world_size
        dist.gather_object(mine, gathered, dst=0)
        if gathered is not None:
            ranks = [g if g is not None else ([], []) for g in gathered]
            collector.merge_ranks(
                [records for records, _ in ranks],
                [device for _, devices in ranks for device in devices],
            )

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.launched.rank != 0:
            for line in self.deferred:
                terminalreporter.write_line(f"gradref: {line}")
        if self.launched.rank != 0 or not self._counts:
            return
        terminalreporter.section("gradref ranks (launcher)")
        for rank, counts in enumerate(self._counts):
            told = ", ".join(f"{n} {key}" for key, n in sorted(counts.items())) or "no tests"
            terminalreporter.line(f"rank {rank}: {told}")


def _brief(report: pytest.TestReport) -> str:
    """A failure's last line (the exception and its message), or the skip's reason."""
    if report.passed:
        return ""
    text = str(report.longrepr).rstrip()
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return f"{crash.message}"
    return text.splitlines()[-1] if text else report.outcome
