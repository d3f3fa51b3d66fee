"""The rank processes of multi-rank tests, seen from their controller: the pytest process, or
the xdist worker, that runs the test.

``RankPool`` starts N ranks with ``torch.multiprocessing.start_processes``, never by forking
the controller (a rank on an accelerator cannot be forked from a process that has used it):
from multiprocessing's fork server, which imports torch (and torch._dynamo) once and forks
each rank from there, or spawned where the platform has no fork server. It hosts the ranks'
rendezvous, a TCPStore on a port the OS picks, so tests that run side by side never race for
one. The pool is kept while tests pass: a test on live ranks costs little more than its body,
a new pool a fork per rank (a torch import each where they are spawned). It is ended after any
test that did not pass, and a rank that is still running then (hung, or waiting for a rank
that failed) is asked for its Python stack (``STACK_SIGNAL``, written by faulthandler) before
it is killed.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pytest_gradref.ranks import worker
from pytest_gradref.ranks.worker import (
    STACK_SIGNAL,
    PoolSpec,
    RankMessage,
    RankWarning,
    Task,
    rank_main,
)

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from pytest_gradref.reference.recording import Recording

# How long the other ranks may still run once one has failed or crashed: they are most often
# blocked in a collective with it, which only the rank timeout would end otherwise.
FAILURE_GRACE_S = 10.0
# How long a rank has to write its stack once asked.
STACK_WAIT_S = 2.0
# How long ranks told to stop (at the end of the session) have before they are killed.
STOP_WAIT_S = 10.0
# What the fork server imports before it forks the first rank: what every rank imports first.
# torch._dynamo (a second or so of imports) comes with a rank's first custom operator, torch.func
# transform or compiled call, which kernel tests and the grad_and_value reference make; in the
# server it is imported once, not once per rank. These imports initialise no accelerator, so
# forked ranks may still use theirs.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "pytest_gradref.ranks.worker"]
# The least time new ranks have to join their group (a torch import each, side by side on
# shared cores: seconds), whatever a test's own timeout: that bounds its body alone.
START_TIMEOUT_S = 120.0

# A rank's part in one test: a RankMessage's outcome, or what the controller found.
# crashed: the process ended without an outcome; hung: no outcome within the timeout;
# ended: still running the grace period after another rank failed.
Outcome = Literal[
    "passed",
    "failed",
    "skipped",
    "xfailed",
    "start-failed",
    "unmatched",
    "crashed",
    "hung",
    "ended",
]


@dataclass(frozen=True)
class RankResult:
    """One rank's part in one test."""

    rank: int
    outcome: Outcome
    text: str = ""  # the traceback, skip reason, or what ended the rank
    brief: str = ""  # a failure's traceback in --tb=short style
    summary: str = ""  # the exception's type, or the signal, for the one-line summary
    stack: str = ""  # the Python stack faulthandler wrote, where the rank was ended or crashed
    recording: Recording | None = None
    order: int = 0  # in which order outcomes arrived: the first failure is the likely cause
    phase: str = "test"  # start: joining the group; test; barrier: the end-of-test barrier
    warnings: tuple[RankWarning, ...] = ()  # what the rank's test warned of
    stdout: str = ""  # what the rank's test wrote
    stderr: str = ""


