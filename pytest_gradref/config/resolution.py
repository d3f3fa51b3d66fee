"""The session's device and strategy, resolved from the settings: which backends are
available, and which device the tests run on.

Resolving probes the backends, which imports torch (and torch_npu where npu is probed): the
session does it once a test needs the device, or at configure time where a device is asked
for explicitly (state.py, plugin.py). Importing this module loads neither.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

from pytest_gradref.config.settings import SIMULATED_PACKAGES, STRATEGY_OPTION

if TYPE_CHECKING:
    import torch

    from pytest_gradref.config.settings import DeviceRequest, Settings
    from pytest_gradref.config.strategies import StrategyChoice
    from pytest_gradref.devices.backends import Backend, BackendRegistry


@dataclass(frozen=True)
class Resolution:
    """The session's device and strategy as resolved from the settings, and where each came
    from, as the header reports them."""

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
            # The torch layer: simulated.py imports torch, loaded already on a simulated run.
            from pytest_gradref.devices.simulated import numerics_note

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


def resolve(request: DeviceRequest, settings: Settings, registry: BackendRegistry) -> Resolution:
    """Probe backends and pick the device ``request`` names (the device setting, or the one
    an xdist controller assigned), with the strategy ``settings`` give; a usage error says
    why a request cannot be met."""
    simulated = settings.simulated
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
    return Resolution(
        backend=backend,
        device=backend.device(request.index),
        index=request.index,
        device_source=device_source,
        strategy=settings.strategy,
        strategy_source=settings.source(STRATEGY_OPTION),
        unavailable=tuple(unavailable),
        simulated=backend.device_type in simulated,
    )


def _simulation_hint(backend: Backend, simulated: frozenset[str]) -> str:
    """How to run an unavailable device's code path without its hardware, as a clause of the
    error ("" where --gradref-simulate cannot help: a real runtime is installed, which the
    simulation refuses to shadow, or the device is no simulatable one)."""
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
