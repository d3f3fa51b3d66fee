"""The session's device and strategy: where each setting came from, and what it resolves to.

Precedence, highest first: command line, environment variable, ini key, default ("auto").
Per-test markers sit above all of these for the strategy; see plugin.py.

Parsing needs no torch. Resolving (probing availability, counting devices) imports torch and
is done only once a test needs it, so loading the plugin stays cheap.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gradref.strategies import STRATEGY_CHOICES, StrategyChoice

if TYPE_CHECKING:
    import torch

    from pytest_gradref.backends import Backend, BackendRegistry

DEVICE_HELP = (
    "device the gradient tests run on: auto (the first available of cuda, npu, xpu, mps, cpu), "
    "a backend name such as cuda, or NAME:INDEX such as cuda:1. Default: auto."
)
STRATEGY_HELP = (
    "how reference gradients are computed: auto (the backend's default: grad_and_value on npu, "
    "autograd elsewhere), autograd, grad_and_value, or crosscheck (both, reporting how far "
    "they disagree). Default: auto."
)

VERDICT_HELP = (
    "how assert_close judges a reference of inputs less precise than float64 when the test "
    "gives no tolerance: golden (also compute the reference in float64 and pass each item whose "
    "error against it, greatest and normwise, is at most the default budget of 2 times the "
    "reference's own, plus a floor) or tolerance (torch.testing's tolerance of the dtype, "
    "no float64 run: the cheapest). Default: golden."
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

    def add_to(self, group: pytest.OptionGroup, parser: pytest.Parser) -> None:
        extra: dict[str, Any] = {"action": self.action}
        if self.action == "store":
            extra.update(default=None, type=self.type, metavar=self.metavar)
        elif self.env is not None:  # a flag that is also a setting: None when not given
            extra.update(default=None)
        group.addoption(self.flag, dest=self.dest, help=self.help, **extra)
        if self.ini is not None:
            parser.addini(self.ini, help=self.help, default="")


DEVICE_OPTION = OptionSpec(
    "--gradref-device", "gradref_device", DEVICE_HELP, "GRADREF_DEVICE", "gradref_device"
)
SEED_HELP = (
    "base seed: every test seeds torch from it and its node id, so it draws the same numbers "
    "alone, in any order and on any xdist worker; off: gradref seeds nothing, for a suite that "
    "seeds its own tests. Default: 0."
)
# The seed setting that turns the plugin's per-test seeding off.
SEED_OFF = "off"
SEED_OPTION = OptionSpec(
    "--gradref-seed", "gradref_seed", SEED_HELP, "GRADREF_SEED", "gradref_seed"
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
    "--gradref-verdict", "gradref_verdict", VERDICT_HELP, "GRADREF_VERDICT", "gradref_verdict"
)
STRATEGY_OPTION = OptionSpec(
    "--gradref-strategy", "gradref_strategy", STRATEGY_HELP, "GRADREF_STRATEGY", "gradref_strategy"
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
    "is probed; none: no simulation. Refused where a real torch_npu imports. "
    "Default: none."
)
SIMULATE_OPTION = OptionSpec(
    "--gradref-simulate", "gradref_simulate", SIMULATE_HELP, "GRADREF_SIMULATE", "gradref_simulate"
)
# Each device type --gradref-simulate can simulate, and the package its real runtime comes in:
# where that is not installed, an unavailable device's error names the simulation.
SIMULATED_PACKAGES = {"npu": "torch_npu"}
SIMULATABLE = tuple(SIMULATED_PACKAGES)
# The simulated npu's numerics (pytest_gradref/ascend_numerics.py holds the model and its
# sources): torch's CPU kernels as they are, or with Ascend's documented HF32 on top.
SIMULATE_NUMERICS = ("cpu", "ascend")
SIMULATE_NUMERICS_HELP = (
    "with --gradref-simulate=npu: cpu (every operator is torch's CPU kernel) or ascend (also "
    "model what Huawei documents of Ascend numerics: float32 matmul-class operators round "
    "their operands to HF32 while torch.npu.matmul.allow_hf32 is True, default False, and "
    "convolutions while torch.npu.conv.allow_hf32 is True, default True). Default: cpu."
)
SIMULATE_NUMERICS_OPTION = OptionSpec(
    "--gradref-simulate-numerics",
    "gradref_simulate_numerics",
    SIMULATE_NUMERICS_HELP,
    "GRADREF_SIMULATE_NUMERICS",
    "gradref_simulate_numerics",
)
# The session's exit status when --gradref-strict-device finds tests that ran without the
# gradref device (BASELINE_REGRESSION_EXIT is 6).
STRICT_DEVICE_EXIT = 7
STRICT_DEVICE_HELP = (
    "on any device but the CPU, or a simulated one, fail the session (exit status "
    f"{STRICT_DEVICE_EXIT}) when tests ran without the gradref device (no gradref fixture or "
    "marker), so that coverage that did not happen cannot pass; true or false for the "
    "environment variable and the ini key. Default: false."
)
STRICT_DEVICE_OPTION = OptionSpec(
    "--gradref-strict-device",
    "gradref_strict_device",
    STRICT_DEVICE_HELP,
    "GRADREF_STRICT_DEVICE",
    "gradref_strict_device",
    action="store_true",
)

# How long a multi-rank test's ranks may run before they count as hung, when the test's
# gradref_ranks marker gives no timeout=.
DEFAULT_RANK_TIMEOUT = 300.0
RANK_TIMEOUT_HELP = (
    "seconds a rank of a multi-rank test (@pytest.mark.gradref_ranks) may run before it "
    "counts as hung: it is then ended, and the test fails with every hung rank's Python "
    "stack; the marker's timeout= wins for its test. Default: 300."
)
RANK_TIMEOUT_OPTION = OptionSpec(
    "--gradref-rank-timeout",
    "gradref_rank_timeout",
    RANK_TIMEOUT_HELP,
    "GRADREF_RANK_TIMEOUT",
    "gradref_rank_timeout",
)


# Every option of the gradref group, in the order --help lists them.
OPTIONS = (
    DEVICE_OPTION,
    STRATEGY_OPTION,
    VERDICT_OPTION,
    SEED_OPTION,
    SIMULATE_OPTION,
    SIMULATE_NUMERICS_OPTION,
    STRICT_DEVICE_OPTION,
    RANK_TIMEOUT_OPTION,
    REPORT_OPTION,
    BASELINE_OPTION,
    BASELINE_FAIL_OPTION,
    BASELINE_THRESHOLD_OPTION,
)


@dataclass(frozen=True)
class Setting:
    value: str
    source: str


def read_setting(config: pytest.Config, spec: OptionSpec) -> Setting:
    """The value of one setting and a phrase naming its source."""
    if spec.env is None or spec.ini is None:
        raise ValueError(f"{spec.flag} is a plain option, not a setting with env and ini")
    cli = config.getoption(spec.dest)
    if cli is not None:
        return Setting(str(cli), f"the {spec.flag} option")
    env = os.environ.get(spec.env, "").strip()
    if env:
        return Setting(env, f"the {spec.env} environment variable")
    ini = str(config.getini(spec.ini)).strip()
    if ini:
        where = config.inipath.name if config.inipath else "the ini file"
        return Setting(ini, f"the {spec.ini} ini key in {where}")
    return Setting("auto", "the default")


def parse_seed(setting: Setting) -> int | None:
    """The base seed, or None for off (the suite seeds its tests, or leaves them unseeded)."""
    if setting.value == "auto":
        return 0
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
    value = "golden" if setting.source == "the default" else setting.value
    if value not in VERDICTS:
        raise pytest.UsageError(
            f"Invalid gradref verdict {setting.value!r} from {setting.source}; valid values "
            f"are {', '.join(VERDICTS)}"
        )
    return value


def parse_simulate(setting: Setting) -> str | None:
    """The device type to simulate, or None for no simulation."""
    if setting.source == "the default" or setting.value == "none":
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
    value = "cpu" if setting.source == "the default" else setting.value
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
    if setting.source == "the default":
        return False
    value = FLAG_VALUES.get(setting.value.lower())
    if value is None:
        raise pytest.UsageError(
            f"Invalid value {setting.value!r} from {setting.source}; valid values are "
            f"{', '.join(FLAG_VALUES)}"
        )
    return value


def parse_rank_timeout(setting: Setting) -> float:
    """The rank timeout in seconds: a positive number."""
    if setting.source == "the default":
        return DEFAULT_RANK_TIMEOUT
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


def seed_for_test(base: int, nodeid: str) -> int:
    """A seed that depends only on the base seed and the test's node id (stable across runs)."""
    import hashlib

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


