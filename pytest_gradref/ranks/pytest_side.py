"""Multi-rank tests: ``@pytest.mark.gradref_ranks(N)`` runs a test's body in N processes on
torch.distributed, and the ``gradref_rank`` fixture tells each rank who it is.

This is the pytest side: the marker, the rank timeout, each rank's device, and the test's
outcome and record made from its ranks'. The processes are processes.py's (the
controller's side) and worker.py's (inside a rank); sharded references are sharding.py's.

How a test reaches its ranks: the controller (the pytest process, or an xdist worker) sets the
test's fixtures up as usual and pickles their values; each rank imports the test's module
(asserts rewritten, as pytest rewrites them), makes its own ``gradref_rank``,
``gradref_device``, ``gradref_backend`` and ``grad_reference``, seeds torch with the test's
seed (the same on every rank, so each draws the same full tensors) and calls the function.

Where ranks run: each on a device of its own among those its xdist worker owns (every visible
one without xdist), or all on the CPU for a CPU backend and a simulated device. The collective
library is the backend's ``collective_backend`` (gloo on a simulated device, whose tensors are
CPU tensors inside).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NoReturn, cast

import pytest

from pytest_gradref.config.markers import MARKERS, RANKS_MARKER, MarkerError
from pytest_gradref.config.number_settings import number_problem
from pytest_gradref.config.settings import RANK_TIMEOUT_OPTION, seed_for_test
from pytest_gradref.config.state import recording_key
from pytest_gradref.devices.backends import builtin_backend
from pytest_gradref.devices.xdist import worker_number
from pytest_gradref.report.writer import rank_label

if TYPE_CHECKING:
    from pytest_gradref.config.resolution import Resolution
    from pytest_gradref.config.state import GradrefState
    from pytest_gradref.ranks.processes import RankPool, RankResult
    from pytest_gradref.ranks.worker import PoolSpec, RankContext, Task
    from pytest_gradref.reference.recording import Recording

_KEYWORDS = MARKERS[RANKS_MARKER].keyword_names
# Pools kept alive at once: each holds its ranks' processes (and, on a GPU, a context on each
# of their devices); a suite rarely mixes more world sizes than this.
MAX_POOLS = 4
# The fixtures each rank makes for itself (worker.py); every other fixture's value comes
# from the controller, pickled.
PER_RANK_FIXTURES = ("gradref_rank", "gradref_device", "gradref_backend")
# The test's devices, chosen at setup (a skip where there are too few).
_devices_key = pytest.StashKey[tuple[str, ...]]()


@dataclass(frozen=True)
class RanksRequest:
    """What a ``gradref_ranks`` marker asks for."""

    world_size: int
    timeout: float | None


def parse_ranks_mark(mark: pytest.Mark) -> RanksRequest:
    """The marker's request; a MarkerError that says what is valid."""
    usage = "write @pytest.mark.gradref_ranks(2) or @pytest.mark.gradref_ranks(2, timeout=60)"
    unknown = sorted(set(mark.kwargs) - set(_KEYWORDS))
    if unknown:
        raise MarkerError(
            f"@pytest.mark.gradref_ranks got unknown keyword(s) {', '.join(unknown)}; valid "
            f"keywords are {', '.join(_KEYWORDS)}"
        )
    if len(mark.args) != 1:
        raise MarkerError(
            f"@pytest.mark.gradref_ranks takes the number of ranks, got {len(mark.args)} "
            f"positional arguments; {usage}"
        )
    world_size = mark.args[0]
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise MarkerError(
            f"@pytest.mark.gradref_ranks got world_size={world_size!r}; it must be an integer "
            f">= 1; {usage}"
        )
    timeout = mark.kwargs.get("timeout")
    problem = None if timeout is None else number_problem(timeout, minimum=0, inclusive=False)
    if problem is not None:
        raise MarkerError(
            f"@pytest.mark.gradref_ranks got timeout={timeout!r}; it {problem} (seconds)"
        )
    return RanksRequest(world_size, None if timeout is None else float(timeout))


class _NotInRank:
    """The controller's ``gradref_rank``: the ranks make their own, and only they run the test
    body. A fixture that takes gradref_rank runs in the controller, where there is no rank."""

    def __getattr__(self, name: str) -> NoReturn:
        pytest.fail(
            f"gradref_rank.{name}: gradref_rank has no rank outside the rank processes: a "
            "fixture that takes it runs in the controller, once for all ranks. Take "
            "gradref_rank in the test itself, which runs in each rank.",
            pytrace=False,
        )