class RankPool:
    """N live rank processes, joined in one process group, that run tests one at a time."""

    def __init__(self, spec: PoolSpec, timeout: float) -> None:
        import torch.distributed as dist
        import torch.multiprocessing as mp

        self.spec = spec
        self.reusable = True
        self._ready = False
        self._start_timeout = max(timeout, START_TIMEOUT_S)
        self._directory = tempfile.mkdtemp(prefix="gradref-ranks-")
        # The rendezvous: port 0 asks the OS for a free port, handed to the ranks.
        # TCPStore is public, but torch's stubs do not re-export it.
        self._store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", 0, is_master=True, wait_for_workers=False
        )
        method = start_method()
        context = mp.get_context(method)
        pipes = [context.Pipe() for _ in range(spec.world_size)]
        ends = [child for _, child in pipes]
        environment = dict(os.environ)
        args = (spec, self._store.port, ends, self._directory, self._start_timeout, environment)
        self._processes = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            rank_main, args=args, nprocs=spec.world_size, join=False, start_method=method
        ).processes
        for end in ends:  # the ranks hold them now
            end.close()
        self._connections: list[Connection] = [parent for parent, _ in pipes]
        self._order = 0

    def run(self, task: Task) -> list[RankResult]:
        """Each rank's part in ``task``, by rank; joins the group first on a new pool."""
        if not self._ready:
            started = self._collect(self._start_timeout, "start")
            if any(result.outcome != "passed" for result in started):
                self.reusable = False
                return started
            self._ready = True
        payload = pickle.dumps(task)
        for connection in self._connections:
            connection.send_bytes(payload)
        results = self._collect(task.timeout, "test")
        if any(result.outcome != "passed" for result in results):
            self.reusable = False
            return results
        met = self._collect(task.timeout, "barrier")
        if any(result.outcome != "passed" for result in met):
            self.reusable = False
            # The test's outcomes, with the ranks that did not meet the others at the barrier.
            return [m if m.outcome != "passed" else r for r, m in zip(results, met)]
        return results

    def _collect(self, timeout: float, phase: str) -> list[RankResult]:
        """One result per rank: the message it sends, or what happened to it instead."""
        from multiprocessing.connection import wait

        results: dict[int, RankResult] = {}
        deadline = time.monotonic() + timeout
        grace_from: RankResult | None = None  # the first rank that failed
        while len(results) < len(self._processes):
            pending = [r for r in range(len(self._processes)) if r not in results]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            watched: list[Any] = [self._connections[r] for r in pending]
            watched += [self._processes[r].sentinel for r in pending]
            wait(watched, timeout=remaining)
            for rank in pending:
                result = self._poll(rank, phase)
                if result is None:
                    continue
                results[rank] = result
                if result.outcome not in ("passed", "skipped", "xfailed") and grace_from is None:
                    grace_from = result
                    deadline = min(deadline, time.monotonic() + min(timeout, FAILURE_GRACE_S))
        late = [r for r in range(len(self._processes)) if r not in results]
        if late:
            stacks = self._end(late)
            for rank in late:
                results[rank] = self._late(rank, phase, timeout, grace_from, stacks[rank])
        return [results[rank] for rank in range(len(self._processes))]

    def _poll(self, rank: int, phase: str) -> RankResult | None:
        """The rank's result if it has one now: its message, or its exit without one."""
        connection, process = self._connections[rank], self._processes[rank]
        try:
            if connection.poll():
                message: RankMessage = pickle.loads(connection.recv_bytes())
                return self._from_message(message, phase)
        except (EOFError, OSError):
            pass  # the rank is gone: its exit status says how
        if process.is_alive():
            return None
        process.join(STACK_WAIT_S)
        return self._crashed(rank, process.exitcode, phase)

    def _from_message(self, message: RankMessage, phase: str) -> RankResult:
        self._order += 1
        outcome: Outcome
        if message.status == "ready":
            outcome = "passed"
        elif message.status == "start-failed":
            outcome = "start-failed"
        else:
            outcome = message.status
        return RankResult(
            message.rank,
            outcome,
            text=message.text,
            brief=message.brief,
            summary=message.summary,
            recording=message.recording,
            order=self._order,
            warnings=message.warnings,
            stdout=message.stdout,
            stderr=message.stderr,
            phase=phase,
        )

    def _crashed(self, rank: int, exitcode: int | None, phase: str) -> RankResult:
        self._order += 1
        if exitcode is not None and exitcode < 0:
            name = _signal_name(-exitcode)
            summary = f"killed by signal {name}"
        else:
            summary = f"exited with status {exitcode}"
        return RankResult(
            rank,
            "crashed",
            text=f"the process {summary} without reporting an outcome",
            summary=summary,
            stack=self._stack(rank),
            order=self._order,
            phase=phase,
        )

    def _late(
        self, rank: int, phase: str, timeout: float, first: RankResult | None, stack: str
    ) -> RankResult:
        if first is None:
            outcome: Outcome = "hung"
            text = f"no outcome within the {timeout:g} s rank timeout"
            if phase == "start":
                text = f"did not join the process group within {timeout:g} s"
        else:
            outcome = "ended"
            text = (
                f"still running {min(timeout, FAILURE_GRACE_S):g} s after rank {first.rank} "
                f"{'crashed' if first.outcome == 'crashed' else 'failed'}"
            )
        return RankResult(rank, outcome, text=text, summary=outcome, stack=stack, phase=phase)

    def _end(self, ranks: list[int]) -> dict[int, str]:
        """Ask each rank for its stack, then kill it; the stacks, by rank."""
        for rank in ranks:
            _signal(self._processes[rank], STACK_SIGNAL)
        deadline = time.monotonic() + STACK_WAIT_S
        while time.monotonic() < deadline and not all(self._stack(rank) for rank in ranks):
            time.sleep(0.05)
        time.sleep(0.05)  # a stack of several threads may still be being written
        stacks = {rank: self._stack(rank) for rank in ranks}
        for rank in ranks:
            self._processes[rank].kill()
            self._processes[rank].join(STACK_WAIT_S)
        return stacks

    def _stack(self, rank: int) -> str:
        try:
            with open(os.path.join(self._directory, f"rank-{rank}.txt")) as handle:
                return _below_the_test(handle.read()).strip()
        except OSError:
            return ""

    def close(self) -> None:
        """Stop the ranks (at once, where the pool is not reusable) and free the rendezvous."""
        if self.reusable and self._ready:
            stop = pickle.dumps(None)
            for connection in self._connections:
                with contextlib.suppress(OSError):  # a rank that is gone needs no telling
                    connection.send_bytes(stop)
            deadline = time.monotonic() + STOP_WAIT_S
            for process in self._processes:
                process.join(max(0.0, deadline - time.monotonic()))
        for process in self._processes:
            if process.exitcode is None:
                process.kill()
                process.join(STACK_WAIT_S)
        for connection in self._connections:
            connection.close()
        del self._store
        shutil.rmtree(self._directory, ignore_errors=True)


def start_method() -> Literal["forkserver", "spawn"]:
    """The fork server where the platform has one (it is started, importing torch, with the
    first pool; later pools fork from it), spawn elsewhere."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    # Only read when the server starts: later calls, once it runs, change nothing.
    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    return "forkserver"


def _below_the_test(stack: str) -> str:
    """A faulthandler stack without the frames under the test (the rank's own loop, torch's
    and multiprocessing's start-up): each thread's frames, most recent first, up to the
    rank's frame that called the test."""
    worker_file = f'"{worker.__file__}"'
    lines = []
    skipping = False
    for line in stack.splitlines():
        if not line.startswith("  File "):
            skipping = False  # a thread's header, a blank line, or faulthandler's own notes
        elif worker_file in line:
            skipping = True
        if not skipping:
            lines.append(line)
    return "\n".join(lines)


def _signal(process: Any, number: signal.Signals) -> None:
    if process.pid is not None and process.exitcode is None:
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            os.kill(process.pid, number)


def _signal_name(number: int) -> str:
    try:
        return f"{signal.Signals(number).name} ({number})"
    except ValueError:
        return str(number)
