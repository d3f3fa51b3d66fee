"""Which tests ran on the gradref device, and which ran without it.

A test uses the gradref device when it declares it (takes a gradref fixture or carries a
gradref marker) or when it allocates tensors on it during its setup and call: a library that
finds the device itself (``infer_device()`` returning "npu") uses it as well. Allocations are
observed by the backend's allocation count (``Backend.allocation_count``), read before setup
and after the call, only where coverage can be lost. Any other test put its tensors on the CPU
or touched none at all; the two cannot be told apart cheaply (the CPU allocator keeps no
count, and watching every operator would cost each test), so they are one group.

On a CPU run nothing is lost. On any other device, or a simulated one, a test without the
device is coverage that did not happen: the terminal summary and the report count both kinds,
and ``--gradref-strict-device`` fails such a run.

Each test's use rides on its test report (so it reaches the xdist controller) and is counted
where the session reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import pytest

from pytest_gradref.config.settings import STRICT_DEVICE_EXIT
from pytest_gradref.config.state import gradref_state, is_xdist_worker

if TYPE_CHECKING:
    from pytest_gradref.config.resolution import Resolution

# The test report attribute that carries a test's use of the device (see ``device_use``).
USE_ATTRIBUTE = "gradref_device_use"
LISTED = 5  # tests without the device named in the summary (-v names them all)
# The device's allocation count when the test's setup began (None: the backend counts none).
_allocations_before = pytest.StashKey[Optional[int]]()  # Optional: Python 3.9 evaluates it


def device_use(item: pytest.Item, declared: bool, resolution: Resolution) -> dict[str, Any]:
    """What a test's report carries: whether it used the gradref device (declared it, or
    allocated on it), which device, and whether it allocated there (None: not observed)."""
    allocated = None
    if _allocations_before in item.stash:
        before = item.stash[_allocations_before]
        after = resolution.backend.allocation_count(resolution.device)
        if before is not None and after is not None:
            allocated = after > before
    return {
        "used": declared or bool(allocated),
        "declared": declared,
        "allocated": allocated,
        "device": str(resolution.device),
    }


def loses_coverage(resolution: Resolution) -> bool:
    """Whether a test without the gradref device ran somewhere else than the run claims: on
    any device but the CPU (where plain tensors land), and on every simulated one."""
    return resolution.simulated or resolution.device.type != "cpu"


class DeviceCoverage:
    """A plugin object that counts, on the process that reports, each test's device use."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.uses: dict[str, dict[str, Any]] = {}
        self.failed_session = False

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        use = report.__dict__.get(USE_ATTRIBUTE)
        if use is not None:  # keyed by node id: a rerun test counts once, by its last run
            self.uses[report.nodeid] = use

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        # Before any fixture runs; not at all where nothing can be lost (a CPU run pays nothing).
        resolution = self._resolution(item.config)
        if resolution is not None and loses_coverage(resolution):
            item.stash[_allocations_before] = resolution.backend.allocation_count(resolution.device)

    @property
    def without(self) -> list[str]:
        return sorted(nodeid for nodeid, use in self.uses.items() if not use["used"])

    def devices(self) -> list[str]:
        """The devices the tests that used the gradref device ran on (npu:0, npu:1 under -n)."""
        return sorted({use["device"] for use in self.uses.values() if use["used"]})

    @property
    def found_it_themselves(self) -> int:
        """Tests that used the device without declaring it: they allocated on it."""
        return sum(1 for use in self.uses.values() if use["used"] and not use["declared"])

    @property
    def allocations_counted(self) -> bool:
        """Whether every test's allocations on the device were observed (not on the CPU, nor
        where the backend counts none)."""
        return bool(self.uses) and all(use["allocated"] is not None for use in self.uses.values())

    def fields(self) -> dict[str, Any]:
        """The report's account of it."""
        without = self.without
        return {
            "used": len(self.uses) - len(without),
            "not_used": len(without),
            "not_used_tests": without,
            "used_undeclared": self.found_it_themselves,
            "allocations_counted": self.allocations_counted,
        }

    def _resolution(self, config: pytest.Config) -> Resolution | None:
        return gradref_state(config).resolved

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        resolution = self._resolution(session.config)
        if is_xdist_worker(session.config) or resolution is None or not loses_coverage(resolution):
            return
        if self.strict and self.without:
            self.failed_session = True
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = STRICT_DEVICE_EXIT

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        resolution = self._resolution(config)
        if resolution is None or not loses_coverage(resolution) or not self.uses:
            return
        terminalreporter.section("gradref device coverage")
        for line in self.summary_lines(resolution, verbose=config.get_verbosity() > 0):
            terminalreporter.write_line(line)

    def summary_lines(self, resolution: Resolution, verbose: bool) -> list[str]:
        without = self.without
        devices = ", ".join(self.devices()) or resolution.label
        simulated = "; simulated on CPU" if resolution.simulated else ""
        found = self.found_it_themselves
        line = (
            f"{len(self.uses) - len(without)} tests used the gradref device ({devices}{simulated})"
        )
        if found:
            line += f", {found} of them without a gradref fixture or marker (they allocated on it)"
        line += f"; {len(without)} ran without it"
        if without and self.allocations_counted:
            line += (
                " (no gradref fixture or marker and no tensor allocated on the device: tests "
                "that ran on the CPU and tests that never touch torch alike; "
            )
        elif without:
            line += (
                f" (no gradref fixture or marker; {resolution.backend.name} counts no allocations, "
                "so a test that chose the device itself counts here too, as do tests that "
                "never touch torch; "
            )
        if without:
            line += (
                "@pytest.mark.gradref with no arguments on a test that needs no device, or "
                "deselecting it, clears --gradref-strict-device)"
            )
        lines = [line]
        shown = without if verbose else without[:LISTED]
        lines += [f"  without the device: {nodeid}" for nodeid in shown]
        if len(shown) < len(without):
            lines.append(f"  ... {len(without) - len(shown)} more (-v lists them all)")
        if self.failed_session:
            lines.append(
                f"--gradref-strict-device: {len(without)} tests ran without the gradref device, "
                f"so the session fails (exit status {STRICT_DEVICE_EXIT}). Give them the "
                "gradref_device fixture, mark those that need no device @pytest.mark.gradref, "
                "deselect them, or run without --gradref-strict-device."
            )
        return lines
