"""pytest hook implementations and fixtures of pytest-gradref.

Loading this module imports no torch. It imports the configure-time layer at the top: the
settings, the backends' policies, the markers, the session state and the plugin objects that
configure registers (report, baseline, device coverage, xdist, multi-rank tests), none of which
imports torch at load (docs/contributing.md's module table says which module does). The torch
layer is imported inside the functions that cross into it, once a test needs it: the
``grad_reference`` fixture's reference and comparison code, and the simulated device. torch is
imported when a test needs the device (a gradref fixture or marker), when a device is requested
explicitly, or when torch is already loaded.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator
from typing import TYPE_CHECKING

import pytest

from pytest_gradref import hookspecs
from pytest_gradref.config.header import header_once
from pytest_gradref.config.markers import (
    ALL_MARKERS,
    DEVICE_MARKERS,
    MARKER_LINES,
    MarkerError,
    device_mark,
    parse_gradref_mark,
)
from pytest_gradref.config.settings import (
    BASELINE_REFRESH_HELP,
    BASELINE_REFRESH_INI,
    OPTIONS,
    VERDICT_OPTION,
    read_settings,
    read_simulation,
    seed_for_test,
)
from pytest_gradref.config.state import (
    GradrefState,
    gradref_state,
    is_xdist_worker,
    recording_key,
    seed_key,
    state_key,
    threads_key,
)
from pytest_gradref.config.threads import OMP_ENV, apply_threads, plan_threads, usable_cores
from pytest_gradref.config.tolerances import DEFAULT_BUDGET, CheckPolicy
from pytest_gradref.devices.backends import BackendRegistry, builtin_backends
from pytest_gradref.devices.xdist import XdistHooks, worker_device_request
from pytest_gradref.ranks.launcher import (
    LauncherHooks,
    launched_context_key,
    launched_rank,
    left_to_rank_zero,
    refuse_reordering,
)
from pytest_gradref.ranks.pytest_side import RankHooks, rank_fixture
from pytest_gradref.report.device_coverage import USE_ATTRIBUTE, DeviceCoverage, device_use
from pytest_gradref.report.writer import (
    RECORD_ATTRIBUTE,
    ReportCollector,
    check_report_path,
    record_for_test,
)

if TYPE_CHECKING:
    import torch

    from pytest_gradref.devices.backends import Backend
    from pytest_gradref.ranks.worker import RankContext
    from pytest_gradref.reference.grad_reference import GradReference

FIXTURE_NAMES = ("grad_reference", "gradref_device", "gradref_backend", "gradref_rank")


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gradref", "gradient references (pytest-gradref)")
    for spec in OPTIONS:
        spec.add_to(group, parser)
    parser.addini(BASELINE_REFRESH_INI, help=BASELINE_REFRESH_HELP, default="")


@pytest.hookimpl(trylast=True)
def pytest_gradref_register_backends(registry: BackendRegistry) -> None:
    for backend in builtin_backends():
        registry.register_default(backend)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # The simulated device is in place before a conftest, or a module it imports, probes for it
    # (transformers caches is_torch_npu_available() on its first call). So far the command
    # line is parsed into known_args_namespace only; read_settings reads the same again, with
    # the rest, at configure time.
    simulate, numerics = read_simulation(early_config, early_config.known_args_namespace)
    _install_simulation(early_config, simulate, numerics, after_conftests=False)


def _apply_threads(config: pytest.Config, threads: int | str) -> None:
    """Apply the threads setting (threads.py) in this process, an xdist worker's share where
    it is one, and keep the plan for the header. At configure time: only then does a worker
    know it is one (the worker variables of pytest-xdist are inherited by every process a
    test starts, pytester's runs included)."""
    workerinput = getattr(config, "workerinput", None)
    workers = int(workerinput["workercount"]) if workerinput else None
    plan = plan_threads(threads, workers, usable_cores(), os.environ.get(OMP_ENV, "").strip())
    apply_threads(plan)
    config.stash[threads_key] = plan


def _install_simulation(
    config: pytest.Config, simulate: str | None, numerics: str, *, after_conftests: bool
) -> None:
    """Install the simulated device once, with its numerics (cpu or ascend), and say in the
    header what ran before it and may have probed for the device without seeing it."""
    if simulate is None:
        return
    torch_imported = "torch" in sys.modules  # before the simulation imports it
    # The torch layer: simulated.py imports torch, which only a simulated run may pay for here.
    from pytest_gradref.devices import simulated

    if simulated.installed():
        return
    cleared = simulated.install(numerics=numerics)
    notes = simulated.install_notes(
        cleared,
        torch_imported=torch_imported,
        plugins=config.pluginmanager.get_plugins(),
        after_conftests=after_conftests,
    )
    if notes:
        config.pluginmanager.register(simulated.InstallNotes(notes), "gradref-simulation-notes")


def _registry(config: pytest.Config) -> BackendRegistry:
    """The backends this session knows: the built-ins and every plugin's, through the hook."""
    registry = BackendRegistry()
    try:
        config.hook.pytest_gradref_register_backends(registry=registry)
    except ValueError as error:  # a plugin registered a name twice, or an invalid policy
        raise pytest.UsageError(f"pytest_gradref_register_backends: {error}") from None
    return registry


def pytest_configure(config: pytest.Config) -> None:
    registry = _registry(config)  # registers policies; probes none
    settings = read_settings(config, registry)
    # Under torchrun each launcher process is one rank; otherwise the plugin spawns the ranks.
    launched = None if is_xdist_worker(config) else launched_rank(os.environ)
    # A launched rank other than 0 records for rank 0, which writes the report and gates.
    deferred = [] if launched is None else left_to_rank_zero(settings, launched)
    reports = launched is None or launched.rank == 0
    if launched is not None:
        refuse_reordering(config, launched)
    if settings.report and not is_xdist_worker(config):
        check_report_path(settings.report)  # before any test runs, not after the whole suite
    # Installed before the initial conftests (pytest_load_initial_conftests) unless the plugin
    # was loaded late, from a conftest: still before any backend is probed.
    _install_simulation(config, settings.simulate, settings.simulate_numerics, after_conftests=True)
    _apply_threads(config, settings.threads)
    for line in MARKER_LINES:
        config.addinivalue_line("markers", line)
    # An xdist worker takes the device its controller chose instead.
    device_request = worker_device_request(config, registry) or settings.device
    state = GradrefState(registry=registry, settings=settings, device_request=device_request)
    config.stash[state_key] = state
    if launched is None:
        config.pluginmanager.register(RankHooks(config, state), "gradref-ranks")
    else:
        config.pluginmanager.register(
            LauncherHooks(config, state, launched, deferred), "gradref-ranks"
        )
    coverage = DeviceCoverage(strict=settings.strict_device)
    config.pluginmanager.register(coverage, "gradref-device-coverage")
    collector = ReportCollector(
        settings.report if reports else None,
        settings.seed,
        coverage,
        simulated=settings.simulate is not None,
    )
    config.pluginmanager.register(collector, "gradref-report")
    if settings.baseline and reports and not is_xdist_worker(config):
        # On-demand: the gate and its output load only in a run gated on a baseline.
        from pytest_gradref.report.baseline import BaselineGate

        gate = BaselineGate.from_settings(settings, collector)
        config.pluginmanager.register(gate, "gradref-baseline")
    xdist = config.pluginmanager.hasplugin("xdist")
    if xdist:
        config.pluginmanager.register(XdistHooks(state), "gradref-xdist")
    if is_xdist_worker(config) and xdist:
        # A worker knows its device before any test runs and makes it the current one.
        resolution = state.resolution()
        resolution.backend.activate(resolution.device)
    elif device_request.backend is not None or "torch" in sys.modules or _distributing(config):
        # An explicit request is checked before any test runs, and an xdist controller needs
        # the device to hand out; otherwise auto waits until a test needs it.
        state.resolution()


def _distributing(config: pytest.Config) -> bool:
    """Whether this process is an xdist controller that will start workers."""
    numprocesses = config.getoption("numprocesses", None)
    return bool(numprocesses) and not is_xdist_worker(config)


def pytest_report_header(config: pytest.Config) -> list[str]:
    return header_once(config)


def _uses_gradref(item: pytest.Item) -> bool:
    names = getattr(item, "fixturenames", ())
    if any(name in names for name in FIXTURE_NAMES):
        return True
    return any(item.get_closest_marker(name) is not None for name in ALL_MARKERS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = gradref_state(config)
    users = [item for item in items if _uses_gradref(item)]
    if not users:
        return
    resolution = state.resolution()
    known = state.registry.names()
    for item in users:
        try:
            parse_gradref_mark(item.get_closest_marker("gradref"))
            for name in DEVICE_MARKERS:
                for mark in item.iter_markers(name):
                    converted = device_mark(mark, known, resolution.backend.name)
                    if converted is not None:
                        item.add_marker(converted)
        except MarkerError as error:
            raise pytest.UsageError(f"{item.nodeid}: {error}") from None


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    return header_once(config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Seed before fixtures draw their tensors; only where torch is already loaded, so a run
    # without gradient tests never imports it, not where seeding is off, and only the tests
    # that use gradref unless the suite asks for every test (gradref_seed_every_test).
    if "torch" not in sys.modules:
        return
    state = gradref_state(item.config)
    if seed_key in item.stash:  # a rerun (pytest-rerunfailures) is seeded afresh
        del item.stash[seed_key]
    if state.settings.seed is None:
        return
    if not state.settings.seed_every_test and not _uses_gradref(item):
        return  # a test that does not use gradref keeps the suite's own random state
    seed = item.stash[seed_key] = seed_for_test(state.settings.seed, item.nodeid)
    if state.resolved is not None:
        state.resolved.backend.seed(seed)
    else:
        sys.modules["torch"].manual_seed(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    recording = item.stash.get(recording_key, None)
    state = gradref_state(item.config)
    if report.when == "call" and state.resolved is not None:
        report.__dict__[USE_ATTRIBUTE] = device_use(item, _uses_gradref(item), state.resolved)
    if report.when == "call" and recording is not None and state.resolved is not None:
        # A plain attribute travels with the report to the xdist controller.
        report.__dict__[RECORD_ATTRIBUTE] = record_for_test(
            report.nodeid, state.resolved, recording
        )
    return report


@pytest.fixture(scope="session")
def gradref_backend(pytestconfig: pytest.Config) -> Backend:
    """The active backend policy."""
    return gradref_state(pytestconfig).resolution().backend


@pytest.fixture(scope="session")
def gradref_device(pytestconfig: pytest.Config) -> torch.device:
    """The torch.device the tests place their tensors on."""
    return gradref_state(pytestconfig).resolution().device


@pytest.fixture
def gradref_rank(request: pytest.FixtureRequest) -> RankContext:
    """In a test marked ``@pytest.mark.gradref_ranks(N)``, whose body runs in N processes:
    this rank's number, the world size, its device and the process group."""
    launched = request.node.stash.get(launched_context_key, None)
    return launched if launched is not None else rank_fixture(request.node)


@pytest.fixture
def grad_reference(request: pytest.FixtureRequest) -> GradReference:
    """Computes reference values and gradients the way the active backend needs.

    Call it as ``grad_reference(fn, *args, argnums=0, has_aux=False, golden=None,
    rounded=None, **kwargs)``.
    """
    # The torch layer: torch, the reference and the comparison code, once a test asks for them.
    import torch

    from pytest_gradref.reference.grad_reference import GradReference
    from pytest_gradref.reference.recording import Recording

    state = gradref_state(request.config)
    resolution = state.resolution()
    overrides = parse_gradref_mark(request.node.get_closest_marker("gradref"))
    compared = state.settings.report is not None or state.settings.baseline is not None
    # A fresh record per run of the test: pytest-rerunfailures runs it again on the same item.
    recording = request.node.stash[recording_key] = Recording(
        # What gradref seeded, to tell whether the test reseeded torch after it.
        seed=request.node.stash.get(seed_key, None),
        device_type=resolution.backend.device_type,
        # Fingerprints only where a report or a baseline compares runs by them.
        fingerprint=compared,
    )
    strategy = overrides.strategy or resolution.effective_strategy()
    if resolution.effective_strategy() == "crosscheck" and strategy != "crosscheck":
        recording.crosscheck_opt_out = f"@pytest.mark.gradref(strategy={strategy!r})"
    # Statistics cost more than the verdicts: computed where a report or the summary may show
    # them (the summary lists the tightest items with -v or after a crosscheck disagreement).
    statistics = compared or request.config.get_verbosity() > 0 or strategy == "crosscheck"
    # The default verdict judges against a float64 golden; --gradref-verdict=tolerance
    # compares with tolerances and computes none unasked (verdict/criterion.py applies it).
    golden_verdict = state.settings.verdict == "golden"
    policy = CheckPolicy(
        backend=resolution.backend.name,
        table=resolution.backend.tolerances,
        overrides=(overrides.tolerance,) if overrides.tolerance is not None else (),
        budget=overrides.budget,
        statistics=statistics,
        default_golden=torch.float64 if golden_verdict else None,
        default_budget=DEFAULT_BUDGET if golden_verdict else None,
        check_dtype=overrides.check_dtype,
        aux_tolerances=overrides.aux_tolerances,
        golden_off=None
        if golden_verdict
        else (
            f"--gradref-verdict={state.settings.verdict} from "
            f"{state.settings.source(VERDICT_OPTION)}"
        ),
    )
    reference = GradReference(
        strategy=strategy,
        default_strategy=resolution.backend.default_strategy,
        policy=policy,
        golden=overrides.golden,
        golden_on_cpu=resolution.backend.cpu_only_dtypes,
        rounded=overrides.rounded,
        recording=recording,
    )
    launched = request.node.stash.get(launched_context_key, None)
    if launched is None:
        return reference
    # A rank of a test the launcher runs: each rank holds its shards, as a spawned rank does.
    from pytest_gradref.ranks.sharding import RankGradReference

    return RankGradReference.for_rank(reference, launched.rank, launched.world_size)
