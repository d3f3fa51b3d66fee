"""The gradref settings: their options, where each value came from, and their parsing.

Precedence, highest first: command line, environment variable, ini key, default. Per-test
markers sit above all of these for the strategy; see plugin.py. ``read_settings`` reads and
validates every setting once, at configure time, into one ``Settings``, which the session's
state holds (state.py); resolving the device from it is resolution.py's. Nothing here imports
torch.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gradref.config.number_settings import number_problem
from pytest_gradref.config.strategies import STRATEGY_CHOICES, StrategyChoice
from pytest_gradref.config.threads import OMP_ENV, SPLIT_CHOICE, TORCH_CHOICE
from pytest_gradref.config.thresholds import DEFAULT_THRESHOLD, MIN_THRESHOLD

if TYPE_CHECKING:
    from pytest_gradref.devices.backends import BackendRegistry

DEVICE_HELP = (
    "device the gradient tests run on: auto (the first available of cuda, npu, xpu, mps, cpu), "
    "a backend name such as cuda, or NAME:INDEX such as cuda:1."
)
STRATEGY_HELP = (
    "how reference gradients are computed: auto (the backend's default: grad_and_value on npu, "
    "autograd elsewhere), autograd, grad_and_value, or crosscheck (both, reporting how far "
    "they disagree)."
)

VERDICT_HELP = (
    "how assert_close judges a reference of inputs less precise than float64 when the test "
    "gives no tolerance: golden (also compute the reference in float64 and pass each item whose "
    "error against it, greatest and normwise, is at most the default budget of 2 times the "
    "reference's own, plus a floor) or tolerance (torch.testing's tolerance of the dtype, "
    "no float64 run: the cheapest)."
)
VERDICTS = ("golden", "tolerance")


@dataclass(frozen=True)
class OptionSpec:
    """One command-line option of the gradref group. A setting that an environment variable
    and an ini key can give too names them (``env``, ``ini``; see ``read_setting``); the
    others are plain options (``action``, ``type``, ``metavar`` as argparse takes them)."""

    flag: str
    dest: str
    help: str
    env: str | None = None
    ini: str | None = None
    action: str = "store"
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    # A setting's value where no source gives one, as its sources would spell it: parsed like
    # any other value, and named in the help ("Default: X.").
    default: str | None = None

    @property
    def full_help(self) -> str:
        """The help as --help shows it: the text, then the default."""
        return self.help if self.default is None else f"{self.help} Default: {self.default}."

    def add_to(self, group: pytest.OptionGroup, parser: pytest.Parser) -> None:
        extra: dict[str, Any] = {"action": self.action}
        if self.action == "store":
            extra.update(default=None, type=self.type, metavar=self.metavar)
        elif self.env is not None:  # a flag that is also a setting: None when not given
            extra.update(default=None)
        group.addoption(self.flag, dest=self.dest, help=self.full_help, **extra)
        if self.ini is not None:
            parser.addini(self.ini, help=self.full_help, default="")


DEVICE_OPTION = OptionSpec(
    "--gradref-device",
    "gradref_device",
    DEVICE_HELP,
    "GRADREF_DEVICE",
    "gradref_device",
    default="auto",
)
SEED_HELP = (
    "base seed: every test that uses gradref (a gradref fixture or marker) seeds torch from it "
    "and its node id, so it draws the same numbers alone, in any order and on any xdist "
    "worker; off: gradref seeds nothing, for a suite that seeds its own tests."
)
# The seed setting that turns the plugin's per-test seeding off.
SEED_OFF = "off"
SEED_OPTION = OptionSpec(
    "--gradref-seed",
    "gradref_seed",
    SEED_HELP,
    "GRADREF_SEED",
    "gradref_seed",
    default="0",
)
SEED_EVERY_TEST_HELP = (
    "seed every test of the session from the base seed, those that use no gradref fixture or "
    "marker too (by default only the tests that use gradref are seeded, so that a suite "
    "beside them keeps its own random state); true or false for the environment variable and "
    "the ini key."
)
SEED_EVERY_TEST_OPTION = OptionSpec(
    "--gradref-seed-every-test",
    "gradref_seed_every_test",
    SEED_EVERY_TEST_HELP,
    "GRADREF_SEED_EVERY_TEST",
    "gradref_seed_every_test",
    action="store_true",
    default="false",
)
REPORT_HELP = (
    "write a JSON report to PATH: per test its device, strategy and seed, and per compared "
    "item the dtype, greatest absolute and relative error, the tolerance or budget used and "
    "the headroom left; under --gradref-strategy=crosscheck also how far autograd and "
    "grad_and_value disagree, naming the strategy each test received and the one it was "
    "checked against."
)
# The session's exit status when --gradref-baseline-fail finds a precision regression, or a
# baseline that judged nothing: unusable, or no test or item in common (pytest's own statuses
# are 0 to 5).
BASELINE_REGRESSION_EXIT = 6
BASELINE_HELP = (
    "compare the run's precision with BASE.json, a report written by --gradref-report: the "
    "terminal summary names every item whose error grew beyond the threshold, and the tests "
    "and items missing from this run"
)
BASELINE_FAIL_HELP = (
    "with --gradref-baseline: a precision regression, or a baseline that judged nothing (it "
    "cannot be compared, or has no test or item in common with the run), fails the session, "
    f"exit status {BASELINE_REGRESSION_EXIT}"
)
BASELINE_THRESHOLD_HELP = (
    "with --gradref-baseline: how many times an item's error may grow before it is a "
    "regression (default 2; errors within 4 rounding steps of their dtype at their scale count "
    "as noise, and a half-precision item's normwise error also counts once it drifts past 6 "
    "sigmas of its rounding noise)"
)
VERDICT_OPTION = OptionSpec(
    "--gradref-verdict",
    "gradref_verdict",
    VERDICT_HELP,
    "GRADREF_VERDICT",
    "gradref_verdict",
    default="golden",
)
STRATEGY_OPTION = OptionSpec(
    "--gradref-strategy",
    "gradref_strategy",
    STRATEGY_HELP,
    "GRADREF_STRATEGY",
    "gradref_strategy",
    default="auto",
)
REPORT_OPTION = OptionSpec("--gradref-report", "gradref_report", REPORT_HELP, metavar="PATH")
# The ini key naming the project's command that writes its baseline again (shown where a run
# has items the baseline lacks), and its help.
BASELINE_REFRESH_INI = "gradref_baseline_refresh"
BASELINE_REFRESH_HELP = (
    "the command that writes the --gradref-baseline report again, named where a run records "
    "tests or items the baseline lacks (which --gradref-baseline-fail fails)"
)
BASELINE_OPTION = OptionSpec(
    "--gradref-baseline", "gradref_baseline", BASELINE_HELP, metavar="BASE.json"
)
BASELINE_FAIL_OPTION = OptionSpec(
    "--gradref-baseline-fail", "gradref_baseline_fail", BASELINE_FAIL_HELP, action="store_true"
)
BASELINE_THRESHOLD_OPTION = OptionSpec(
    "--gradref-baseline-threshold",
    "gradref_baseline_threshold",
    BASELINE_THRESHOLD_HELP,
    type=float,
)


SIMULATE_HELP = (
    "npu: run on a simulated npu device backed by the CPU (a testing aid for CI without Ascend "
    "hardware: it proves the npu code path, not Ascend numerics), registered before any device "
    "is probed; none: no simulation. Refused where a real torch_npu imports."
)
SIMULATE_OPTION = OptionSpec(
    "--gradref-simulate",
    "gradref_simulate",
    SIMULATE_HELP,
    "GRADREF_SIMULATE",
    "gradref_simulate",
    default="none",
)
# Each device type --gradref-simulate can simulate, and the package its real runtime comes in:
# where that is not installed, an unavailable device's error names the simulation.
SIMULATED_PACKAGES = {"npu": "torch_npu"}
SIMULATABLE = tuple(SIMULATED_PACKAGES)
# The simulated npu's numerics (pytest_gradref/devices/ascend_numerics.py holds the model and its
# sources): torch's CPU kernels as they are, or with Ascend's documented HF32 on top.
SIMULATE_NUMERICS = ("cpu", "ascend")
SIMULATE_NUMERICS_HELP = (
    "with --gradref-simulate=npu: cpu (every operator is torch's CPU kernel) or ascend (also "
    "model what Huawei documents of Ascend numerics: float32 matmul-class operators round "
    "their operands to HF32 while torch.npu.matmul.allow_hf32 is True, default False, and "
    "convolutions while torch.npu.conv.allow_hf32 is True, default True)."
)
SIMULATE_NUMERICS_OPTION = OptionSpec(
    "--gradref-simulate-numerics",
    "gradref_simulate_numerics",
    SIMULATE_NUMERICS_HELP,
    "GRADREF_SIMULATE_NUMERICS",
    "gradref_simulate_numerics",
    default="cpu",
)
# The session's exit status when --gradref-strict-device finds tests that ran without the
# gradref device (BASELINE_REGRESSION_EXIT is 6).
STRICT_DEVICE_EXIT = 7
STRICT_DEVICE_HELP = (
    "on any device but the CPU, or a simulated one, fail the session (exit status "
    f"{STRICT_DEVICE_EXIT}) when tests ran without the gradref device (no gradref fixture or "
    "marker), so that coverage that did not happen cannot pass; true or false for the "
    "environment variable and the ini key."
)
STRICT_DEVICE_OPTION = OptionSpec(
    "--gradref-strict-device",
    "gradref_strict_device",
    STRICT_DEVICE_HELP,
    "GRADREF_STRICT_DEVICE",
    "gradref_strict_device",
    action="store_true",
    default="false",
)

# How long a multi-rank test's ranks may run before they count as hung, when the test's
# gradref_ranks marker gives no timeout=.
DEFAULT_RANK_TIMEOUT = 300.0
RANK_TIMEOUT_HELP = (
    "seconds a rank of a multi-rank test (@pytest.mark.gradref_ranks) may run before it "
    "counts as hung: it is then ended, and the test fails with every hung rank's Python "
    "stack; the marker's timeout= wins for its test."
)
RANK_TIMEOUT_OPTION = OptionSpec(
    "--gradref-rank-timeout",
    "gradref_rank_timeout",
    RANK_TIMEOUT_HELP,
    "GRADREF_RANK_TIMEOUT",
    "gradref_rank_timeout",
    default=f"{DEFAULT_RANK_TIMEOUT:g}",
)

THREADS_HELP = (
    f"CPU threads each test process computes with: {TORCH_CHOICE} (torch's own count, the "
    f"host's cores in every process), {SPLIT_CHOICE} (each xdist worker gets its share of the "
    f"cores, at least one, unless {OMP_ENV} is set; a session without xdist keeps torch's "
    "own), or a positive integer. Under -n, torch's own count has every worker use every core: "
    "oversubscribed, small operators run several times slower."
)
THREADS_OPTION = OptionSpec(
    "--gradref-threads",
    "gradref_threads",
    THREADS_HELP,
    "GRADREF_THREADS",
    "gradref_threads",
    default="torch",
)


# Every option of the gradref group, in the order --help lists them.
OPTIONS = (
    DEVICE_OPTION,
    STRATEGY_OPTION,
    VERDICT_OPTION,
    SEED_OPTION,
    SEED_EVERY_TEST_OPTION,
    SIMULATE_OPTION,
    SIMULATE_NUMERICS_OPTION,
    STRICT_DEVICE_OPTION,
    RANK_TIMEOUT_OPTION,
    THREADS_OPTION,
    REPORT_OPTION,
    BASELINE_OPTION,
    BASELINE_FAIL_OPTION,
    BASELINE_THRESHOLD_OPTION,
)


@dataclass(frozen=True)
class Setting:
    """A setting's value as its source spelt it, and that source in words; ``is_default``
    where no source gave one and the value is the option's default."""

    value: str
    source: str
    is_default: bool = False


