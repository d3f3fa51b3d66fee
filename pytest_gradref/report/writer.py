"""The precision report: what each test compared, how close it came, where strategies differ.

Per-test records ride on the test reports (so they reach the xdist controller), are collected
there, written as JSON with ``--gradref-report=PATH`` and summarised in the terminal.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gradref.config.state import gradref_state, is_xdist_worker
from pytest_gradref.reference.inputs import fingerprints
from pytest_gradref.report.diff import FORMAT_VERSION

if TYPE_CHECKING:
    from pytest_gradref.config.resolution import Resolution
    from pytest_gradref.reference.recording import Recording
    from pytest_gradref.report.device_coverage import DeviceCoverage
    from pytest_gradref.verdict.checks import ItemCheck

TIGHTEST_SHOWN = 10
# The test report attribute that carries a test's record (to the xdist controller too).
RECORD_ATTRIBUTE = "gradref"


def _finite(value: Any) -> Any:
    """JSON has no inf or NaN: write those as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _short(value: Any) -> str:
    """A measure for the summary: three digits, or as the record holds it ("nan", "inf")."""
    return f"{value:.3g}" if isinstance(value, (int, float)) else str(value)


def _plain(obj: Any, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """A flat dataclass instance's fields as a dict (vars: asdict's deep copy costs a test
    more than its comparison)."""
    return {k: _finite(v) for k, v in vars(obj).items() if k not in drop}


def _item_fields(check: ItemCheck) -> dict[str, Any]:
    """A checked item as the report holds it: ``rounded_error`` (the rounded reference's
    error vs the golden) only on the items a budget with a rounded reference checked."""
    drop = ("detail",) if check.rounded_error is not None else ("detail", "rounded_error")
    return _plain(check, drop=drop)


def record_for_test(nodeid: str, resolution: Resolution, recording: Recording) -> dict[str, Any]:
    """One test's record, made of plain values so it can travel between processes."""
    return {
        "nodeid": nodeid,
        "device": str(resolution.device),
        "backend": resolution.backend.name,
        # A simulated device (--gradref-simulate) proves the code path, not the hardware.
        "simulated": resolution.simulated,
        # The strategies whose results the test received; under crosscheck each entry of
        # "crosscheck" also names the strategy it was checked against.
        "strategies": sorted(set(recording.strategies)),
        # The seed gradref gave torch (None where seeding is off), the seed torch's generators
        # held when the references were computed, and whether the test reseeded them after
        # gradref (an autouse fixture of the suite, say: then --gradref-seed changes nothing).
        "seed": recording.seed,
        "torch_seed": recording.torch_seed,
        "reseeded": recording.reseeded,
        # Per reference, a fingerprint of its inputs (None where it has none: a Hypothesis
        # example, a tensor subclass): two reports compare where these agree.
        "inputs": fingerprints(recording.inputs),
        "items": [_item_fields(check) for check in recording.checks],
        "crosscheck": [_plain(d) for d in recording.disagreements],
        # Why a crosscheck session did not crosscheck this test (None where it did, or
        # outside crosscheck).
        "crosscheck_opt_out": recording.crosscheck_opt_out,
        # The aux items that assert_close(aux=UNCHECKED) left uncompared, by label.
        "aux_unchecked": list(recording.aux_unchecked),
        # A multi-rank test's ranks, whose items are labelled "rank r: ..." (None: one process).
        "ranks": recording.ranks,
        # The golden dtype requested and the one fn returned, where fn cast it down.
        "golden_obtained": (
            None
            if recording.golden_shortfall is None
            else dict(zip(("requested", "obtained"), recording.golden_shortfall))
        ),
    }


def check_report_path(path: str) -> None:
    """A usage error, at configure time, where ``--gradref-report`` cannot write PATH: a
    directory, a missing directory, a read-only one. Probed as the report is written: a file
    created beside PATH (then removed), so PATH itself is never touched."""
    target = Path(path)
    parent = target.parent
    if os.path.isdir(target):  # os.path's checks answer False where a stat fails
        problem = (
            "it is a directory; name a file, e.g. "
            f"--gradref-report={target / 'gradref-report.json'}"
        )
    elif not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        problem = f"its directory {parent} {what}; create it first, or name a file elsewhere"
    else:
        try:
            handle, probe = tempfile.mkstemp(prefix=f".{target.name}.", dir=parent)
        except OSError as error:
            problem = (
                f"no file can be created beside it in {parent}: {error.strerror or error}; "
                "name a file in a writable directory"
            )
        else:
            os.close(handle)
            os.remove(probe)
            return
    raise pytest.UsageError(f"--gradref-report={path}: {problem}")


def _write_atomically(path: Path, text: str) -> None:
    """Write a file beside PATH, then rename it over PATH: a write that is interrupted leaves
    the previous report (or none), never a truncated one."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def rank_label(rank: int, label: str) -> str:
    """An item's label in a multi-rank test's record ("rank 1: gradient of argument 0 (x)"):
    launched and spawned ranks' items alike, so the gate compares them by one name."""
    return f"rank {rank}: {label}"


def merge_rank_records(by_rank: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The records of a launched run's ranks (``by_rank[r]`` rank r's) as one run's: a test's
    items from every rank that recorded it, each labelled with its rank ("rank 1: gradient of
    argument 0 (x)"), as a spawned multi-rank test's record holds them; the test failed where
    any rank failed it."""
    merged: dict[str, dict[str, Any]] = {}
    for rank, records in enumerate(by_rank):
        for record in records:
            test = merged.setdefault(
                record["nodeid"],
                {
                    **record,
                    "items": [],
                    "crosscheck": [],
                    "aux_unchecked": [],
                    "inputs": [],
                    "strategies": [],
                    "ranks": [],
                },
            )
            test["items"] += [{**i, "label": rank_label(rank, i["label"])} for i in record["items"]]
            test["crosscheck"] += [
                {**d, "label": rank_label(rank, d["label"])} for d in record["crosscheck"]
            ]
            test["aux_unchecked"] += [rank_label(rank, a) for a in record["aux_unchecked"]]
            test["inputs"] += record["inputs"]
            test["strategies"] = sorted({*test["strategies"], *record["strategies"]})
            test["ranks"].append(rank)
            if record["outcome"] == "failed":
                test["outcome"] = "failed"
            for field in ("crosscheck_opt_out", "golden_obtained"):
                test[field] = test[field] or record[field]
    return list(merged.values())


class ReportCollector:
    """A plugin object that gathers the records on the process that reports (controller)."""

    def __init__(
        self,
        path: str | None,
        base_seed: int | None,
        coverage: DeviceCoverage,
        simulated: bool = False,
    ) -> None:
        self.path = Path(path) if path else None
        self.base_seed = base_seed
        self.coverage = coverage
        self.simulated = simulated
        self.records: list[dict[str, Any]] = []
        # A launched run's world size and its ranks' devices, once rank 0 holds every rank's
        # records (merge_ranks); None in a run of one process.
        self.world_size: int | None = None
        self.rank_devices: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        record = report.__dict__.get(RECORD_ATTRIBUTE)
        # A test that pytest-rerunfailures runs again is recorded by its last run only (the
        # outcome of the others is "rerun", outside pytest's own type).
        if record is not None and str(report.outcome) != "rerun":
            self.records.append({**record, "outcome": report.outcome})

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.path is None or is_xdist_worker(session.config):
            return
        document = {**self.run_fields(session.config), "tests": self.tests()}
        _write_atomically(self.path, json.dumps(document, indent=2) + "\n")

    def merge_ranks(
        self, by_rank: Sequence[Sequence[dict[str, Any]]], devices: Iterable[str]
    ) -> None:
        """Hold every rank's records of a launched run (``by_rank[r]`` rank r's), and the
        devices they ran on, as one run's."""
        self.records = merge_rank_records(by_rank)
        self.world_size = len(by_rank)
        self.rank_devices = sorted(set(devices))

    def tests(self) -> list[dict[str, Any]]:
        """The records of the run's tests, as the report holds them."""
        return sorted(self.records, key=lambda r: r["nodeid"])

    def run_fields(self, config: pytest.Config) -> dict[str, Any]:
        """What a comparison of two reports needs to know about the run as a whole."""
        resolved = gradref_state(config).resolved
        torch = sys.modules.get("torch")  # loaded whenever a test recorded something
        # Run under --gradref-simulate, or any test on a simulated device: such a report
        # proves the code path, not the hardware.
        simulated = self.simulated or any(r.get("simulated", False) for r in self.records)
        return {
            "format_version": FORMAT_VERSION,
            "base_seed": self.base_seed,
            "torch": str(torch.__version__) if torch is not None else None,
            # The session's device; under xdist each worker's may differ (npu:0, npu:1): the
            # devices that tests ran on are "devices", and each test's is in its record.
            "device": resolved.label if resolved is not None else None,
            "devices": self.rank_devices or self.coverage.devices(),
            # Under a launcher, how many ranks' records the report holds (None: one process).
            "world_size": self.world_size,
            "backend": resolved.backend.name if resolved is not None else None,
            "strategy": resolved.effective_strategy() if resolved is not None else None,
            # The backend's default rather than an option's choice: two runs on devices with
            # different defaults (autograd on cuda, grad_and_value on npu) still compare.
            "strategy_is_default": resolved is not None and resolved.strategy is None,
            # What the tests received under the default and under crosscheck: a crosscheck
            # report compares across devices as a default one does.
            "default_strategy": resolved.backend.default_strategy if resolved is not None else None,
            # Dtypes whose golden references the backend computes on the CPU.
            "golden_on_cpu": (
                sorted(resolved.backend.cpu_only_dtypes) if resolved is not None else []
            ),
            "simulated": simulated,
            # The simulated device's numerics ("cpu", or "ascend": ascend_numerics.py), None
            # for a real device: two simulated runs of other numerics do not gate each other.
            "simulated_numerics": _simulated_numerics() if simulated else None,
            # How many tests used the gradref device (a gradref fixture or marker), how many
            # ran without it, and which.
            "device_coverage": self.coverage.fields(),
        }

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        lines = self.summary_lines(verbose=config.get_verbosity() > 0)
        if lines:
            terminalreporter.section("gradref")
            for line in lines:
                terminalreporter.write_line(line)
        if self.path is not None:
            terminalreporter.write_line(f"gradref report written to {self.path}")

    def summary_lines(self, verbose: bool) -> list[str]:
        """Under crosscheck, which strategy the tests received and which it was checked
        against, the tests not crosschecked (wholly or in part) and every disagreement beyond
        tolerance; the tests that reseeded torch after gradref; with -v the aux items left
        unchecked; the tightest items (with -v, or whenever there is such a disagreement, to
        show how much room the tests had)."""
        lines = []
        checked = [(record["nodeid"], d) for record in self.records for d in record["crosscheck"]]
        pairs: dict[tuple[str, str], list[int]] = {}
        for _, d in checked:
            counts = pairs.setdefault((d["received"], d["checked_against"]), [0, 0])
            counts[0] += 1
            counts[1] += bool(d["exceeds_tolerance"])
        for (received, against), (count, beyond) in sorted(pairs.items()):
            lines.append(
                f"crosscheck: {count} items received {received} results, checked against "
                f"{against}; {beyond} {'differs' if beyond == 1 else 'differ'} beyond tolerance"
            )
        # A test opted out when none of its references was crosschecked; one that also has
        # crosschecked references (a kernel reference beside a plain one) only in part.
        opted_out: dict[str, int] = {}
        in_part: dict[str, int] = {}
        for record in self.records:
            reason = record.get("crosscheck_opt_out")
            if reason:
                tests = in_part if record["crosscheck"] else opted_out
                tests[reason] = tests.get(reason, 0) + 1
        for by_reason, what in (
            (opted_out, "opted out, not crosschecked"),
            (in_part, "crosschecked in part, some references not"),
        ):
            if by_reason:
                total = sum(by_reason.values())
                lines.append(
                    f"crosscheck: {total} {'test' if total == 1 else 'tests'} {what}: "
                    + "; ".join(f"{n} by {reason}" for reason, n in sorted(by_reason.items()))
                )
        exceeding = [(nodeid, d) for nodeid, d in checked if d["exceeds_tolerance"]]
        if exceeding:
            lines.append("autograd and grad_and_value disagree beyond tolerance:")
            for nodeid, d in exceeding:
                lines.append(
                    f"  {nodeid}: {d['label']} ({d['dtype']}) differs by {_short(d['max_abs'])} "
                    f"(relative {_short(d['max_rel'])}) between {d['received']} (received) and "
                    f"{d['checked_against']} (checked against); tolerance {d['tolerance']}"
                )
        reseeded = sorted(
            (record for record in self.records if record.get("reseeded")),
            key=lambda record: str(record["nodeid"]),  # the example whatever the order run
        )
        if reseeded:
            # Said whatever the verbosity: --gradref-seed changes nothing in these tests.
            lines.append(
                f"seed: {len(reseeded)} {'test' if len(reseeded) == 1 else 'tests'} reseeded "
                f"torch after gradref seeded {'it' if len(reseeded) == 1 else 'them'} (e.g. "
                f"{reseeded[0]['nodeid']}: torch seed {reseeded[0]['torch_seed']}), so "
                "--gradref-seed does not change their numbers; a suite that seeds its own "
                "tests turns gradref's seeding off with gradref_seed = off in its ini file"
            )
        unchecked = [record for record in self.records if record.get("aux_unchecked")]
        if verbose and unchecked:
            lines.append(
                f"aux left unchecked (assert_close(aux=pytest_gradref.UNCHECKED)) in "
                f"{len(unchecked)} {'test' if len(unchecked) == 1 else 'tests'}:"
            )
            for record in unchecked[:TIGHTEST_SHOWN]:
                lines.append(f"  {record['nodeid']}: {', '.join(record['aux_unchecked'])}")
            if len(unchecked) > TIGHTEST_SHOWN:
                lines.append(
                    f"  and {len(unchecked) - TIGHTEST_SHOWN} more (the report's aux_unchecked)"
                )
        if verbose or exceeding:
            items = [
                (record["nodeid"], item)
                for record in self.records
                for item in record["items"]
                if isinstance(item["headroom"], (int, float))
            ]
            items.sort(key=lambda pair: pair[1]["headroom"])
            if items:
                lines.append(f"tightest compared items (of {len(items)}):")
            for nodeid, item in items[:TIGHTEST_SHOWN]:
                lines.append(
                    f"  headroom {item['headroom']:7.1%}  {item['dtype']:>8}  {item['label']}  "
                    f"in {nodeid}  [{item['criterion']}]"
                )
        return lines


def _simulated_numerics() -> str:
    """The numerics of this process's simulated npu (torch is loaded: a test ran on it)."""
    from pytest_gradref.devices import simulated  # the torch layer: simulated.py imports torch

    return simulated.numerics()
