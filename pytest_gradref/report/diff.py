"""Comparing two precision reports (``--gradref-report``) item by item.

Records are matched by node id, items within a test by label (the n-th item of a label with
the n-th). Each matched item's error is its greatest absolute error (``max_abs``: against the
reference, or against the golden under a budget); an item is a regression when that error grew
by more than the threshold, when it became NaN, or when it passed before and fails now.

Growth is judged against rounding noise measured in the item's own units: a rounding step of
its dtype at its own scale (the report's ``scale``: the float64 golden's greatest magnitude,
or the expected's), ``eps(dtype) * scale``. Before the ratio is taken, both errors are raised to
``noise`` such steps (four by default): an error within a few steps of the item's dtype at
its scale is rounding noise, which moves between CPUs (ATen's and oneDNN's ISA paths, thread
counts) by several times without meaning anything (a float32 sum of rewards went from one step
to four on ATen's scalar path), while an error that grows past a few steps is caught however
generous the item's allowance (a bf16 reference's error can allow a
float32-computed loss thousands of steps). Where a report holds normwise errors (``norm_rel``,
relative to the golden's norm) they are judged the same way, against ``noise`` steps of the
dtype, and the item's ratio is the larger of the two: a systematic error spread thinly over
many elements grows the norm first. The absolute ``floor`` stays beneath, for items of older
reports without a scale, so that exact zeros do not make infinite ratios. A float32 or float64
item's floor is also at least its same-dtype reference's own error (``reference_error``, and
``reference_norm_rel`` for the norm), up to REFERENCE_NOISE_STEPS steps or REFERENCE_NOISE_OWN
times the item's own error before, whichever is more: the rounding noise of a plain
computation of the item, which an ill-conditioned item (a small difference of large sums)
shows in many steps of its own scale.

This module imports neither torch nor pytest: ``pytest-gradref diff`` starts fast.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pytest_gradref.config.thresholds import DEFAULT_THRESHOLD
from pytest_gradref.config.tolerances import EPSILONS

# The format writer.py writes: raise it when a field changes meaning or disappears, so that
# a diff refuses a report it would misread (3: each test's "inputs" fingerprints decide
# comparability, and "seed" and "base_seed" are null where seeding is off). With every format
# this module reads; here rather than in writer.py, which imports pytest, so that
# `pytest-gradref diff` starts without it.
FORMAT_VERSION = 3
FORMAT_VERSIONS = frozenset(range(1, FORMAT_VERSION + 1))
# The first format whose tests record a fingerprint of each reference's inputs ("inputs"),
# which decides whether two reports compare (see mismatches).
INPUTS_FORMAT = 3
# Below float32's spacing at 1 (1.2e-7) by far, above float64's rounding of unit-scale values
# (1.1e-16) with room for accumulation: float64 noise is not called a regression.
DEFAULT_FLOOR = 1e-12
# Rounding steps of the item's dtype at its scale below which its error counts as noise (see
# the docstring). Chosen from the spread measured across CPU code paths
# (benchmarks/precision_spread.py, benchmarks/results/cpu/precision_spread.txt).
DEFAULT_NOISE = 4.0
# A half-precision item's normwise error is mostly the rounding of each element to its dtype,
# which a change of summation order (another CPU path, thread count or host) re-draws for at
# most the elements near a rounding boundary. Were every element's rounding re-drawn, the norm
# would move by a relative standard deviation of ROUNDING_NORM_SPREAD / sqrt(numel)
# (sqrt(Var(e^2)) / E(e^2) / 2 for a uniform rounding error e); a normwise growth beyond
# DRIFT_SIGMAS of those is a systematic change, however small beside the threshold. Measured
# on the kernel suite (benchmarks/results/cpu/precision_spread.txt): ATen's scalar path moved
# its 194 bf16 items' norms by 0.994x to 1.004x, while a gradient rounded twice, or accumulated
# in bf16, moved theirs by 1.08x to 1.31x (a band of about 1.04x at their 4,000 elements).
ROUNDING_NORM_SPREAD = 0.447
DRIFT_SIGMAS = 6.0
# Normwise errors below this share of a rounding step (relative) are raised to it before a
# drift is judged: an item whose elements are nearly all exact moves by few elements.
DRIFT_FLOOR_STEPS = 1 / 16
# Items smaller than this keep the noise floor of `noise` steps: the band leans on a sum of
# many squared roundings being near normal, and would be loose there anyway (1.17x at 256).
DRIFT_MIN_NUMEL = 256
_HALF_PRECISION = frozenset({"float16", "bfloat16"})


class UnusableInput(Exception):
    """The reports cannot be compared; the message says why."""


@dataclass(frozen=True)
class Report:
    """One report, read and checked."""

    path: str
    format_version: int
    base_seed: int | None
    torch: str | None
    device: str | None
    backend: str | None
    strategy: str | None
    strategy_is_default: bool
    tests: dict[str, dict[str, Any]]
    # The backend's default strategy: what the tests received under the default and under
    # crosscheck (None where an older report cannot tell).
    default_strategy: str | None = None
    # Run on a simulated device (--gradref-simulate): the CPU's operators, not the device's.
    simulated: bool = False
    # A simulated run's numerics ("cpu", "ascend"); None for a real device or an older report.
    simulated_numerics: str | None = None
    # Every device the tests ran on (npu:0, npu:1 under -n 2); empty where an older report
    # does not record them, or no test used the device.
    devices: tuple[str, ...] = ()

    def describe(self) -> str:
        strategy = (
            f"{self.strategy} ({self.backend} default)"
            if self.strategy_is_default
            else self.strategy
        )
        where = f"device={self.device}"
        if self.devices and list(self.devices) != [self.device]:
            where = f"devices={','.join(self.devices)}"
        return (
            f"{where}{' (simulated)' if self.simulated else ''} "
            f"backend={self.backend} strategy={strategy} seed={self.seed_text()} "
            f"torch={self.torch} "
            f"({len(self.tests)} {'test' if len(self.tests) == 1 else 'tests'})"
        )

    def seed_text(self) -> str:
        """The base seed, or "off" where gradref did not seed (--gradref-seed=off)."""
        off = self.base_seed is None and self.format_version >= INPUTS_FORMAT
        return "off" if off else str(self.base_seed)

    def strategy_origin(self, record: dict[str, Any]) -> str:
        """Why a test of this report has the strategies it has: what a refusal names."""
        received = record.get("strategies")
        if received == [self.strategy]:
            if self.strategy_is_default:
                return f"{self.backend}'s default"
            return f"{self.strategy} chosen for the run by --gradref-strategy or its env/ini"
        if self.strategy == "crosscheck" and received == [self.default_strategy]:
            return (
                f"the run was a crosscheck: its tests received {self.backend}'s default, "
                f"{self.default_strategy}"
            )
        return "chosen by a gradref(strategy=...) marker on the test"


def _number(value: Any) -> float:
    """An error or headroom as the report holds it: a number, or "inf" / "nan" as a string."""
    if isinstance(value, bool):
        return math.nan
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return math.nan
    return math.nan


def load_report(path: str | Path) -> Report:
    """Read and check a report; UnusableInput says what is wrong with it."""
    name = str(path)
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise UnusableInput(f"{name}: cannot read it: {error.strerror or error}") from None
    try:
        document = json.loads(text)
    except ValueError as error:
        raise UnusableInput(f"{name}: not JSON: {error}") from None
    return parse_report(document, name)


def parse_report(document: Any, name: str) -> Report:
    """Check a report's contents (as read from JSON); ``name`` says where it came from."""
    if not isinstance(document, dict) or not isinstance(document.get("tests"), list):
        raise UnusableInput(f"{name}: not a pytest-gradref report (no list of tests)")
    version = document.get("format_version")
    if version not in FORMAT_VERSIONS:
        known = ", ".join(str(v) for v in sorted(FORMAT_VERSIONS))
        if version is None:
            why = "it has no format_version (written before reports had one); write it again"
        else:
            why = f"unknown report format version {version!r}"
        raise UnusableInput(f"{name}: {why}; this pytest-gradref reads version {known}")
    tests: dict[str, dict[str, Any]] = {}
    for record in document["tests"]:
        if not isinstance(record, dict) or not isinstance(record.get("nodeid"), str):
            raise UnusableInput(f"{name}: a test record without a node id")
        items = record.get("items")
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise UnusableInput(f"{name}: {record['nodeid']}: no list of items")
        tests[record["nodeid"]] = record
    devices = document.get("devices", [])
    if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
        raise UnusableInput(f"{name}: devices must be a list of device names, got {devices!r}")
    strategy_is_default = document.get("strategy_is_default") is True
    default_strategy = document.get("default_strategy")
    if default_strategy is None and strategy_is_default:  # a report from before the field
        default_strategy = document.get("strategy")
    return Report(
        path=name,
        format_version=version,
        base_seed=document.get("base_seed"),
        torch=document.get("torch"),
        device=document.get("device"),
        backend=document.get("backend"),
        strategy=document.get("strategy"),
        strategy_is_default=strategy_is_default,
        tests=tests,
        default_strategy=default_strategy,
        simulated=document.get("simulated") is True,
        simulated_numerics=document.get("simulated_numerics"),
        devices=tuple(devices),
    )