def rank_fixture(node: pytest.Item) -> RankContext:
    """The controller's value of ``gradref_rank`` (the ranks make their own): a stand-in that
    fails any use."""
    if node.get_closest_marker(RANKS_MARKER) is None:
        pytest.fail(
            f"{node.nodeid}: gradref_rank needs the test marked @pytest.mark.gradref_ranks(N), "
            "which runs its body in N ranks on torch.distributed",
            pytrace=False,
        )
    return cast("RankContext", _NotInRank())


def owned_devices(
    count: int, pinned: int | None, worker: tuple[int, int] | None
) -> tuple[list[int], str]:
    """The device indices a process's ranks may take, and who owns them (for a skip).

    Without xdist, every visible device; a pinned index (``--gradref-device=cuda:1``), that
    one. Under xdist with W workers, worker k owns every device whose index is k modulo W
    (so worker k's own device, k, among them: see xdist.assign_devices), or, with fewer devices
    than workers, the one it shares.
    """
    if pinned is not None:
        return [pinned], f"the device pinned by its index ({pinned})"
    if worker is None:
        return list(range(count)), "this process"
    number, workers = worker
    owner = f"xdist worker gw{number} (of {workers})"
    if count >= workers:
        return [i for i in range(count) if i % workers == number % workers], owner
    return [number % max(count, 1)], owner


def rank_devices(
    resolution: Resolution, world_size: int, owned: Sequence[int], owner: str
) -> tuple[str, ...] | str:
    """Each rank's device, or why the test cannot run here (a skip reason naming the counts).

    On the CPU every rank runs on the CPU; a simulated device is CPU memory too, so its ranks
    share the simulated devices; anywhere else each rank needs a device of its own (NCCL and
    HCCL refuse two ranks on one device).
    """
    backend = resolution.backend
    if resolution.device.type == "cpu":
        return ("cpu",) * world_size
    if resolution.simulated:
        return tuple(str(backend.device(owned[r % len(owned)])) for r in range(world_size))
    if len(owned) >= world_size:
        return tuple(str(backend.device(i)) for i in owned[:world_size])
    names = ", ".join(str(backend.device(i)) for i in owned)
    hint = ""
    if owner.startswith("xdist"):
        hint = "; run fewer xdist workers"
    elif backend.visible_devices_env:
        hint = f"; make more visible ({backend.visible_devices_env})"
    return (
        f"gradref_ranks({world_size}) needs {world_size} {backend.name} devices, one per rank; "
        f"{owner} has {len(owned)} ({names}){hint}"
    )


@dataclass(frozen=True)
class _Timeout:
    seconds: float
    source: str


