"""The warnings pytest-gradref issues; filter them all with ``GradrefWarning``.

Like pytest's own ``warning_types``: a module of classes only, so that importing them costs
nothing (no torch).
"""

from __future__ import annotations


class GradrefWarning(UserWarning):
    """Base class of every warning pytest-gradref issues."""


class GoldenPrecisionWarning(GradrefWarning):
    """A golden reference came back less precise than requested: fn casts inside (e.g.
    ``.float()``), so budgets are measured against a golden of the dtype obtained."""