class RegressionKind(enum.Enum):
    """Why an item is a regression, decided on its numbers (the message is written from them)."""

    NAN = "its error is now NaN"
    NOW_FAILS = "it passed before and fails now"
    GREW = "its error grew past the threshold"
    DRIFTED = "its normwise error moved further than rounding noise moves it"

    @property
    def is_growth(self) -> bool:
        """Whether the kind is a change of the error's size, which a change of device numerics
        (a simulated against a real device) makes too; a NaN or a failure is one anywhere."""
        return self in (RegressionKind.GREW, RegressionKind.DRIFTED)


@dataclass(frozen=True)
class ItemDiff:
    """One item in both reports."""

    nodeid: str
    label: str
    dtype: str
    before: float
    after: float
    # The judged growth: the larger of the greatest error's and the normwise error's, each
    # after / before with both raised to its noise floor; NaN where an error is NaN.
    ratio: float
    noise_floor: float  # the greatest error below which a change counts as noise
    # What each run left of its budget or tolerance (the report's headroom), and whether the
    # item passed there.
    headroom_before: float
    headroom_after: float
    passed_before: bool
    passed_after: bool
    regression: str  # why it is one ("" if it is not)
    # The normwise relative errors (NaN where a report has none) and whether the ratio is
    # theirs.
    norm_before: float = math.nan
    norm_after: float = math.nan
    normwise: bool = False
    # What would have been a regression but is not counted as one (see Diff.uncounted_why).
    uncounted: str = ""
    # The normwise errors' noise floor (see noise_floor), and for a half-precision item of
    # known size the greatest normwise growth its rounding noise explains (see _drift_band;
    # NaN where not judged).
    norm_noise_floor: float = math.nan
    numel: int = 0
    drift_band: float = math.nan
    # The kind of regression (counted or not), None where the item is none.
    kind: RegressionKind | None = None


