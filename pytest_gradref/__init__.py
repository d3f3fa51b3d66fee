"""pytest-gradref: reference gradients computed the way each device needs.

See the README for the fixtures, markers and options; this module re-exports the public API.
The names load on first access, so that pytest loading the plugin (which imports this package
first) does not pay for the reference and comparison modules.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_gradref.auxiliary import UNCHECKED
    from pytest_gradref.backends import Backend, BackendRegistry, builtin_backend
    from pytest_gradref.computation import compute_reference
    from pytest_gradref.fixture import GradReference
    from pytest_gradref.ranks import RankContext
    from pytest_gradref.recording import Disagreement
    from pytest_gradref.reference import Reference
    from pytest_gradref.sharding import RankGradReference, ShardedReference
    from pytest_gradref.strategies import Strategy, StrategyChoice
    from pytest_gradref.tolerances import DEFAULT_TOLERANCES, CheckPolicy, Tolerance
    from pytest_gradref.warning_types import (
        GoldenPrecisionWarning,
        GradrefWarning,
        ZeroGradientWarning,
    )

__all__ = [
    "DEFAULT_TOLERANCES",
    "UNCHECKED",
    "Backend",
    "BackendRegistry",
    "CheckPolicy",
    "Disagreement",
    "GoldenPrecisionWarning",
    "GradReference",
    "GradrefWarning",
    "RankContext",
    "RankGradReference",
    "Reference",
    "ShardedReference",
    "Strategy",
    "StrategyChoice",
    "Tolerance",
    "ZeroGradientWarning",
    "builtin_backend",
    "compute_reference",
]

# Where each public name lives.
_HOMES = {
    "DEFAULT_TOLERANCES": "tolerances",
    "UNCHECKED": "auxiliary",
    "Backend": "backends",
    "BackendRegistry": "backends",
    "CheckPolicy": "tolerances",
    "Disagreement": "recording",
    "GoldenPrecisionWarning": "warning_types",
    "GradReference": "fixture",
    "GradrefWarning": "warning_types",
    "RankContext": "ranks",
    "RankGradReference": "sharding",
    "Reference": "reference",
    "ShardedReference": "sharding",
    "Strategy": "strategies",
    "StrategyChoice": "strategies",
    "Tolerance": "tolerances",
    "ZeroGradientWarning": "warning_types",
    "builtin_backend": "backends",
    "compute_reference": "computation",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pytest_gradref.{home}"), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