class RankHooks:
    """The hooks of multi-rank tests and the pool of rank processes they share."""

    def __init__(self, config: pytest.Config, state: GradrefState) -> None:
        settings = state.settings
        self.config = config
        self.state = state
        self.timeout = _Timeout(settings.rank_timeout, settings.source(RANK_TIMEOUT_OPTION))
        # One pool per kind of test (world size, devices), the most recently used last: tests
        # of several world sizes, interleaved as parametrized suites order them, reuse theirs.
        self._pools: dict[PoolSpec, RankPool] = {}

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            mark = item.get_closest_marker(RANKS_MARKER)
            if mark is None:
                continue
            try:
                parse_ranks_mark(mark)
                if not isinstance(item, pytest.Function):
                    raise MarkerError("@pytest.mark.gradref_ranks marks test functions only")
                if getattr(item.obj, "is_hypothesis_test", False):
                    # Each rank would draw its own examples: the ranks would not agree.
                    raise MarkerError(
                        "@pytest.mark.gradref_ranks cannot run a Hypothesis test: each rank "
                        "would draw its own examples; parametrize the test instead"
                    )
            except MarkerError as error:
                raise pytest.UsageError(f"{item.nodeid}: {error}") from None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        """Skip before the fixtures are made where the test's ranks cannot run here."""
        mark = item.get_closest_marker(RANKS_MARKER)
        if mark is None:
            return
        devices = self._devices(item, parse_ranks_mark(mark).world_size)
        if isinstance(devices, str):  # reported at the test's location, as a skip mark is
            raise pytest.skip.Exception(f"[gradref] {devices}", _use_item_location=True)
        item.stash[_devices_key] = devices

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> bool | None:
        mark = pyfuncitem.get_closest_marker(RANKS_MARKER)
        if mark is None:
            return None
        request = parse_ranks_mark(mark)
        timeout = self.timeout
        if request.timeout is not None:
            timeout = _Timeout(request.timeout, "its @pytest.mark.gradref_ranks(timeout=...)")
        self._run(pyfuncitem, pyfuncitem.stash[_devices_key], timeout)
        return True

    def pytest_sessionfinish(self) -> None:
        for spec in list(self._pools):
            self._close(spec)

    def _devices(self, item: pytest.Item, world_size: int) -> tuple[str, ...] | str:
        resolution = self.state.resolution()
        if self._collective(resolution) is None:
            return (
                f"the {resolution.backend.name} backend declares no collective_backend, so its "
                "multi-rank tests cannot run (a backend declares one with "
                "Backend(collective_backend=...))"
            )
        import torch.distributed  # the torch layer, once a multi-rank test is to run

        if not torch.distributed.is_available():
            return "this torch build has no torch.distributed"
        # The user's own setting: on an xdist worker the device request is the controller's.
        pinned = self.state.settings.device.index
        workerinput = getattr(self.config, "workerinput", None)
        worker = None
        if workerinput is not None:
            worker = (worker_number(workerinput["workerid"]), workerinput["workercount"])
        owned, owner = owned_devices(resolution.backend.device_count(), pinned, worker)
        return rank_devices(resolution, world_size, owned, owner)

    @staticmethod
    def _collective(resolution: Resolution) -> str | None:
        # A simulated device's tensors are CPU tensors inside, which gloo reduces.
        return "gloo" if resolution.simulated else resolution.backend.collective_backend

    def _run(self, item: pytest.Function, devices: tuple[str, ...], timeout: _Timeout) -> None:
        """Run the test in its ranks, record what they checked, and end it as they did."""
        # The rank processes' modules are on-demand: a run without multi-rank tests never
        # loads them (they would add to every plain session's configure time).
        from pytest_gradref.ranks.processes import RankPool
        from pytest_gradref.ranks.worker import PoolSpec

        resolution = self.state.resolution()
        collective = self._collective(resolution)
        assert collective is not None  # else the test was skipped at setup
        spec = PoolSpec(
            world_size=len(devices),
            devices=devices,
            collective=collective,
            backend=_pickled_backend(resolution),
            simulate=resolution.backend.device_type if resolution.simulated else None,
        )
        task = self._task(item, timeout.seconds)
        pool = self._pools.pop(spec, None)
        if pool is None:
            while len(self._pools) >= MAX_POOLS:
                self._close(next(iter(self._pools)))  # the least recently used
            pool = RankPool(spec, timeout.seconds)
        self._pools[spec] = pool
        try:
            results = pool.run(task)
        except BaseException:  # interrupted (Ctrl-C, pytest-timeout): its ranks may be mid-test
            pool.reusable = False
            raise
        finally:
            if not pool.reusable:
                self._close(spec)
        recording = item.stash.get(recording_key, None)
        if recording is not None:
            merge_recordings(recording, results)
        warn_again(results)
        for result in sorted(results, key=lambda r: r.rank):
            # Shown as pytest shows a test's captured output: on failure, or with -rP.
            for stream in ("stdout", "stderr"):
                text = getattr(result, stream)
                if text:
                    item.add_report_section("call", f"{stream} rank {result.rank}", text)
        conclude(results, spec, timeout.seconds, timeout.source)

    def _task(self, item: pytest.Function, timeout: float) -> Task:
        from pytest_gradref.ranks.worker import Task  # on-demand, as in _run

        # The arguments pytest passes the function (its own pyfunc_call reads the same).
        names = tuple(item._fixtureinfo.argnames)
        sent = {name: item.funcargs[name] for name in names if name not in PER_RANK_FIXTURES}
        seed = self.state.settings.seed
        cls, module = item.cls, item.module
        assert module is not None  # a test function lives in a module
        return Task(
            nodeid=item.nodeid,
            module_name=module.__name__,
            module_path=str(item.path),
            class_name=cls.__qualname__ if cls is not None else None,
            function_name=item.originalname,
            fixtures=_pickled_fixtures(sent),
            per_rank=tuple(name for name in names if name in PER_RANK_FIXTURES),
            seed=None if seed is None else seed_for_test(seed, item.nodeid),
            timeout=timeout,
            rewrite=self.config.getoption("assertmode", "rewrite") == "rewrite",
            tbstyle=str(self.config.getoption("tbstyle", "auto")),
            showlocals=bool(self.config.getoption("showlocals", False)),
            ini_warning_filters=tuple(self.config.getini("filterwarnings")),
            cmdline_warning_filters=tuple(self.config.known_args_namespace.pythonwarnings or ()),
            mark_warning_filters=tuple(
                str(argument)
                for mark in item.iter_markers(name="filterwarnings")
                for argument in mark.args
            ),
        )

    def _close(self, spec: PoolSpec) -> None:
        pool = self._pools.pop(spec, None)
        if pool is not None:
            pool.close()


