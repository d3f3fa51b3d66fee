"""Hypothesis examples: one test body run many times, each run one example.

A ``@given`` test that takes ``grad_reference`` calls it and ``assert_close`` once per
example; the report keeps one example's results (see ``recording.Recording``), so it needs to
know where an example ends. Hypothesis is never imported here: a test that runs examples has
imported it already.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def call_at_example_end(callback: Callable[[], Any]) -> bool:
    """Register ``callback`` to run when the current Hypothesis example ends, and say whether
    there is one (False outside ``@given``, or where Hypothesis is not loaded)."""
    control = sys.modules.get("hypothesis.control")
    if control is None or not control.currently_in_test_context():
        return False
    control.cleanup(callback)  # run by Hypothesis as the example's build context closes
    return True
