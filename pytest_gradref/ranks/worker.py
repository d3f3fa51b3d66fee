"""What runs inside a rank process of a multi-rank test (``@pytest.mark.gradref_ranks``).

torch.multiprocessing starts the ranks (processes.py: from a fork server that imported torch
once, or spawned where the platform has no fork server). Each joins the process group
once, then runs the tests its controller sends, one at a time, until told to stop or until its
controller is gone: it imports the test's module (asserts rewritten as pytest rewrites them),
rebuilds the per-rank fixtures, seeds torch with the test's seed, calls the test function and
sends back its outcome and what its references checked. Tests reach the ranks over one
multiprocessing Pipe per rank; the collectives themselves are torch.distributed's.

A rank writes its Python stack to a file of its own (faulthandler): on a fatal signal, and when
the controller sends ``STACK_SIGNAL`` to a rank it is about to end.
"""

from __future__ import annotations

import ast
import contextlib
import faulthandler
import importlib
import importlib.util
import inspect
import os
import pickle
import signal
import sys
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, replace
from importlib.machinery import SourceFileLoader
from typing import IO, TYPE_CHECKING, Any, Literal

import pytest

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from types import CodeType, ModuleType

    import torch
    import torch.distributed

    from pytest_gradref.devices.backends import Backend
    from pytest_gradref.reference.recording import Recording

# The signal with which the controller asks a rank for its Python stack before ending it.
STACK_SIGNAL = signal.SIGUSR1
# How often an idle rank checks that its controller is still there.
IDLE_POLL_S = 1.0
# torch's own collective timeout, far beyond any rank timeout: the controller ends a hung rank
# with every rank's stack, which torch's timeout (an exception in one rank, or NCCL's watchdog
# aborting the process) would pre-empt with less.
COLLECTIVE_TIMEOUT_S = 24 * 3600.0

# What a rank reports: ready (joined the group, or met the others after a passing test),
# start-failed, and a test's outcome; unmatched: a passing test left a collective the others
# did not meet at the end-of-test barrier.
Status = Literal["ready", "start-failed", "passed", "failed", "skipped", "xfailed", "unmatched"]


