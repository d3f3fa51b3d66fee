"""pytest-gradref: reference gradients computed the way each device needs.

See the README for the fixtures, markers and options; this module re-exports the public API.
The names load on first access, so that pytest loading the plugin (which imports this package
first) does not pay for the reference and comparison modules.

The face (this module, ``plugin``, ``hookspecs``, ``warning_types``, ``__main__``) sits over
six wings, one subpackage per concern. Imports at load run one way between them, in this
order: ``config``, ``devices``, ``verdict``, ``reference``, ``report``, ``ranks``; a wing
imports only the wings before it (and ``warning_types``, a leaf), and no package module
imports another in a circle (``tests/repo/test_layout.py`` holds both).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_gradref.config.strategies import Strategy, StrategyChoice
    from pytest_gradref.config.tolerances import (
        DEFAULT_TOLERANCES,
        AuxKey,
        CheckPolicy,
        Tolerance,
    )
    from pytest_gradref.devices.backends import Backend, BackendRegistry, builtin_backend
    from pytest_gradref.ranks.sharding import RankGradReference, ShardedReference, ShardSpec
    from pytest_gradref.ranks.worker import RankContext
    from pytest_gradref.reference.auxiliary import UNCHECKED
    from pytest_gradref.reference.computation import compute_reference
    from pytest_gradref.reference.golden import Golden
    from pytest_gradref.reference.grad_reference import GradReference
    from pytest_gradref.reference.recording import Disagreement
    from pytest_gradref.reference.result import Reference
    from pytest_gradref.reference.rounding import Rounded
    from pytest_gradref.warning_types import (
        GoldenPrecisionWarning,
        GradrefWarning,
        ZeroGradientWarning,
    )

__all__ = [
    "DEFAULT_TOLERANCES",
    "UNCHECKED",
    "AuxKey",
    "Backend",
    "BackendRegistry",
    "CheckPolicy",
    "Disagreement",
    "Golden",
    "GoldenPrecisionWarning",
    "GradReference",
    "GradrefWarning",
    "RankContext",
    "RankGradReference",
    "Reference",
    "Rounded",
    "ShardSpec",
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
    "DEFAULT_TOLERANCES": "config.tolerances",
    "UNCHECKED": "reference.auxiliary",
    "AuxKey": "config.tolerances",
    "Backend": "devices.backends",
    "BackendRegistry": "devices.backends",
    "CheckPolicy": "config.tolerances",
    "Disagreement": "reference.recording",
    "Golden": "reference.golden",
    "GoldenPrecisionWarning": "warning_types",
    "GradReference": "reference.grad_reference",
    "GradrefWarning": "warning_types",
    "RankContext": "ranks.worker",
    "RankGradReference": "ranks.sharding",
    "Reference": "reference.result",
    "Rounded": "reference.rounding",
    "ShardSpec": "ranks.sharding",
    "ShardedReference": "ranks.sharding",
    "Strategy": "config.strategies",
    "StrategyChoice": "config.strategies",
    "Tolerance": "config.tolerances",
    "ZeroGradientWarning": "warning_types",
    "builtin_backend": "devices.backends",
    "compute_reference": "reference.computation",
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