@dataclass(frozen=True)
class Setup:
    """The resolved session setup, as the header reports it."""

    backend: Backend
    device: torch.device
    index: int | None
    device_source: str
    strategy: StrategyChoice | None
    strategy_source: str
    unavailable: tuple[tuple[str, str], ...]
    simulated: bool = False

    @property
    def label(self) -> str:
        """The device as the user names it: "cuda:1", or "npu:0 on cpu" for a test policy."""
        if self.device.type == self.backend.name:
            return str(self.device)
        named = f"{self.backend.name}:{self.index or 0}"
        return f"{named} on {self.device}"

    def effective_strategy(self) -> StrategyChoice:
        return self.strategy if self.strategy is not None else self.backend.default_strategy

    def description(self) -> str:
        """The device's name, or "simulated on CPU": a simulated run never reads as real."""
        if self.simulated:
            return "simulated on CPU"
        return self.backend.describe_device(self.device)

    def header_line(self, seed: int | str, verdict: str = "golden") -> str:
        """The header: device, strategy and seed (the base seed, or why there is none), and
        the verdict where it is not the default (``--gradref-verdict=tolerance``)."""
        description = self.description()
        strategy = self.effective_strategy()
        if self.strategy is None:
            strategy_from = f"{self.backend.name} default"
        else:
            strategy_from = f"from {self.strategy_source}"
        line = (
            f"gradref: device={self.label} ({description}; {self.device_source}) "
            f"strategy={strategy} ({strategy_from}) seed={seed}"
        )
        if verdict != "golden":
            line += f" verdict={verdict}"
        if self.simulated:
            from pytest_gradref.simulated import numerics_note

            line += f" | {numerics_note()}"
            # Said where a compiled kernel's results are read: on this device they are not the
            # compiled path's (simulated.py, _not_traced).
            line += (
                " | simulated: torch.compile runs simulated tensors eagerly (Dynamo cannot "
                "trace them; fullgraph=True raises)"
            )
        if self.unavailable:
            reasons = "; ".join(f"{name} unavailable: {why}" for name, why in self.unavailable)
            line += f" | {reasons}"
        return line