def _pickled_backend(resolution: Resolution) -> bytes:
    """The backend policy for the ranks. A policy registered in a conftest may hold a lambda
    (its probe, its device count), which does not pickle: the ranks never probe or count, so
    those are left out there."""
    # pickle loads with the first multi-rank test, as the rank processes' modules do (_run):
    # the plugin's import does without it.
    import pickle

    try:
        return pickle.dumps(resolution.backend)
    except Exception:
        always = builtin_backend("cpu").probe  # a module-level function: it pickles
        return pickle.dumps(resolution.backend.replace(probe=always, count_devices=None))


def _pickled_fixtures(values: dict[str, Any]) -> bytes:
    """The fixture values for the ranks; the test fails naming a value that cannot go."""
    import pickle  # on demand, as in _pickled_backend

    try:
        return pickle.dumps(values)
    except Exception:
        pass  # which value it was is found below, outside this handler (no chained traceback)
    for name, value in values.items():
        problem = _pickle_problem(value)
        if problem is not None:
            pytest.fail(
                f"fixture {name!r} gives a {type(value).__name__}, which cannot be sent to the "
                f"rank processes ({problem}). A gradref_ranks test's body runs in "
                "processes of its own: it can take fixtures whose values pickle (tensors, numbers, "
                "strings, paths) and gradref_rank, gradref_device, gradref_backend and "
                "grad_reference, which each rank makes for itself; set anything else up in "
                "the test body",
                pytrace=False,
            )
    return pickle.dumps(values)  # raises again, as no single value failed to


def _pickle_problem(value: Any) -> str | None:
    import pickle  # on demand, as in _pickled_backend

    try:
        pickle.dumps(value)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def merge_recordings(target: Recording, results: Sequence[RankResult]) -> None:
    """What each rank's references checked, into the test's record, each item labelled with
    its rank ("rank 1: gradient of argument 1 (w), ..."), so the report and the gate see every
    rank's items."""
    for result in sorted(results, key=lambda r: r.rank):
        recording = result.recording
        if recording is None:
            continue
        rank = result.rank
        target.ranks = [*(target.ranks or []), rank]
        target.checks.extend(replace(c, label=rank_label(rank, c.label)) for c in recording.checks)
        target.disagreements.extend(
            replace(d, label=rank_label(rank, d.label)) for d in recording.disagreements
        )
        target.strategies.extend(recording.strategies)
        target.add_unchecked_aux(rank_label(rank, label) for label in recording.aux_unchecked)
        target.inputs.extend(recording.inputs)
        target.crosscheck_opt_out = target.crosscheck_opt_out or recording.crosscheck_opt_out
        target.golden_shortfall = target.golden_shortfall or recording.golden_shortfall
        if target.torch_seed is None:
            target.torch_seed, target.reseeded = recording.torch_seed, recording.reseeded


def warn_again(results: Sequence[RankResult]) -> None:
    """Raise each rank's warnings again in the test, named by rank ("rank 1: ..."), where
    pytest records them for its warnings summary."""
    import pickle  # on demand, as in _pickled_backend
    import warnings

    for result in sorted(results, key=lambda r: r.rank):
        for warning in result.warnings:
            category = pickle.loads(warning.category)
            warnings.warn_explicit(
                f"rank {result.rank}: {warning.message}",
                category,
                warning.filename,
                warning.lineno,
            )


# Outcomes that fail the test.
_FAILED = ("failed", "start-failed", "unmatched", "crashed", "hung", "ended")


