"""The warnings pytest-gradref issues; filter them all with ``GradrefWarning``.

Like pytest's own ``warning_types``: the classes, and ``user_stacklevel`` that points a warning
at the user's line; importing it costs nothing (no torch).
"""

from __future__ import annotations

import sys

# The plugin's own modules: pytest_gradref and pytest_gradref.<module>.
_PACKAGE = __name__.rpartition(".")[0]


class GradrefWarning(UserWarning):
    """Base class of every warning pytest-gradref issues."""


class GoldenPrecisionWarning(GradrefWarning):
    """A golden reference came back less precise than requested: fn casts inside (e.g.
    ``.float()``), so budgets are measured against a golden of the dtype obtained."""


class ZeroGradientWarning(GradrefWarning):
    """A reference's gradient is zero everywhere (its golden's too, where there is one): the
    reference function does not use that input differentiably (an argmax, a comparison,
    ``.detach()``, ``.item()`` or an integer cast on its path), so a kernel's gradient is
    checked against zeros."""


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by the caller of this function that
    attributes the warning to the first frame outside pytest_gradref: the test's line that
    called the plugin, however many of the plugin's frames lie between."""
    level = 1
    frame = sys._getframe(1)  # the function that warns: stacklevel 1
    while frame.f_back is not None and _in_package(frame.f_globals.get("__name__")):
        frame = frame.f_back
        level += 1
    return level


def _in_package(module: object) -> bool:
    return isinstance(module, str) and (module == _PACKAGE or module.startswith(_PACKAGE + "."))
