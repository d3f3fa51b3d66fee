"""The session's gradref state and the stash keys that hold it.

Its own module so that plugin.py and the plugin objects it registers (devices/xdist.py,
ranks/pytest_side.py, report/writer.py, report/baseline.py, report/device_coverage.py) all
import it, and none of them imports plugin.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

from pytest_gradref.config.resolution import resolve

if TYPE_CHECKING:
    from pytest_gradref.config.resolution import Resolution
    from pytest_gradref.config.settings import DeviceRequest, Settings
    from pytest_gradref.config.threads import ThreadPlan
    from pytest_gradref.devices.backends import BackendRegistry
    from pytest_gradref.reference.recording import Recording


@dataclass
class GradrefState:
    """Per-session state: the registry, the settings and, once needed, the resolution."""

    registry: BackendRegistry
    # Every gradref setting, read and validated once at configure time.
    settings: Settings
    # The device this process runs on: the device setting, or on an xdist worker the device
    # its controller assigned.
    device_request: DeviceRequest
    resolved: Resolution | None = None
    reported: bool = False

    def resolution(self) -> Resolution:
        """The resolved device and strategy; probes the backends (imports torch) once."""
        if self.resolved is None:
            self.resolved = resolve(self.device_request, self.settings, self.registry)
        return self.resolved


state_key = pytest.StashKey[GradrefState]()
# What one test's references checked, on the test item.
recording_key: pytest.StashKey[Recording] = pytest.StashKey()
# The seed gradref gave torch for the test, on the test item (absent where it gave none).
seed_key: pytest.StashKey[int] = pytest.StashKey()
# The CPU threads this process computes with (threads.py), on the config, once applied.
threads_key: pytest.StashKey[ThreadPlan] = pytest.StashKey()


def gradref_state(config: pytest.Config) -> GradrefState:
    return config.stash[state_key]


def is_xdist_worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker (which reports to a controller)."""
    return hasattr(config, "workerinput")
