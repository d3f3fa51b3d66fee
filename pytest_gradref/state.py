"""The session's gradref state and the stash keys that hold it.

Its own module so that the hook modules (plugin.py, xdist.py) both import it and neither
imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_gradref.backends import BackendRegistry
    from pytest_gradref.recording import Recording
    from pytest_gradref.settings import DeviceRequest, Setup
    from pytest_gradref.strategies import StrategyChoice


@dataclass
class GradrefState:
    """Per-session state: the registry, the parsed settings and, once needed, the setup."""

    registry: BackendRegistry
    device_request: DeviceRequest
    strategy: StrategyChoice | None
    strategy_source: str
    # The base seed; None where seeding is off (--gradref-seed=off): the suite seeds its tests.
    seed: int | None
    # golden or tolerance (--gradref-verdict): how a test without a tolerance is judged.
    verdict: str = "golden"
    # Device types this process simulates (--gradref-simulate), installed before any probe.
    simulated: frozenset[str] = frozenset()
    # Where the seed setting came from, for the header.
    seed_source: str = "the default"
    resolved: Setup | None = None
    reported: bool = False

    def setup(self) -> Setup:
        """The resolved device and strategy; probes the backends (imports torch) once."""
        if self.resolved is None:
            from pytest_gradref.settings import resolve

            self.resolved = resolve(
                self.device_request,
                self.strategy,
                self.strategy_source,
                self.registry,
                self.simulated,
            )
        return self.resolved


state_key = pytest.StashKey[GradrefState]()
# What one test's references checked, on the test item.
recording_key: pytest.StashKey[Recording] = pytest.StashKey()
# The seed gradref gave torch for the test, on the test item (absent where it gave none).
seed_key: pytest.StashKey[int] = pytest.StashKey()


def gradref_state(config: pytest.Config) -> GradrefState:
    return config.stash[state_key]


def is_xdist_worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker (which reports to a controller)."""
    return hasattr(config, "workerinput")