def read_setting(
    config: pytest.Config, spec: OptionSpec, namespace: argparse.Namespace | None = None
) -> Setting:
    """The value of one setting and a phrase naming its source. ``namespace``: the command
    line as parsed so far, where ``config.option`` does not hold it yet (pytest's
    ``early_config.known_args_namespace``)."""
    if spec.env is None or spec.ini is None:
        raise ValueError(f"{spec.flag} is a plain option, not a setting with env and ini")
    cli = config.getoption(spec.dest) if namespace is None else getattr(namespace, spec.dest, None)
    if cli is not None:
        return Setting(str(cli), f"the {spec.flag} option")
    env = os.environ.get(spec.env, "").strip()
    if env:
        return Setting(env, f"the {spec.env} environment variable")
    ini = str(config.getini(spec.ini)).strip()
    if ini:
        where = config.inipath.name if config.inipath else "the ini file"
        return Setting(ini, f"the {spec.ini} ini key in {where}")
    if spec.default is None:
        raise ValueError(f"{spec.flag} is a setting without a default")
    return Setting(spec.default, "the default", is_default=True)


def parse_seed(setting: Setting) -> int | None:
    """The base seed, or None for off (the suite seeds its tests, or leaves them unseeded)."""
    if setting.value.lower() == SEED_OFF:
        return None
    try:
        seed = int(setting.value)
    except ValueError:
        seed = -1
    if seed < 0:
        raise pytest.UsageError(
            f"Invalid gradref seed {setting.value!r} from {setting.source}; it must be a "
            f"non-negative integer, or {SEED_OFF} to leave seeding to the suite"
        )
    return seed