def conclude(
    results: Sequence[RankResult], spec: PoolSpec, timeout: float, timeout_source: str
) -> None:
    """End the test as its ranks did: failed where any rank failed, hung or crashed (naming
    the rank, with its traceback or stack), else skipped or xfailed where a rank was, else
    passed."""
    world = spec.world_size
    bad = [r for r in results if r.outcome in _FAILED]
    if bad:
        pytest.fail(_failure(results, bad, spec, timeout, timeout_source), pytrace=False)
    skipped = next((r for r in results if r.outcome == "skipped"), None)
    if skipped is not None:
        # Reported at the test's location, as a skip in its body is, not at this line.
        reason = f"rank {skipped.rank} of {world}: {skipped.text}"
        raise pytest.skip.Exception(reason, _use_item_location=True)
    xfailed = next((r for r in results if r.outcome == "xfailed"), None)
    if xfailed is not None:
        pytest.xfail(f"rank {xfailed.rank} of {world}: {xfailed.text}")


def _failure(
    results: Sequence[RankResult],
    bad: Sequence[RankResult],
    spec: PoolSpec,
    timeout: float,
    timeout_source: str,
) -> str:
    """The test's failure: one line naming what each rank did (the first to fail first), then
    each failed rank's traceback, or its stack where it was ended or crashed."""
    world = spec.world_size
    # Outcomes that arrived first explain the others (a rank waiting for a failed one); ranks
    # found hung or still running come last.
    ordered = sorted(bad, key=lambda r: (r.order == 0, r.order, r.rank))
    others = [r for r in results if r.outcome not in _FAILED]
    phrases = [_phrase(r, timeout) for r in ordered] + [_phrase(r, timeout) for r in others]
    lines = [f"gradref_ranks({world}) on {_where(spec)}: " + "; ".join(phrases)]
    for result in ordered:
        lines.append("")
        title = f" rank {result.rank} of {world} on {spec.devices[result.rank]}: {result.outcome} "
        lines.append(title.center(80, "_"))
        if result.text and result.outcome in ("failed", "start-failed", "unmatched"):
            # A later failure most often follows from the first: its traceback in short.
            later = result is not ordered[0] and result.brief
            lines.append((result.brief if later else result.text).rstrip())
        if result.stack:
            lines.append(f"Python stack of rank {result.rank} when it {_when(result)}:")
            lines.append(result.stack)
        elif result.outcome in ("hung", "ended", "crashed"):
            lines.append(f"(rank {result.rank} left no Python stack: {_no_stack(result)})")
    if any(r.outcome == "hung" and r.phase == "test" for r in bad):
        lines += [
            "",
            f"The rank timeout is {timeout:g} s, from {timeout_source}. If the test is only "
            "slow, raise it with @pytest.mark.gradref_ranks(N, timeout=SECONDS), "
            "--gradref-rank-timeout, GRADREF_RANK_TIMEOUT or the gradref_rank_timeout ini key.",
        ]
    return "\n".join(lines)


def _where(spec: PoolSpec) -> str:
    devices = sorted(set(spec.devices))
    return f"{', '.join(devices)} ({spec.collective})"


def _phrase(result: RankResult, timeout: float) -> str:
    """What one rank did, in a few words."""
    rank = f"rank {result.rank}"
    phase = {"start": " while joining the process group", "barrier": " at the end-of-test barrier"}
    where = phase.get(result.phase, "")
    if result.outcome == "failed":
        return f"{rank} failed ({result.summary})"
    if result.outcome == "start-failed":
        return f"{rank} could not start ({result.summary})"
    if result.outcome == "unmatched":
        return f"{rank} passed, then failed at the end-of-test barrier ({result.summary})"
    if result.outcome == "crashed":
        return f"{rank} crashed{where}: {result.summary}"
    if result.outcome == "hung" and result.phase == "barrier":
        return (
            f"{rank} passed, but did not meet the others at the end-of-test barrier: a "
            "collective or send/recv that one rank left unmatched"
        )
    if result.outcome in ("hung", "ended"):
        return f"{rank} {result.outcome}{where}: {result.text}"
    return f"{rank} {result.outcome}"


def _when(result: RankResult) -> str:
    return "was ended" if result.outcome in ("hung", "ended") else result.outcome


def _no_stack(result: RankResult) -> str:
    if result.outcome == "crashed":
        return "SIGKILL cannot be caught" if "SIGKILL" in result.summary else "none was written"
    return "it did not answer the request for one"