@dataclass(frozen=True)
class Missing:
    """A test, or an item of a test both reports have, that only one report holds."""

    nodeid: str
    label: str | None = None  # None: the whole test

    def describe(self) -> str:
        return self.nodeid if self.label is None else f"{self.nodeid}: {self.label}"


@dataclass
class Diff:
    """The comparison of two reports."""

    base: Report
    new: Report
    threshold: float
    floor: float
    noise: float
    items: list[ItemDiff] = field(default_factory=list)
    only_in_base: list[Missing] = field(default_factory=list)
    only_in_new: list[Missing] = field(default_factory=list)
    # Differences of set-up that were compared anyway (--allow-mismatch).
    mismatches: list[str] = field(default_factory=list)
    # Why no change counts as a regression here ("" when they do).
    uncounted_why: str = ""

    @property
    def regressions(self) -> list[ItemDiff]:
        return [item for item in self.items if item.regression]

    def nothing_compared(self) -> str:
        """Why no item was judged, and what to compare instead ("" when an item was): a
        comparison of nothing finds no regression, and must never read as a pass. Both
        ``pytest-gradref diff`` and ``--gradref-baseline`` refuse it with this message."""
        if self.items:
            return ""
        for report in (self.base, self.new):
            if not report.tests:
                return (
                    f"{report.path} holds no test record (no test in it used grad_reference); "
                    "compare reports of runs whose tests check references"
                )
        common = sorted(self.base.tests.keys() & self.new.tests.keys())
        if not common:
            return (
                f"no test in common: {self.base.path} holds {_tests(self.base)} "
                f"(e.g. {min(self.base.tests)}), {self.new.path} {_tests(self.new)} "
                f"(e.g. {min(self.new.tests)}); compare reports of the same suite, written "
                "from the same rootdir (node ids are relative to it)"
            )
        first = common[0]
        before, after = self.base.tests[first]["items"], self.new.tests[first]["items"]
        if before and after:
            fix = "their items' labels differ: compare reports of the same version of the tests"
        else:
            fix = (
                "a test records an item for each value it compares (assert_close), none where "
                "it fails, skips or returns before comparing: let those tests compare"
            )
        return (
            f"{len(common)} {'test' if len(common) == 1 else 'tests'} in common, but no item "
            f"in both (e.g. {first}: {len(before)} in {self.base.path}, {len(after)} in "
            f"{self.new.path}); {fix}"
        )