def parse_verdict(setting: Setting) -> str:
    """golden (the default) or tolerance."""
    value = setting.value
    if value not in VERDICTS:
        raise pytest.UsageError(
            f"Invalid gradref verdict {setting.value!r} from {setting.source}; valid values "
            f"are {', '.join(VERDICTS)}"
        )
    return value


def parse_simulate(setting: Setting) -> str | None:
    """The device type to simulate, or None for no simulation."""
    if setting.value == "none":
        return None
    if setting.value in SIMULATABLE:
        return setting.value
    raise pytest.UsageError(
        f"Invalid gradref simulate value {setting.value!r} from {setting.source}; valid values "
        f"are {', '.join(SIMULATABLE)} or none"
    )


def parse_simulate_numerics(setting: Setting, simulate: str | None) -> str:
    """The simulated device's numerics: cpu (the default) or ascend, which needs the
    simulated npu."""
    value = setting.value
    if value not in SIMULATE_NUMERICS:
        raise pytest.UsageError(
            f"Invalid gradref simulate numerics {setting.value!r} from {setting.source}; "
            f"valid values are {', '.join(SIMULATE_NUMERICS)}"
        )
    if value == "ascend" and simulate != "npu":
        # Ascend numerics without the simulated npu would change nothing: a silent no-op.
        raise pytest.UsageError(
            f"gradref simulate numerics {value!r} from {setting.source} models the simulated "
            f"npu's operators: add {SIMULATE_OPTION.flag}=npu, or drop "
            f"{SIMULATE_NUMERICS_OPTION.flag} (and unset {SIMULATE_NUMERICS_OPTION.env})"
        )
    return value


