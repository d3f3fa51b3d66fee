"""Which tests ran on the gradref device, and which ran without it.

A test uses the gradref device when it takes a gradref fixture or carries a gradref marker;
any other test puts its tensors wherever it chooses (the CPU, unless it probes for a device
itself). On a CPU run that loses nothing. On any other device, or a simulated one, it is
coverage that did not happen: the terminal summary and the report count both kinds, and
``--gradref-strict-device`` fails such a run.

Each test's use rides on its test report (so it reaches the xdist controller) and is counted
where the session reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from pytest_gradref.settings import STRICT_DEVICE_EXIT

if TYPE_CHECKING:
    from pytest_gradref.settings import Setup

# The test report attribute that carries {"used": bool, "device": str} for a test's call.
USE_ATTRIBUTE = "gradref_device_use"
LISTED = 5  # tests without the device named in the summary (-v names them all)


def device_use(used: bool, setup: Setup) -> dict[str, Any]:
    """What a test's report carries: whether it used the gradref device, and which one."""
    return {"used": used, "device": str(setup.device)}


def loses_coverage(setup: Setup) -> bool:
    """Whether a test without the gradref device ran somewhere else than the run claims: on
    any device but the CPU (where plain tensors land), and on every simulated one."""
    return setup.simulated or setup.device.type != "cpu"


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

    @property
    def without(self) -> list[str]:
        return sorted(nodeid for nodeid, use in self.uses.items() if not use["used"])

    def devices(self) -> list[str]:
        """The devices the tests that used the gradref device ran on (npu:0, npu:1 under -n)."""
        return sorted({use["device"] for use in self.uses.values() if use["used"]})

    def fields(self) -> dict[str, Any]:
        """The report's account of it."""
        without = self.without
        return {
            "used": len(self.uses) - len(without),
            "not_used": len(without),
            "not_used_tests": without,
        }

    def _setup(self, config: pytest.Config) -> Setup | None:
        from pytest_gradref.state import gradref_state

        return gradref_state(config).resolved

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        from pytest_gradref.state import is_xdist_worker

        setup = self._setup(session.config)
        if is_xdist_worker(session.config) or setup is None or not loses_coverage(setup):
            return
        if self.strict and self.without:
            self.failed_session = True
            if session.exitstatus == pytest.ExitCode.OK:
                session.exitstatus = STRICT_DEVICE_EXIT

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        setup = self._setup(config)
        if setup is None or not loses_coverage(setup) or not self.uses:
            return
        terminalreporter.section("gradref device coverage")
        for line in self.summary_lines(setup, verbose=config.get_verbosity() > 0):
            terminalreporter.write_line(line)

    def summary_lines(self, setup: Setup, verbose: bool) -> list[str]:
        without = self.without
        devices = ", ".join(self.devices()) or setup.label
        simulated = "; simulated on CPU" if setup.simulated else ""
        lines = [
            f"{len(self.uses) - len(without)} tests used the gradref device ({devices}"
            f"{simulated}); {len(without)} ran without it (no "
            "gradref fixture or marker: their tensors went where they put them, the CPU "
            "unless they chose a device themselves)"
        ]
        shown = without if verbose else without[:LISTED]
        lines += [f"  without the device: {nodeid}" for nodeid in shown]
        if len(shown) < len(without):
            lines.append(f"  ... {len(without) - len(shown)} more (-v lists them all)")
        if self.failed_session:
            lines.append(
                f"--gradref-strict-device: {len(without)} tests ran without the gradref device, "
                f"so the session fails (exit status {STRICT_DEVICE_EXIT}). Give them the "
                "gradref_device fixture (or a gradref marker), deselect them, or run without "
                "--gradref-strict-device."
            )
        return lines