@dataclass(frozen=True)
class RankContext:
    """What the ``gradref_rank`` fixture gives each rank of a multi-rank test.

    Attributes:
        rank: this rank, 0 to world_size - 1.
        world_size: how many ranks run the test.
        device: the rank's device (also the ``gradref_device`` fixture in the rank).
        group: the default process group (``torch.distributed.group.WORLD``).
        collective: its torch.distributed backend, e.g. "gloo" or "nccl".
    """

    rank: int
    world_size: int
    device: torch.device
    group: torch.distributed.ProcessGroup
    collective: str

    def shard(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's slice of a full tensor along ``dim``, as the reference's gradients are
        sliced (DTensor's ``Shard(dim)``: pieces of ceil(size / world_size)): a new leaf
        tensor, contiguous, that requires grad where ``tensor`` does."""
        # The torch layer: sharding.py imports the reference code (grad_reference.py, result.py).
        from pytest_gradref.ranks.sharding import Cut

        piece = Cut(dim % max(tensor.dim(), 1), self.rank, self.world_size).apply(tensor.detach())
        return piece.clone().requires_grad_(tensor.requires_grad)


@dataclass(frozen=True)
class PoolSpec:
    """What a pool of rank processes is started with; tests with equal specs share a pool."""

    world_size: int
    devices: tuple[str, ...]  # one per rank
    collective: str  # the torch.distributed backend: gloo, nccl, hccl...
    backend: bytes  # the Backend policy, pickled: unpickled after the simulation is in place
    simulate: str | None  # the device type --gradref-simulate simulates


@dataclass(frozen=True)
class Task:
    """One test, as each rank runs it."""

    nodeid: str
    module_name: str
    module_path: str
    class_name: str | None  # the qualified name of the test's class, for a method
    function_name: str
    fixtures: bytes  # the controller's fixture values the test takes, pickled
    per_rank: tuple[str, ...]  # the fixtures the test takes that each rank makes itself
    seed: int | None
    timeout: float
    rewrite: bool  # rewrite the module's asserts (pytest's assert mode is rewrite)
    tbstyle: str
    showlocals: bool
    # The warning filters pytest applies around the test in the controller, in its order (a
    # later filter wins): the ini's filterwarnings, -W, the test's filterwarnings marks.
    ini_warning_filters: tuple[str, ...] = ()
    cmdline_warning_filters: tuple[str, ...] = ()
    mark_warning_filters: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankWarning:
    """A warning a rank's test raised, for the controller to raise again in the test."""

    category: bytes  # the warning's class, pickled (a test module's own class included)
    message: str
    filename: str
    lineno: int


@dataclass(frozen=True)
class RankMessage:
    """What a rank sends its controller."""

    rank: int
    status: Status
    text: str = ""  # the failure's traceback (in the session's --tb style), the skip's reason
    summary: str = ""  # the exception's type, for the test's one-line summary
    brief: str = ""  # the failure's traceback in --tb=short style
    recording: Recording | None = None
    warnings: tuple[RankWarning, ...] = ()
    stdout: str = ""  # what the test wrote, natively or from Python
    stderr: str = ""


def rank_main(
    rank: int,
    spec: PoolSpec,
    store_port: int,
    connections: list[Connection],
    stack_dir: str,
    start_timeout: float,
    environment: dict[str, str],
) -> None:
    """A rank's life: join the group, then run tests until told to stop (torch's
    start_processes entry point, so its first argument is the rank)."""
    # A rank forked by the fork server starts with the server's environment, the controller's
    # when the server started: the controller's of now is what a spawned rank would see.
    os.environ.clear()
    os.environ.update(environment)
    # The rank's parent: the controller, or the fork server, which ends with the controller.
    parent = os.getppid()
    connection = connections[rank]
    for other in connections:
        if other is not connection:
            other.close()
    stack = open(os.path.join(stack_dir, f"rank-{rank}.txt"), "w")  # noqa: SIM115 (faulthandler's, for good)
    faulthandler.enable(file=stack, all_threads=True)
    faulthandler.register(STACK_SIGNAL, file=stack, all_threads=True)
    try:
        context, backend = _join(rank, spec, store_port, start_timeout)
    except BaseException as error:
        _send(connection, RankMessage(rank, "start-failed", traceback.format_exc(), _name(error)))
        return
    _send(connection, RankMessage(rank, "ready"))
    import torch.distributed as dist

    while _wait_for_task(connection, parent):
        task: Task | None = pickle.loads(connection.recv_bytes())
        if task is None:
            break
        stack.seek(0)
        stack.truncate()
        with _captured_output(stack_dir, rank) as output:
            message = _run(task, context, backend, stack)
        message = replace(message, stdout=output[0], stderr=output[1])
        _send(connection, message)
        if message.status != "passed":
            # The controller ends the pool after a test that did not pass. Leaving now closes
            # this rank's connections, so a peer waiting for it in a collective fails at once
            # (gloo) instead of waiting out the controller's grace.
            _leave()
        try:
            dist.barrier()  # a collective one rank left unmatched shows here, not in the next test
        except BaseException as error:
            _send(connection, RankMessage(rank, "unmatched", traceback.format_exc(), _name(error)))
            _leave()
        _send(connection, RankMessage(rank, "ready"))
    dist.destroy_process_group()


def _join(
    rank: int, spec: PoolSpec, store_port: int, timeout: float
) -> tuple[RankContext, Backend]:
    """Set the rank's device up and join the process group over the controller's store."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if spec.simulate is not None:
        from pytest_gradref.devices import simulated

        simulated.install()
    backend: Backend = pickle.loads(spec.backend)
    reason = backend.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the {backend.name} backend is unavailable in rank {rank}: {reason}")
    if "OMP_NUM_THREADS" not in os.environ:
        # As torchrun does: N ranks on one host's cores would otherwise oversubscribe them.
        torch.set_num_threads(1)
    device = torch.device(spec.devices[rank])
    backend.activate(device)
    # TCPStore is public, but torch's stubs do not re-export it.
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=timeout)
    )
    dist.init_process_group(
        spec.collective,
        store=store,
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    group = dist.group.WORLD
    assert group is not None
    return RankContext(rank, spec.world_size, device, group, spec.collective), backend


def _wait_for_task(connection: Connection, parent: int) -> bool:
    """Whether a message came; False once the rank's parent, and so its controller, is gone
    (a rank never outlives it: an orphan is adopted by another process)."""
    while not connection.poll(IDLE_POLL_S):
        if os.getppid() != parent:
            return False
    return True


def _send(connection: Connection, message: RankMessage) -> None:
    # Plain pickle, not the connection's own (torch's reductions would put the recording's
    # tensors in shared memory); flushed first, so the test's output lands with its test.
    sys.stdout.flush()
    sys.stderr.flush()
    connection.send_bytes(pickle.dumps(message))


def _leave() -> None:
    """End the process now: a process group whose peers are gone may block in its destructor."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _name(error: BaseException) -> str:
    return type(error).__name__


def _run(task: Task, context: RankContext, backend: Backend, stack: IO[str]) -> RankMessage:
    """Run one test and say how it went."""
    # A backstop for a rank whose controller was killed while the test hangs: the controller
    # ends a hung rank itself, after task.timeout.
    faulthandler.dump_traceback_later(task.timeout * 2 + 60, exit=True, file=stack)
    function = None
    recording = None
    caught: list[warnings.WarningMessage] = []
    status: Status
    try:
        with warnings.catch_warnings(record=True) as caught:
            _apply_warning_filters(task)
            function = _test_function(task)
            kwargs = pickle.loads(task.fixtures)
            reference = kwargs.get("grad_reference")
            if reference is not None:
                from pytest_gradref.ranks.sharding import RankGradReference

                recording = reference.recording
                kwargs["grad_reference"] = RankGradReference.for_rank(
                    reference, context.rank, context.world_size
                )
            per_rank = {
                "gradref_rank": context,
                "gradref_device": context.device,
                "gradref_backend": backend,
            }
            kwargs.update((name, per_rank[name]) for name in task.per_rank)
            if task.seed is not None:
                # The same seed on every rank: each draws the same full tensors, and slices
                # them.
                backend.seed(task.seed)
            function(**kwargs)
    except pytest.skip.Exception as skip:
        status, text, summary, brief = "skipped", skip.msg or "", "", ""
    except pytest.xfail.Exception as xfail:
        status, text, summary, brief = "xfailed", xfail.msg or "", "", ""
    except BaseException as error:
        text, brief = _describe(error, function, task)
        status, summary = "failed", _name(error)
    else:
        status, text, summary, brief = "passed", "", "", ""
    finally:
        faulthandler.cancel_dump_traceback_later()
    return RankMessage(
        context.rank,
        status,
        text,
        summary,
        brief,
        _portable(recording),
        tuple(_rank_warning(message) for message in caught),
    )


@contextlib.contextmanager
def _captured_output(directory: str, rank: int) -> Iterator[list[str]]:
    """The test's stdout and stderr, in that order once the block ends: file descriptors 1
    and 2 go to files of this rank's for the test's span, so native writes (a kernel's, a
    collective library's) are kept with Python's. The controller shows them by rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    texts: list[str] = []
    saved = [os.dup(1), os.dup(2)]
    files = [
        open(os.path.join(directory, f"rank-{rank}.{name}"), "w+b")  # noqa: SIM115 (closed below)
        for name in ("stdout", "stderr")
    ]
    try:
        os.dup2(files[0].fileno(), 1)
        os.dup2(files[1].fileno(), 2)
        yield texts
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original in zip((1, 2), saved):
            os.dup2(original, fd)
            os.close(original)
        for file in files:
            file.seek(0)
            texts.append(file.read().decode(errors="replace"))
            file.close()


def _apply_warning_filters(task: Task) -> None:
    """The controller's warning filters, as pytest applies them around a test: so that -W
    error makes a rank's warning that rank's failure, and an ignored one stays ignored."""
    from _pytest.config import apply_warning_filters, parse_warning_filter

    warnings.filterwarnings("always", category=DeprecationWarning)
    warnings.filterwarnings("always", category=PendingDeprecationWarning)
    apply_warning_filters(task.ini_warning_filters, task.cmdline_warning_filters)
    for argument in task.mark_warning_filters:
        warnings.filterwarnings(*parse_warning_filter(argument, escape=False))


def _rank_warning(message: warnings.WarningMessage) -> RankWarning:
    try:
        category = pickle.dumps(message.category)
    except Exception:  # a class defined where the controller cannot import it
        category = pickle.dumps(UserWarning)
    return RankWarning(category, str(message.message), message.filename, message.lineno)


# The test modules a rank imported, by path: a rank runs each module's tests in one import.
_modules: dict[str, ModuleType] = {}


def _test_function(task: Task) -> Any:
    module = _modules.get(task.module_path)
    if module is None:
        module = _modules[task.module_path] = _import(task)
    owner: Any = module
    if task.class_name is not None:
        for part in task.class_name.split("."):
            owner = getattr(owner, part)
        owner = owner()  # a fresh instance per test, as pytest makes
    return getattr(owner, task.function_name)


def _import(task: Task) -> ModuleType:
    """The test module, under the name pytest gave it (so that the controller's pickled values
    of its classes unpickle), its asserts rewritten where pytest rewrites them."""
    package = task.module_name.rpartition(".")[0]
    if package:
        # Relative imports in the module need its package; under --import-mode=importlib the
        # package may not be importable, and the module needs none.
        with contextlib.suppress(ImportError):
            importlib.import_module(package)
    loader_type = _RewritingLoader if task.rewrite else SourceFileLoader
    loader = loader_type(task.module_name, task.module_path)
    spec = importlib.util.spec_from_file_location(task.module_name, task.module_path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[task.module_name] = module
    try:
        loader.exec_module(module)
    except BaseException:
        del sys.modules[task.module_name]
        raise
    return module


class _RewritingLoader(SourceFileLoader):
    """Loads a test module with its asserts rewritten as pytest's import hook rewrites them, so
    a failing ``assert`` in a rank explains itself as it does in pytest. Compiled from the
    source every time: no cache written, none read (a plain import's cache lacks the rewrite)."""

    def get_code(self, fullname: str) -> CodeType:
        from _pytest.assertion.rewrite import rewrite_asserts

        source = self.get_data(self.path)
        tree = ast.parse(source, filename=self.path)
        rewrite_asserts(tree, source, self.path)
        code: CodeType = compile(tree, self.path, "exec", dont_inherit=True)
        return code


def _describe(error: BaseException, function: Any, task: Task) -> tuple[str, str]:
    """The failure as pytest shows a test's, in the session's --tb style and in the short one
    (for a rank that failed after another, most often because of it): the traceback from the
    test function down to the line that failed, frames marked ``__tracebackhide__`` left out
    (so a failing assert_close ends at the test's line)."""
    excinfo = pytest.ExceptionInfo.from_exception(error)
    code = None
    if function is not None:
        code = inspect.unwrap(getattr(function, "__func__", function)).__code__
    styles: dict[str, Literal["long", "short", "line", "native"]] = {
        "short": "short",
        "line": "line",
        "native": "native",
    }
    style = styles.get(task.tbstyle, "long")  # auto, long, and no (whose output is not shown)

    def from_test(info: pytest.ExceptionInfo[BaseException]) -> Any:
        entries = info.traceback
        start = next((i for i, e in enumerate(entries) if e.frame.code.raw is code), 0)
        kept = entries[start:].filter(info)
        if task.tbstyle == "auto" and len(kept) > 2:  # as pytest's auto: the ends in full
            middle = (entry.with_repr_style("short") for entry in kept[1:-1])
            kept = type(kept)([kept[0], *middle, kept[-1]])
        return kept

    try:
        return tuple(  # type: ignore[return-value]
            str(excinfo.getrepr(style=s, showlocals=task.showlocals, tbfilter=from_test))
            for s in (style, "short")
        )
    except Exception:  # pytest could not format it: Python's own traceback says the same
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return text, text


def _portable(recording: Recording | None) -> Recording | None:
    """The recording with its sampled inputs on the CPU: the controller reads them on its own
    device, which may not be this rank's."""
    if recording is None or not recording.inputs:
        return recording
    from pytest_gradref.reference.inputs import SampledInputs

    moved: list[SampledInputs | None] = []
    for sampled in recording.inputs:
        if sampled is None:
            moved.append(None)
            continue
        import torch

        cpu = torch.device("cpu")
        offsets: dict[torch.device, int] = {}
        blocks: list[torch.Tensor] = []
        for device, block in sampled.data.items():
            offsets[device] = sum(b.numel() for b in blocks)
            blocks.append(block.cpu())
        spans = tuple(
            (cpu, offsets[d] + start, offsets[d] + end) for d, start, end in sampled.spans
        )
        data = {cpu: torch.cat(blocks)} if blocks else {}
        moved.append(SampledInputs(sampled.description, data, spans))
    return replace(recording, inputs=moved)
