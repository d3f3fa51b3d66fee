"""The one check of a number setting (tolerances, budgets, thresholds): a real number, not a
bool, at or above a bound.

It imports neither torch nor pytest, so the ``pytest-gradref`` command uses it too.
"""

from __future__ import annotations

import math
from typing import Any


def number_problem(value: Any, *, minimum: float, inclusive: bool = True) -> str | None:
    """What is wrong with ``value`` as such a number (``>= minimum``, or ``> minimum`` when
    not inclusive), e.g. "must be a number > 0"; None when nothing is."""
    fits = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and not math.isnan(value)
        and (value >= minimum if inclusive else value > minimum)
    )
    if fits:
        return None
    return f"must be a number {'>=' if inclusive else '>'} {minimum:g}"


def check_number(value: Any, name: str, *, minimum: float, inclusive: bool = True) -> float:
    """``value`` as a float; a ValueError that names ``name`` where it is no such number."""
    __tracebackhide__ = True  # a failure shows the caller's line
    problem = number_problem(value, minimum=minimum, inclusive=inclusive)
    if problem is not None:
        raise ValueError(f"{name} {problem}, got {value!r}")
    return float(value)