def resolve(
    request: DeviceRequest,
    strategy: StrategyChoice | None,
    strategy_source: str,
    registry: BackendRegistry,
    simulated: frozenset[str] = frozenset(),
) -> Setup:
    """Probe backends and pick the device; a usage error says why a request cannot be met."""
    unavailable: list[tuple[str, str]] = []
    if request.backend is None:
        backend = _first_available(registry.auto_order(), unavailable)
        device_source = "auto: first available"
    else:
        backend = registry.get(request.backend)
        reason = backend.unavailable_reason()
        if reason is not None:
            raise pytest.UsageError(
                f"gradref device {request.setting.value!r} from {request.setting.source} is "
                f"unavailable: {reason}. Install or expose that device, "
                f"{_simulation_hint(backend, simulated)}or use --gradref-device=auto to take "
                "the first available one."
            )
        device_source = f"from {request.setting.source}"
    if request.index is not None:
        count = backend.device_count()
        if request.index >= count:
            visible = ""
            if backend.visible_devices_env and backend.visible_devices_env in os.environ:
                env = backend.visible_devices_env
                visible = f" with {env}={os.environ[env]!r}"
            raise pytest.UsageError(
                f"gradref device {request.setting.value!r} from {request.setting.source} is "
                f"out of range: {count} {backend.name} device(s) visible{visible}, so the "
                f"index must be 0..{count - 1}"
            )
    return Setup(
        backend=backend,
        device=backend.device(request.index),
        index=request.index,
        device_source=device_source,
        strategy=strategy,
        strategy_source=strategy_source,
        unavailable=tuple(unavailable),
        simulated=backend.device_type in simulated,
    )


def _simulation_hint(backend: Backend, simulated: frozenset[str]) -> str:
    """How to run an unavailable device's code path without its hardware, as a clause of the
    error ("" where --gradref-simulate cannot help: a real runtime is installed, which the
    simulation refuses to shadow, or the device is no simulatable one)."""
    import importlib.util

    device_type = backend.device_type
    package = SIMULATED_PACKAGES.get(device_type)
    if package is None or device_type in simulated or importlib.util.find_spec(package):
        return ""
    return (
        f"run its code path without the hardware with --gradref-simulate={device_type} (a "
        f"simulated {device_type} backed by the CPU: it proves the code path, not the "
        "device's numerics), "
    )


def _first_available(candidates: Sequence[Backend], unavailable: list[tuple[str, str]]) -> Backend:
    for backend in candidates:
        reason = backend.unavailable_reason()
        if reason is None:
            return backend
        unavailable.append((backend.name, reason))
    reasons = "; ".join(f"{name}: {why}" for name, why in unavailable) or "none registered"
    raise pytest.UsageError(f"gradref found no available device for auto ({reasons})")