FLAG_VALUES = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def parse_flag(setting: Setting) -> bool:
    """A yes-or-no setting: the flag on the command line, true or false elsewhere."""
    value = FLAG_VALUES.get(setting.value.lower())
    if value is None:
        raise pytest.UsageError(
            f"Invalid value {setting.value!r} from {setting.source}; valid values are "
            f"{', '.join(FLAG_VALUES)}"
        )
    return value


def parse_rank_timeout(setting: Setting) -> float:
    """The rank timeout in seconds: a positive number."""
    try:
        seconds = float(setting.value)
    except ValueError:
        seconds = math.nan
    if not seconds > 0 or math.isinf(seconds):
        raise pytest.UsageError(
            f"Invalid gradref rank timeout {setting.value!r} from {setting.source}; it must "
            f"be a positive number of seconds, e.g. {DEFAULT_RANK_TIMEOUT:g}"
        )
    return seconds


def parse_threads(setting: Setting) -> int | str:
    """The threads setting: TORCH_CHOICE, SPLIT_CHOICE or a positive integer."""
    value = setting.value.strip().lower()
    if value in (TORCH_CHOICE, SPLIT_CHOICE):
        return value
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise pytest.UsageError(
        f"Invalid gradref threads {setting.value!r} from {setting.source}; valid values are "
        f"{TORCH_CHOICE}, {SPLIT_CHOICE} or a positive integer such as 1"
    )


