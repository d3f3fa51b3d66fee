"""pytest-gradref: reference gradients computed the way each device needs.

See the README for the fixtures, markers and options; this module re-exports the public API.
"""

from pytest_gradref.backends import Backend, BackendRegistry, Strategy, builtin_backend
from pytest_gradref.compare import DEFAULT_TOLERANCES, Tolerance
from pytest_gradref.reference import (
    Disagreement,
    GradReference,
    Reference,
    StrategyChoice,
    compute_reference,
)

__all__ = [
    "DEFAULT_TOLERANCES",
    "Backend",
    "BackendRegistry",
    "Disagreement",
    "GradReference",
    "Reference",
    "Strategy",
    "StrategyChoice",
    "Tolerance",
    "builtin_backend",
    "compute_reference",
]
