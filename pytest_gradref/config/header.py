"""The gradref header line: the device, the strategy, the seed and the threads in force, and
where each came from."""

from __future__ import annotations

import pytest

from pytest_gradref.config.settings import SEED_EVERY_TEST_OPTION, SEED_OPTION
from pytest_gradref.config.state import gradref_state, threads_key


def header_once(config: pytest.Config) -> list[str]:
    """The gradref header line, the first time it is asked for after the setup is resolved:
    in the header where the device was resolved at configure time, else after collection
    (auto resolves once a collected test needs the device), or, on an xdist controller
    under -q (which shows no header, and collects nothing itself), atop the workers'
    section."""
    state = gradref_state(config)
    if state.resolved is None or state.reported:
        return []
    state.reported = True
    settings = state.settings
    seed_source = settings.source(SEED_OPTION)
    seed: int | str
    if settings.seed is None:
        seed = f"off (from {seed_source}: gradref leaves torch's seeding to the suite)"
    else:
        seeded = (
            f"every test, from {settings.source(SEED_EVERY_TEST_OPTION)}"
            if settings.seed_every_test
            else "the tests that use gradref"
        )
        origin = "the default" if settings.is_default(SEED_OPTION) else f"from {seed_source}"
        seed = f"{settings.seed} ({origin}; {seeded})"
    line = state.resolved.header_line(seed, settings.verdict)
    plan = config.stash.get(threads_key, None)
    if plan is not None and plan.count is not None:
        line += f" threads={plan.count} ({plan.why})"
    return [line]