def seed_for_test(base: int, nodeid: str) -> int:
    """A seed that depends only on the base seed and the test's node id (stable across runs)."""
    digest = hashlib.sha256(f"{base}:{nodeid}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # < 2**63, what torch.manual_seed takes


@dataclass(frozen=True)
class DeviceRequest:
    """A parsed device setting: a backend name (None for auto) and an optional index."""

    backend: str | None
    index: int | None
    setting: Setting


def parse_device(setting: Setting, registry: BackendRegistry) -> DeviceRequest:
    value = setting.value
    if value == "auto":
        return DeviceRequest(None, None, setting)
    name, _, index_text = value.partition(":")
    valid = f"auto, {', '.join(registry.names())}, or NAME:INDEX such as cuda:1"
    if name not in registry:
        raise pytest.UsageError(
            f"Invalid gradref device {value!r} from {setting.source}; valid values are {valid}"
        )
    index = None
    if ":" in value:
        if not index_text.isdigit():
            raise pytest.UsageError(
                f"Invalid gradref device {value!r} from {setting.source}: the index after ':' "
                f"must be a non-negative integer; valid values are {valid}"
            )
        index = int(index_text)
    return DeviceRequest(name, index, setting)


def parse_strategy(setting: Setting) -> StrategyChoice | None:
    """The requested strategy, or None for auto (the backend's default)."""
    value = setting.value
    if value == "auto":
        return None
    for choice in STRATEGY_CHOICES:
        if value == choice:
            return choice
    raise pytest.UsageError(
        f"Invalid gradref strategy {value!r} from {setting.source}; valid values are "
        f"auto, {', '.join(STRATEGY_CHOICES)}"
    )


def read_simulation(
    config: pytest.Config, namespace: argparse.Namespace | None = None
) -> tuple[str | None, str]:
    """The device type to simulate (None for none) and its numerics (cpu or ascend), read
    and parsed as ``read_settings`` does, for the hook that installs the simulated device
    before the initial conftests, ahead of configure (from ``namespace``, the command line
    parsed so far)."""
    simulate = parse_simulate(read_setting(config, SIMULATE_OPTION, namespace))
    setting = read_setting(config, SIMULATE_NUMERICS_OPTION, namespace)
    return simulate, parse_simulate_numerics(setting, simulate)


@dataclass(frozen=True)
class Settings:
    """Every gradref setting of the session, read and validated once (``read_settings``).

    Attributes:
        device: the device setting (auto, or a backend and an index), with its source. On an
            xdist worker the device the controller assigned may differ (state.py).
        strategy: the strategy; None for auto, the backend's default.
        seed: the base seed; None where seeding is off: the suite seeds its tests.
        seed_every_test: whether tests that use no gradref fixture or marker are seeded too.
        verdict: golden or tolerance: how a test without a tolerance is judged.
        simulate: the device type simulated on the CPU (``--gradref-simulate``), or None.
        simulate_numerics: the simulated device's numerics, cpu or ascend.
        strict_device: whether a run with tests that did not use the device fails.
        rank_timeout: seconds a rank of a multi-rank test may run, unless its marker says.
        threads: the CPU threads setting (threads.py): TORCH_CHOICE, SPLIT_CHOICE or a count.
        report: the path of the JSON report to write, or None.
        baseline: the path of the baseline report to compare the run with, or None.
        baseline_fail: whether a regression against the baseline fails the session.
        baseline_threshold: how many times an item's error may grow against the baseline.
        baseline_refresh: the project's command that writes the baseline again ("" for none).
        sources: where each option's value came from, by its ``OptionSpec.dest``: "the
            --gradref-seed option", "the GRADREF_SEED environment variable", "the default".
        defaults: the ``OptionSpec.dest`` of every option no source gave.
    """

    device: DeviceRequest
    strategy: StrategyChoice | None
    seed: int | None
    seed_every_test: bool
    verdict: str
    simulate: str | None
    simulate_numerics: str
    strict_device: bool
    rank_timeout: float
    threads: int | str
    report: str | None
    baseline: str | None
    baseline_fail: bool
    baseline_threshold: float
    baseline_refresh: str
    sources: Mapping[str, str]
    defaults: frozenset[str]

    def source(self, spec: OptionSpec) -> str:
        """Where the option's value came from, as an error or the header names it."""
        return self.sources[spec.dest]

    def is_default(self, spec: OptionSpec) -> bool:
        """Whether no source gave the option, so it holds its default."""
        return spec.dest in self.defaults

    @property
    def simulated(self) -> frozenset[str]:
        """The device types this process simulates."""
        return frozenset({self.simulate} if self.simulate else ())


def _plain_setting(config: pytest.Config, spec: OptionSpec) -> Setting:
    """A plain option (command line only) as a setting: given, or left at its default."""
    value = config.getoption(spec.dest)
    if value in (None, False):
        return Setting(str(spec.default or ""), "the default", is_default=True)
    return Setting(str(value), f"the {spec.flag} option")


def read_settings(config: pytest.Config, registry: BackendRegistry) -> Settings:
    """Every gradref setting, each from its highest source, validated: a usage error names
    the source of a bad value and says what is valid. ``registry`` holds the backends a
    device setting may name."""
    raw = {
        spec.dest: read_setting(config, spec) if spec.ini else _plain_setting(config, spec)
        for spec in OPTIONS
    }
    baseline = config.getoption(BASELINE_OPTION.dest)
    for gate_option in (BASELINE_FAIL_OPTION, BASELINE_THRESHOLD_OPTION):
        if not raw[gate_option.dest].is_default and not baseline:
            # A gate without a baseline would pass on nothing.
            raise pytest.UsageError(
                f"{gate_option.flag} needs {BASELINE_OPTION.flag}=BASE.json, the report to "
                f"compare the run with; add {BASELINE_OPTION.flag}, or drop {gate_option.flag}"
            )
    threshold = config.getoption(BASELINE_THRESHOLD_OPTION.dest)
    if threshold is None:
        threshold = DEFAULT_THRESHOLD
    problem = number_problem(threshold, minimum=MIN_THRESHOLD)
    if problem is not None:
        raise pytest.UsageError(f"{BASELINE_THRESHOLD_OPTION.flag} {problem}, got {threshold:g}")
    simulate = parse_simulate(raw[SIMULATE_OPTION.dest])
    numerics = parse_simulate_numerics(raw[SIMULATE_NUMERICS_OPTION.dest], simulate)
    return Settings(
        device=parse_device(raw[DEVICE_OPTION.dest], registry),
        strategy=parse_strategy(raw[STRATEGY_OPTION.dest]),
        seed=parse_seed(raw[SEED_OPTION.dest]),
        seed_every_test=parse_flag(raw[SEED_EVERY_TEST_OPTION.dest]),
        verdict=parse_verdict(raw[VERDICT_OPTION.dest]),
        simulate=simulate,
        simulate_numerics=numerics,
        strict_device=parse_flag(raw[STRICT_DEVICE_OPTION.dest]),
        rank_timeout=parse_rank_timeout(raw[RANK_TIMEOUT_OPTION.dest]),
        threads=parse_threads(raw[THREADS_OPTION.dest]),
        report=config.getoption(REPORT_OPTION.dest) or None,
        baseline=baseline or None,
        baseline_fail=bool(config.getoption(BASELINE_FAIL_OPTION.dest)),
        baseline_threshold=float(threshold),
        baseline_refresh=str(config.getini(BASELINE_REFRESH_INI)).strip(),
        sources=MappingProxyType({dest: setting.source for dest, setting in raw.items()}),
        defaults=frozenset(dest for dest, setting in raw.items() if setting.is_default),
    )
