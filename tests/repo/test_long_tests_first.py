"""The repository's conftest.py hands the tests marked ``long`` out first: their own order, and
the others', stay as collected (pytest-randomly's shuffle)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TESTS = """
import pytest


def test_short_1():
    pass


@pytest.mark.long
def test_long_1():
    pass


def test_short_2():
    pass


@pytest.mark.long
@pytest.mark.parametrize("n", [1, 2])
def test_long_2(n):
    pass
"""


LONG = ["test_long_1", "test_long_2[1]", "test_long_2[2]"]
SHORT = ["test_short_1", "test_short_2"]


def _collected(pytester: pytest.Pytester, *args: str) -> list[str]:
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    long: seconds\n")
    pytester.makepyfile(test_order=TESTS)
    result = pytester.runpytest_inprocess("--collect-only", "-q", *args)
    return [line.split("::")[1] for line in result.outlines if "::" in line]


def test_the_long_tests_come_first_in_collection_order(pytester: pytest.Pytester) -> None:
    assert _collected(pytester, "-p", "no:randomly") == LONG + SHORT


@pytest.mark.parametrize("seed", range(4))
def test_the_long_tests_come_first_in_a_shuffled_order(
    pytester: pytest.Pytester, seed: int
) -> None:
    names = _collected(pytester, f"--randomly-seed={seed}")
    assert sorted(names[: len(LONG)]) == LONG
    assert sorted(names[len(LONG) :]) == SHORT
