"""pytest hook implementations and fixtures of pytest-gradref.

Loading this module imports no torch and none of the package's other modules but the hook
specifications: each hook and fixture imports what it needs when it first runs. A project that
has the plugin installed but no gradient tests never loads the reference and comparison code,
nor torch. torch is imported when a test needs the device (a gradref fixture or marker), when
a device is requested explicitly, or when torch is already loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Generator
from typing import TYPE_CHECKING

import pytest

from pytest_gradref import hookspecs

if TYPE_CHECKING:
    import torch

    from pytest_gradref.backends import Backend, BackendRegistry
    from pytest_gradref.fixture import GradReference
    from pytest_gradref.ranks import RankContext

FIXTURE_NAMES = ("grad_reference", "gradref_device", "gradref_backend", "gradref_rank")


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    from pytest_gradref.settings import BASELINE_REFRESH_HELP, BASELINE_REFRESH_INI, OPTIONS

    group = parser.getgroup("gradref", "gradient references (pytest-gradref)")
    for spec in OPTIONS:
        spec.add_to(group, parser)
    parser.addini(BASELINE_REFRESH_INI, help=BASELINE_REFRESH_HELP, default="")


@pytest.hookimpl(trylast=True)
def pytest_gradref_register_backends(registry: BackendRegistry) -> None:
    from pytest_gradref.backends import builtin_backends

    for backend in builtin_backends():
        registry.register_default(backend)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    # The simulated device is in place before a conftest, or a module it imports, probes for it
    # (transformers caches is_torch_npu_available() on its first call). So far the command
    # line is parsed into known_args_namespace only.
    from pytest_gradref.settings import (
        SIMULATE_NUMERICS_OPTION,
        SIMULATE_OPTION,
        OptionSpec,
        Setting,
        parse_simulate,
        parse_simulate_numerics,
        read_setting,
    )

    def early(spec: OptionSpec) -> Setting:
        cli = getattr(early_config.known_args_namespace, spec.dest, None)
        if cli is not None:
            return Setting(str(cli), f"the {spec.flag} option")
        return read_setting(early_config, spec)

    simulate = parse_simulate(early(SIMULATE_OPTION))
    numerics = parse_simulate_numerics(early(SIMULATE_NUMERICS_OPTION), simulate)
    _install_simulation(early_config, simulate, numerics, after_conftests=False)


def _install_simulation(
    config: pytest.Config, simulate: str | None, numerics: str, *, after_conftests: bool
) -> None:
    """Install the simulated device once, with its numerics (cpu or ascend), and say in the
    header what ran before it and may have probed for the device without seeing it."""
    if simulate is None:
        return
    torch_imported = "torch" in sys.modules  # before the simulation imports it
    from pytest_gradref import simulated

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


def pytest_configure(config: pytest.Config) -> None:
    from pytest_gradref.backends import BackendRegistry
    from pytest_gradref.device_coverage import DeviceCoverage
    from pytest_gradref.markers import MARKER_LINES
    from pytest_gradref.report import ReportCollector, check_report_path
    from pytest_gradref.settings import (
        BASELINE_FAIL_OPTION,
        BASELINE_OPTION,
        BASELINE_THRESHOLD_OPTION,
        DEVICE_OPTION,
        REPORT_OPTION,
        SEED_OPTION,
        SIMULATE_NUMERICS_OPTION,
        SIMULATE_OPTION,
        STRATEGY_OPTION,
        STRICT_DEVICE_OPTION,
        VERDICT_OPTION,
        parse_device,
        parse_flag,
        parse_seed,
        parse_simulate,
        parse_simulate_numerics,
        parse_strategy,
        parse_verdict,
        read_setting,
    )
    from pytest_gradref.state import GradrefState, is_xdist_worker, state_key

    for gate_option in (BASELINE_FAIL_OPTION, BASELINE_THRESHOLD_OPTION):
        given = config.getoption(gate_option.dest) not in (None, False)
        if given and not config.getoption(BASELINE_OPTION.dest):
            # A gate without a baseline would pass on nothing.
            raise pytest.UsageError(
                f"{gate_option.flag} needs {BASELINE_OPTION.flag}=BASE.json, the report to "
                f"compare the run with; add {BASELINE_OPTION.flag}, or drop {gate_option.flag}"
            )
    report_path = config.getoption(REPORT_OPTION.dest)
    if report_path and not is_xdist_worker(config):
        check_report_path(report_path)  # before any test runs, not after the whole suite
    simulate = parse_simulate(read_setting(config, SIMULATE_OPTION))
    numerics = parse_simulate_numerics(read_setting(config, SIMULATE_NUMERICS_OPTION), simulate)
    # Installed before the initial conftests (pytest_load_initial_conftests) unless the plugin
    # was loaded late, from a conftest: still before any backend is registered or probed.
    _install_simulation(config, simulate, numerics, after_conftests=True)
    for line in MARKER_LINES:
        config.addinivalue_line("markers", line)
    from pytest_gradref.ranks import RankHooks

    config.pluginmanager.register(RankHooks(config), "gradref-ranks")
    registry = BackendRegistry()
    try:
        config.hook.pytest_gradref_register_backends(registry=registry)
    except ValueError as error:  # a plugin registered a name twice, or an invalid policy
        raise pytest.UsageError(f"pytest_gradref_register_backends: {error}") from None
    device_request = parse_device(read_setting(config, DEVICE_OPTION), registry)
    xdist_hooks = None
    if config.pluginmanager.hasplugin("xdist"):
        from pytest_gradref.xdist import XdistHooks, worker_device_request

        xdist_hooks = XdistHooks
        # An xdist worker takes the device its controller chose instead.
        device_request = worker_device_request(config, registry) or device_request
    strategy_setting = read_setting(config, STRATEGY_OPTION)
    seed_setting = read_setting(config, SEED_OPTION)
    seed = parse_seed(seed_setting)
    state = GradrefState(
        registry=registry,
        device_request=device_request,
        strategy=parse_strategy(strategy_setting),
        strategy_source=strategy_setting.source,
        seed=seed,
        verdict=parse_verdict(read_setting(config, VERDICT_OPTION)),
        simulated=frozenset({simulate} if simulate else ()),
        seed_source=seed_setting.source,
    )
    config.stash[state_key] = state
    coverage = DeviceCoverage(strict=parse_flag(read_setting(config, STRICT_DEVICE_OPTION)))
    config.pluginmanager.register(coverage, "gradref-device-coverage")
    collector = ReportCollector(report_path, seed, coverage, simulated=simulate is not None)
    config.pluginmanager.register(collector, "gradref-report")
    if config.getoption(BASELINE_OPTION.dest) and not is_xdist_worker(config):
        from pytest_gradref.baseline import BaselineGate

        gate = BaselineGate.from_config(config, collector)
        config.pluginmanager.register(gate, "gradref-baseline")
    if xdist_hooks is not None:
        config.pluginmanager.register(xdist_hooks(state), "gradref-xdist")
    if is_xdist_worker(config) and xdist_hooks is not None:
        # A worker knows its device before any test runs and makes it the current one.
        setup = state.setup()
        setup.backend.activate(setup.device)
    elif device_request.backend is not None or "torch" in sys.modules or _distributing(config):
        # An explicit request is checked before any test runs, and an xdist controller needs
        # the device to hand out; otherwise auto waits until a test needs it.
        state.setup()


def _distributing(config: pytest.Config) -> bool:
    """Whether this process is an xdist controller that will start workers."""
    from pytest_gradref.state import is_xdist_worker

    numprocesses = config.getoption("numprocesses", None)
    return bool(numprocesses) and not is_xdist_worker(config)


def _header_once(config: pytest.Config) -> list[str]:
    """The gradref header line, the first time it is asked for after the setup is resolved:
    in the header where the device was resolved at configure time, else after collection
    (auto resolves once a collected test needs the device)."""
    from pytest_gradref.state import gradref_state

    state = gradref_state(config)
    if state.resolved is None or state.reported:
        return []
    state.reported = True
    seed: int | str = (
        state.seed
        if state.seed is not None
        else f"off (from {state.seed_source}: gradref leaves torch's seeding to the suite)"
    )
    return [state.resolved.header_line(seed, state.verdict)]


def pytest_report_header(config: pytest.Config) -> list[str]:
    return _header_once(config)


def _uses_gradref(item: pytest.Item) -> bool:
    from pytest_gradref.markers import ALL_MARKERS

    names = getattr(item, "fixturenames", ())
    if any(name in names for name in FIXTURE_NAMES):
        return True
    return any(item.get_closest_marker(name) is not None for name in ALL_MARKERS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from pytest_gradref.markers import DEVICE_MARKERS, MarkerError, device_mark, parse_gradref_mark
    from pytest_gradref.state import gradref_state

    state = gradref_state(config)
    users = [item for item in items if _uses_gradref(item)]
    if not users:
        return
    setup = state.setup()
    known = state.registry.names()
    for item in users:
        try:
            parse_gradref_mark(item.get_closest_marker("gradref"))
            for name in DEVICE_MARKERS:
                for mark in item.iter_markers(name):
                    converted = device_mark(mark, known, setup.backend.name)
                    if converted is not None:
                        item.add_marker(converted)
        except MarkerError as error:
            raise pytest.UsageError(f"{item.nodeid}: {error}") from None


def pytest_report_collectionfinish(config: pytest.Config) -> list[str]:
    return _header_once(config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Seed before fixtures draw their tensors; only where torch is already loaded, so a run
    # without gradient tests never imports it, and not where seeding is off.
    if "torch" not in sys.modules:
        return
    from pytest_gradref.settings import seed_for_test
    from pytest_gradref.state import gradref_state, seed_key

    state = gradref_state(item.config)
    if seed_key in item.stash:  # a rerun (pytest-rerunfailures) is seeded afresh
        del item.stash[seed_key]
    if state.seed is None:
        return
    seed = item.stash[seed_key] = seed_for_test(state.seed, item.nodeid)
    if state.resolved is not None:
        state.resolved.backend.seed(seed)
    else:
        sys.modules["torch"].manual_seed(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    from pytest_gradref.state import gradref_state, recording_key

    report = yield
    recording = item.stash.get(recording_key, None)
    state = gradref_state(item.config)
    if report.when == "call" and state.resolved is not None:
        from pytest_gradref.device_coverage import USE_ATTRIBUTE, device_use

        report.__dict__[USE_ATTRIBUTE] = device_use(item, _uses_gradref(item), state.resolved)
    if report.when == "call" and recording is not None and state.resolved is not None:
        from pytest_gradref.report import RECORD_ATTRIBUTE, record_for_test

        # A plain attribute travels with the report to the xdist controller.
        report.__dict__[RECORD_ATTRIBUTE] = record_for_test(
            report.nodeid, state.resolved, recording
        )
    return report


@pytest.fixture(scope="session")
def gradref_backend(pytestconfig: pytest.Config) -> Backend:
    """The active backend policy."""
    from pytest_gradref.state import gradref_state

    return gradref_state(pytestconfig).setup().backend


@pytest.fixture(scope="session")
def gradref_device(pytestconfig: pytest.Config) -> torch.device:
    """The torch.device the tests place their tensors on."""
    from pytest_gradref.state import gradref_state

    return gradref_state(pytestconfig).setup().device


@pytest.fixture
def gradref_rank(request: pytest.FixtureRequest) -> RankContext:
    """In a test marked ``@pytest.mark.gradref_ranks(N)``, whose body runs in N processes:
    this rank's number, the world size, its device and the process group."""
    from pytest_gradref.ranks import rank_fixture

    return rank_fixture(request.node)


