"""Every planted regression of benchmarks/_mutations.py still applies to the code it rewrites.

A mutation rewrites a kernel function's source text (``_rewrite``) or wraps a function; when
the kernel is refactored, its target may move, and the mutation then fails to apply. CI's
precision-mutation stage would say so minutes later; this says so in the test command."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _mutations


@pytest.mark.parametrize("name", sorted(_mutations.MUTATIONS))
def test_the_mutation_applies(name: str) -> None:
    mutation = _mutations.MUTATIONS[name][0]
    with pytest.MonkeyPatch.context() as monkeypatch:
        mutation(monkeypatch)  # raises where a rewritten text is not found exactly as expected