def _tests(report: Report) -> str:
    return f"{len(report.tests)} {'test' if len(report.tests) == 1 else 'tests'}"


def _labelled(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Items by label; the n-th repeat of a label (several assert_close calls) gets " #n"."""
    seen: dict[str, int] = {}
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        label = str(item.get("label"))
        count = seen[label] = seen.get(label, 0) + 1
        out[label if count == 1 else f"{label} #{count}"] = item
    return out


def _received_default(report: Report, nodeid: str) -> bool:
    """Whether the test received its backend's default strategy: under the default, and under
    crosscheck (which gives the test the default and checks it against the other)."""
    return (report.strategy_is_default or report.strategy == "crosscheck") and report.tests[
        nodeid
    ].get("strategies") == [report.default_strategy]


def _follows_device_defaults(base: Report, new: Report, nodeid: str) -> bool:
    """Whether a test's strategies differ only because each run took its own backend's
    default: the comparison across devices that the reports exist for (a CUDA run's autograd
    reference against an npu run's grad_and_value), each error measured against its own run's
    golden. A crosscheck run counts as its default: its tests received it."""
    return (
        base.backend != new.backend
        and _received_default(base, nodeid)
        and _received_default(new, nodeid)
    )


def _inputs_differ(old: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether a test's references were computed from other inputs: by their fingerprints, in
    order (a test that stopped early on one side is judged on the references both computed);
    by the seed torch held where a reference has none (a Hypothesis example, a tensor
    subclass)."""
    pairs = list(zip(old.get("inputs") or [], now.get("inputs") or []))
    if all(a is not None and b is not None for a, b in pairs):
        return any(a != b for a, b in pairs)
    return bool(old.get("torch_seed") != now.get("torch_seed"))


def mismatches(base: Report, new: Report) -> list[str]:
    """Differences of set-up that make the errors incomparable: tests whose references were
    computed from other inputs (judged by the fingerprints of their inputs where both reports
    record them, whatever the seeds: a suite that seeds its own tests draws the same numbers
    under any base seed; by the base seed for older reports), strategy per test (other than
    each device's default strategy on two devices)."""
    found = []
    common = sorted(base.tests.keys() & new.tests.keys())
    if min(base.format_version, new.format_version) < INPUTS_FORMAT:
        if base.base_seed != new.base_seed:
            found.append(f"base seeds differ: {base.seed_text()} in base, {new.seed_text()} in new")
    else:
        other_inputs = [n for n in common if _inputs_differ(base.tests[n], new.tests[n])]
        if other_inputs:
            shown = 5
            more = len(other_inputs) - shown
            count = len(other_inputs)
            found.append(
                f"inputs differ in {count} {'test' if count == 1 else 'tests'}: "
                + ", ".join(other_inputs[:shown])
                + (f" and {more} more" if more > 0 else "")
                + " (the fingerprints of their references' inputs differ, or where a reference "
                "has none the seeds torch held: numbers drawn under another seed, or from "
                "another device's generator; to compare across devices, draw the inputs on "
                "the CPU and move them)"
            )
    differing = [
        nodeid
        for nodeid in common
        if base.tests[nodeid].get("strategies") != new.tests[nodeid].get("strategies")
        # A test that computed no reference on one side (it failed or xfailed first) has
        # nothing to compare; its items are listed as only in the other report.
        and base.tests[nodeid].get("strategies")
        and new.tests[nodeid].get("strategies")
        and not _follows_device_defaults(base, new, nodeid)
    ]
    if differing:
        first = differing[0]
        base_record, new_record = base.tests[first], new.tests[first]
        found.append(
            f"strategies differ in {len(differing)} tests, e.g. {first}: "
            f"{base_record.get('strategies')} in base ({base.strategy_origin(base_record)}), "
            f"{new_record.get('strategies')} in new ({new.strategy_origin(new_record)}); "
            "only each device's own default (or a crosscheck's) compares across devices"
        )
    return found


def simulation_differs(base: Report, new: Report) -> str:
    """Why the two reports' changes are no regressions when one ran on a simulated device and
    the other did not ("" otherwise)."""
    if base.simulated and new.simulated:
        numerics = (base.simulated_numerics or "cpu", new.simulated_numerics or "cpu")
        if numerics[0] == numerics[1]:
            return ""
        return (
            f"base ran the simulated npu with {numerics[0]} numerics, new with {numerics[1]} "
            "(--gradref-simulate-numerics): their errors differ by the modelled numerics, not "
            "by a change of the code; shown, not counted as regressions (compare runs of the "
            "same numerics to gate); a NaN or a failure still counts"
        )
    if base.simulated == new.simulated:
        return ""
    which = "new" if new.simulated else "base"
    return (
        f"{which} ran on a simulated device, the other on a real one: the simulation runs the "
        "CPU's operators and compiled code eagerly, so its errors' growth is the code path's, "
        "not the device's; shown, not counted as regressions (compare two simulated reports, "
        "or two real ones, to gate); a NaN or a failure still counts"
    )


def _step(old: dict[str, Any], now: dict[str, Any]) -> tuple[float, float]:
    """One rounding step of the item's dtype: at its scale (the larger of the two reports'),
    absolute, and relative; NaN where the reports do not tell (no scale, an unknown dtype)."""
    epsilon = EPSILONS.get(str(now.get("dtype", old.get("dtype"))), math.nan)
    scales = [s for s in (_number(old.get("scale")), _number(now.get("scale"))) if math.isfinite(s)]
    return (epsilon * max(scales) if scales else math.nan), epsilon


# The most rounding steps at its scale that a float32 or float64 item's reference error
# adds to its noise floor (see _reference_noise): a summation-order change moved the kernel
# suite's close-student loss from 12 steps to 41 (noise), while a less stable formula moved it
# from 30 to 4,800, as bad as its plain float32 reference (caught).
REFERENCE_NOISE_STEPS = 64.0
# ... or up to this many times the item's own error before, where that is more: an item that
# erred about as much as its plain reference is a plain computation of an ill-conditioned
# value, whose error moves with the reference's (the close-student gradients, 280 steps, grew
# up to 2.23x between ATen's vectorized and scalar paths, their references' errors 1.4x to
# 1.6x; judged at the reference's error, 1.64x at most), while an item far more accurate than
# its reference (the close-student loss, 30 steps against 4,800) keeps the digits it earned
# guarded.
REFERENCE_NOISE_OWN = 2.0
# Dtypes whose references are plain computations of the item in that dtype, so that their own
# error is the item's rounding noise there (see _reference_noise).
_FULL_PRECISION = frozenset({"float32", "float64", "complex64", "complex128"})


def _reference_noise(old: dict[str, Any], now: dict[str, Any]) -> tuple[float, float]:
    """For a float32 or float64 item, the same-dtype reference's own greatest and normwise
    relative error (the larger of the two reports'): an ill-conditioned item (a loss that is a
    small difference of large sums) errs by many rounding steps of its own scale in any plain
    float32 computation, and a kernel's error below that moves with summation order. Not for
    half precision, whose references often round every step (a naive bf16 reference errs 40
    steps where a float32-internal kernel errs half of one, which would hide a twentyfold
    growth). 0 where the reports hold none."""
    if str(now.get("dtype", old.get("dtype"))) not in _FULL_PRECISION:
        return 0.0, 0.0
    found = []
    for key in ("reference_error", "reference_norm_rel"):
        values = [_number(item.get(key)) for item in (old, now)]
        finite = [v for v in values if math.isfinite(v)]
        found.append(max(finite) if finite else 0.0)
    return found[0], found[1]


def _capped(reference: float, step: float, before: float) -> float:
    """A float32 item's reference error, as far as it counts as noise (see
    REFERENCE_NOISE_STEPS and REFERENCE_NOISE_OWN)."""
    own = REFERENCE_NOISE_OWN * before if math.isfinite(before) else 0.0
    return min(reference, max(REFERENCE_NOISE_STEPS * step, own))


def _growth(before: float, after: float, floor: float) -> float:
    """after / before with both raised to the floor; NaN where either is NaN."""
    if math.isnan(before) or math.isnan(after):
        return math.nan
    return max(after, floor) / max(before, floor)


def _numel(old: dict[str, Any], now: dict[str, Any]) -> int:
    """The item's element count where both reports record the same one, else 0."""
    counts = {item.get("numel") for item in (old, now)}
    (count,) = counts if len(counts) == 1 else (0,)
    return count if isinstance(count, int) and count > 0 else 0


def _drift_band(dtype: str, numel: int) -> float:
    """The greatest normwise growth that re-drawn roundings explain for a half-precision item
    of ``numel`` elements (see ROUNDING_NORM_SPREAD); NaN for other items."""
    if dtype not in _HALF_PRECISION or numel < DRIFT_MIN_NUMEL:
        return math.nan
    return 1 + DRIFT_SIGMAS * ROUNDING_NORM_SPREAD / math.sqrt(numel)


def _kind(item: ItemDiff, threshold: float) -> RegressionKind | None:
    """The item's regression kind, from its numbers; None where it is no regression."""
    if math.isnan(item.after) and not math.isnan(item.before):
        return RegressionKind.NAN
    if item.passed_before and not item.passed_after:
        return RegressionKind.NOW_FAILS
    if item.ratio > threshold:
        return RegressionKind.GREW
    if item.normwise and item.ratio > item.drift_band:  # False for a NaN band
        return RegressionKind.DRIFTED
    return None


def _verdict(item: ItemDiff, kind: RegressionKind) -> str:
    """The message for a regression of ``kind``, written from the item's numbers."""
    if kind is RegressionKind.NAN:
        return "error is now NaN"
    if kind is RegressionKind.NOW_FAILS:
        return "now fails"
    if kind is RegressionKind.GREW:
        return f"{'normwise ' if item.normwise else ''}error grew {item.ratio:.3g}x"
    return (
        f"normwise error drifted {item.ratio:.3g}x ({item.norm_before:.3g} -> "
        f"{item.norm_after:.3g}): rounding noise moves it {item.drift_band:.3g}x at most "
        f"over {item.numel} elements"
    )


def compare_reports(
    base: Report,
    new: Report,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    floor: float = DEFAULT_FLOOR,
    noise: float = DEFAULT_NOISE,
    allow_mismatch: bool = False,
) -> Diff:
    """Match the two reports' items and judge each; UnusableInput where the set-ups differ
    (unless allow_mismatch)."""
    found = mismatches(base, new)
    if found and not allow_mismatch:
        raise UnusableInput(
            "; ".join(found) + ": the errors are not comparable (--allow-mismatch compares anyway)"
        )
    uncounted_why = simulation_differs(base, new)
    diff = Diff(base, new, threshold, floor, noise, mismatches=found, uncounted_why=uncounted_why)
    for nodeid in sorted(base.tests.keys() - new.tests.keys()):
        diff.only_in_base.append(Missing(nodeid))
    for nodeid in sorted(new.tests.keys() - base.tests.keys()):
        diff.only_in_new.append(Missing(nodeid))
    for nodeid in sorted(base.tests.keys() & new.tests.keys()):
        before_items = _labelled(base.tests[nodeid]["items"])
        after_items = _labelled(new.tests[nodeid]["items"])
        diff.only_in_base += [Missing(nodeid, k) for k in before_items if k not in after_items]
        diff.only_in_new += [Missing(nodeid, k) for k in after_items if k not in before_items]
        for label, old in before_items.items():
            if label not in after_items:
                continue
            now = after_items[label]
            before, after = _number(old.get("max_abs")), _number(now.get("max_abs"))
            step, relative_step = _step(old, now)
            noise_floor = max(floor, noise * step) if math.isfinite(step) else floor
            reference_max, reference_norm = _reference_noise(old, now)
            norm_before, norm_after = _number(old.get("norm_rel")), _number(now.get("norm_rel"))
            if math.isfinite(step):
                reference_max = _capped(reference_max, step, before)
                reference_norm = _capped(reference_norm, relative_step, norm_before)
            noise_floor = max(noise_floor, reference_max)
            ratio = _growth(before, after, noise_floor)
            dtype = str(now.get("dtype", old.get("dtype", "-")))
            numel = _numel(old, now)
            drift_band = _drift_band(dtype, numel)
            normwise = False
            norm_floor = math.nan
            if math.isfinite(relative_step) and not (
                math.isnan(norm_before) or math.isnan(norm_after)
            ):
                norm_floor = max(floor, noise * relative_step, reference_norm)
                if math.isfinite(drift_band):
                    # Judged by its rounding statistics instead (see _drift_band).
                    norm_floor = max(floor, DRIFT_FLOOR_STEPS * relative_step)
                norm_ratio = _growth(norm_before, norm_after, norm_floor)
                if norm_ratio > ratio:
                    ratio, normwise = norm_ratio, True
            item = ItemDiff(
                nodeid=nodeid,
                label=label,
                dtype=dtype,
                before=before,
                after=after,
                ratio=ratio,
                noise_floor=noise_floor,
                headroom_before=_number(old.get("headroom")),
                headroom_after=_number(now.get("headroom")),
                passed_before=old.get("passed") is True,
                passed_after=now.get("passed") is True,
                regression="",
                norm_before=norm_before,
                norm_after=norm_after,
                normwise=normwise,
                norm_noise_floor=norm_floor,
                numel=numel,
                drift_band=drift_band,
            )
            kind = _kind(item, threshold)
            verdict = "" if kind is None else _verdict(item, kind)
            # Across a simulated and a real device a change of the error's size (grown or
            # drifted) is the devices' numerics as much as the code's, and is shown, not
            # counted; a NaN or a failure is one on either device, and counts.
            if uncounted_why and kind is not None and kind.is_growth:
                diff.items.append(replace(item, kind=kind, uncounted=verdict))
            else:
                diff.items.append(replace(item, kind=kind, regression=verdict))
    diff.items.sort(key=_worst_first)
    return diff


def _worst_first(item: ItemDiff) -> tuple[int, float, str, str]:
    """Regressions (counted or not) first, then by ratio, greatest first (NaN ratios last),
    then by name."""
    ratio = -math.inf if math.isnan(item.ratio) else item.ratio
    return (0 if item.regression or item.uncounted else 1, -ratio, item.nodeid, item.label)