@pytest.fixture
def grad_reference(request: pytest.FixtureRequest) -> GradReference:
    """Computes reference values and gradients the way the active backend needs.

    Call it as ``grad_reference(fn, *args, argnums=0, has_aux=False, golden=None,
    rounded=None, **kwargs)``.
    """
    import torch

    from pytest_gradref.compare import DEFAULT_BUDGET
    from pytest_gradref.fixture import GradReference
    from pytest_gradref.markers import parse_gradref_mark
    from pytest_gradref.policy import CheckPolicy
    from pytest_gradref.recording import Recording
    from pytest_gradref.settings import BASELINE_OPTION, REPORT_OPTION
    from pytest_gradref.state import gradref_state, recording_key, seed_key

    state = gradref_state(request.config)
    setup = state.setup()
    overrides = parse_gradref_mark(request.node.get_closest_marker("gradref"))
    compared = (
        request.config.getoption(REPORT_OPTION.dest) is not None
        or request.config.getoption(BASELINE_OPTION.dest) is not None
    )
    # A fresh record per run of the test: pytest-rerunfailures runs it again on the same item.
    recording = request.node.stash[recording_key] = Recording(
        # What gradref seeded, to tell whether the test reseeded torch after it.
        seed=request.node.stash.get(seed_key, None),
        device_type=setup.backend.device_type,
        # Fingerprints only where a report or a baseline compares runs by them.
        fingerprint=compared,
    )
    strategy = overrides.strategy or setup.effective_strategy()
    if setup.effective_strategy() == "crosscheck" and strategy != "crosscheck":
        recording.crosscheck_opt_out = f"@pytest.mark.gradref(strategy={strategy!r})"
    # Statistics cost more than the verdicts: computed where a report or the summary may show
    # them (the summary lists the tightest items with -v or after a crosscheck disagreement).
    statistics = compared or request.config.get_verbosity() > 0 or strategy == "crosscheck"
    # The default verdict judges against a float64 golden; a marker's tolerance, or
    # --gradref-verdict=tolerance, compares with a tolerance and computes none unasked.
    golden_verdict = state.verdict == "golden" and overrides.tolerance is None
    policy = CheckPolicy(
        backend=setup.backend.name,
        table=setup.backend.tolerances,
        overrides=(overrides.tolerance,) if overrides.tolerance is not None else (),
        budget=overrides.budget,
        recording=recording,
        statistics=statistics,
        default_budget=DEFAULT_BUDGET if golden_verdict else None,
        check_dtype=overrides.check_dtype,
        aux_tolerances=overrides.aux_tolerances,
    )
    return GradReference(
        strategy=strategy,
        default_strategy=setup.backend.default_strategy,
        policy=policy,
        golden=overrides.golden,
        golden_on_cpu=setup.backend.cpu_only_dtypes,
        rounded=overrides.rounded,
        default_golden=torch.float64 if golden_verdict else None,
    )
