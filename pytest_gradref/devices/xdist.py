"""Multi-device runs under pytest-xdist.

The controller decides which device each worker takes (round-robin over the devices the caller
made visible, or every worker on an explicitly pinned index) and hands it over through
``workerinput``, so a worker knows its device before any test touches one. Each worker reports
back what it ran on, and the controller's summary shows the mapping.

Its hooks are registered only where pytest-xdist is installed; the module itself imports
neither xdist nor torch.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pytest

from pytest_gradref.config.header import header_once
from pytest_gradref.config.settings import DeviceRequest, Setting, parse_device
from pytest_gradref.config.state import threads_key

if TYPE_CHECKING:
    from pytest_gradref.config.resolution import Resolution
    from pytest_gradref.config.state import GradrefState
    from pytest_gradref.devices.backends import BackendRegistry

WORKER_DEVICE_KEY = "gradref_device"
WORKER_SETUP_KEY = "gradref_setup"


def worker_number(workerid: str) -> int:
    """An xdist worker's number, from its id: gw3 is 3."""
    return int(workerid.removeprefix("gw"))


def assign_devices(
    backend_name: str, device_count: int, worker_count: int, pinned_index: int | None
) -> list[str]:
    """The device of each worker, by worker number.

    Round-robin over the ``device_count`` visible devices, so more workers than devices share
    them evenly; every worker on ``pinned_index`` when the user named one.
    """
    if pinned_index is not None:
        return [f"{backend_name}:{pinned_index}"] * worker_count
    count = max(device_count, 1)
    return [f"{backend_name}:{number % count}" for number in range(worker_count)]


def physical_ids(visible_env: str | None) -> list[str] | None:
    """What the visible-devices variable maps indices to, e.g. ["2", "3"]; None when unset."""
    if not visible_env or not os.environ.get(visible_env, "").strip():
        return None
    return [part.strip() for part in os.environ[visible_env].split(",")]


def worker_device_request(config: pytest.Config, registry: BackendRegistry) -> DeviceRequest | None:
    """On a worker, the device its controller assigned (None elsewhere), parsed and validated
    as the controller's own setting is."""
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if not workerinput or WORKER_DEVICE_KEY not in workerinput:
        return None
    source = f"the xdist controller for worker {workerinput.get('workerid', '?')}"
    return parse_device(Setting(workerinput[WORKER_DEVICE_KEY], source), registry)


class XdistHooks:
    """xdist-only hooks: assigns devices on the controller, reports them from the workers."""

    def __init__(self, state: GradrefState) -> None:
        self.state = state
        self.workers: dict[str, dict[str, Any]] = {}

    @pytest.hookimpl
    def pytest_configure_node(self, node: Any) -> None:
        resolution = self.state.resolution()
        pinned = self.state.settings.device.index
        mapping = assign_devices(
            resolution.backend.name,
            resolution.backend.device_count(),
            node.workerinput["workercount"],
            pinned,
        )
        workerid: str = node.workerinput["workerid"]
        number = worker_number(workerid)
        node.workerinput[WORKER_DEVICE_KEY] = mapping[number % len(mapping)]

    @pytest.hookimpl
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        output = getattr(node, "workeroutput", {}).get(WORKER_SETUP_KEY)
        if output is not None:
            self.workers[node.workerinput["workerid"]] = output

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(session.config, "workeroutput", None)
        resolution = self.state.resolved
        if workeroutput is not None and resolution is not None:
            summary = worker_summary(resolution)
            plan = session.config.stash.get(threads_key, None)
            if plan is not None and plan.count is not None:
                summary["threads"] = f"{plan.count} thread(s): {plan.why}"
            workeroutput[WORKER_SETUP_KEY] = summary

    @pytest.hookimpl
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.workers:
            return
        terminalreporter.section("gradref workers")
        # Under -q the header was not shown (and a controller collects nothing, where a
        # plain run says it after collection): the header line heads the workers instead.
        for line in header_once(terminalreporter.config):
            terminalreporter.write_line(line)
        for workerid in sorted(self.workers, key=worker_number):
            info = self.workers[workerid]
            physical = f", physical {info['physical']}" if info.get("physical") else ""
            threads = f"; {info['threads']}" if info.get("threads") else ""
            terminalreporter.write_line(
                f"{workerid} -> {info['device']} ({info['description']}{physical}; "
                f"current device {info['current']}{threads})"
            )


def worker_summary(resolution: Resolution) -> dict[str, Any]:
    """What a worker ran on, in plain values for workeroutput."""
    ids = physical_ids(resolution.backend.visible_devices_env)
    index = resolution.index if resolution.index is not None else 0
    current = resolution.backend.current_device()
    return {
        "device": resolution.label,
        "description": resolution.description(),
        "simulated": resolution.simulated,
        "physical": ids[index] if ids and index < len(ids) else None,
        "current": current,
    }
