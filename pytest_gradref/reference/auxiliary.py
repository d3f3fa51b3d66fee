"""Auxiliary outputs (``has_aux=True``): nested structures paired leaf by leaf.

An aux is any nesting of mappings, lists and tuples whose leaves are tensors, numbers or other
values. The actual aux and the reference's are walked together; each leaf gets a label in
Python's own indexing syntax (``aux['chosen_rewards']``, ``aux[2]``, ``aux['logps'][0]``), so a
failure names the item as a test would reach it. Where the two structures differ (a missing
key, a shorter tuple) the pair is a ``problem`` leaf, reported as a failed item beside the
others rather than stopping the comparison. ``aux_items`` turns the leaves into what compares
them, for ``Reference.assert_close`` and the crosscheck alike: an item where the reference's
leaf is a tensor or a number, else a verdict of its own (``AuxValue``).

``UNCHECKED`` is what a test passes as ``assert_close(aux=...)`` to leave a reference's aux
uncompared on purpose: leaving ``aux=`` out is an error, so that an aux is never skipped by
oversight.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import torch

from pytest_gradref.config.tolerances import AuxKey
from pytest_gradref.verdict.dtypes import is_inexact


class Unchecked(enum.Enum):
    """The type of ``UNCHECKED``: one member, so that it stays a singleton when copied or
    pickled (as a test's arguments are under xdist)."""

    UNCHECKED = "UNCHECKED"

    def __repr__(self) -> str:
        return "pytest_gradref.UNCHECKED"


# assert_close(aux=UNCHECKED): the reference's aux is deliberately not compared; the report
# records its items as unchecked.
UNCHECKED: Final = Unchecked.UNCHECKED


@dataclass(frozen=True)
class AuxLeaf:
    """One aux item: the actual and reference values at one place, and the golden's and the
    rounded reference's where there are such references (None where there are not)."""

    label: str
    # The top-level key or index it lies under (None for a bare, unnested aux).
    key: AuxKey | None
    actual: Any
    expected: Any
    golden: Any
    problem: str | None = None
    rounded: Any = None


def pair_aux(actual: Any, expected: Any, golden: Any, rounded: Any = None) -> list[AuxLeaf]:
    """Every leaf of the reference's aux with the actual's, the golden's and the rounded
    reference's at its place."""
    leaves: list[AuxLeaf] = []
    _walk("aux", None, actual, expected, golden, rounded, leaves)
    return leaves


def _child(container: Any, key: Any) -> Any:
    try:
        return container[key]
    except (KeyError, IndexError, TypeError):
        return None


def _walk(
    label: str,
    top: AuxKey | None,
    actual: Any,
    expected: Any,
    golden: Any,
    rounded: Any,
    out: list[AuxLeaf],
) -> None:
    def problem(text: str) -> None:
        out.append(AuxLeaf(label, top, actual, expected, golden, problem=text))

    if isinstance(expected, Mapping):
        if not isinstance(actual, Mapping):
            problem(f"the reference's is a mapping, the actual is a {type(actual).__name__}")
            return
        missing = [k for k in expected if k not in actual]
        extra = [k for k in actual if k not in expected]
        if missing or extra:
            problem(
                "keys differ: "
                + "; ".join(
                    f"{what} {', '.join(map(repr, keys))}"
                    for what, keys in (("the actual lacks", missing), ("it adds", extra))
                    if keys
                )
            )
        for key in expected:
            if key in actual:
                child_top = key if top is None else top
                _walk(
                    f"{label}[{key!r}]",
                    child_top,
                    actual[key],
                    expected[key],
                    _child(golden, key),
                    _child(rounded, key),
                    out,
                )
        return
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)):
            problem(
                f"the reference's is a {type(expected).__name__} of {len(expected)}, "
                f"the actual is a {type(actual).__name__}"
            )
            return
        if len(actual) != len(expected):
            problem(f"the actual has {len(actual)} elements, the reference's {len(expected)}")
            return
        for index, (a, e) in enumerate(zip(actual, expected)):
            child_top = index if top is None else top
            _walk(
                f"{label}[{index}]",
                child_top,
                a,
                e,
                _child(golden, index),
                _child(rounded, index),
                out,
            )
        return
    out.append(AuxLeaf(label, top, actual, expected, golden, rounded=rounded))


def leaf_tensor(value: Any, device: torch.device | None) -> torch.Tensor | None:
    """An aux leaf as a tensor: itself, or a Python number as a 0-dim tensor (a float as
    float64, its precision) on ``device``; None for anything else."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (bool, int, float, complex)):
        dtype = torch.float64 if isinstance(value, float) and not isinstance(value, bool) else None
        return torch.tensor(value, dtype=dtype, device=device)
    return None


@dataclass(frozen=True)
class AuxValue:
    """An aux leaf with no tensor to compare, and its verdict: where the two structures differ
    at its place (the leaf's ``problem``), or a reference leaf that is no tensor or number
    (a string, None), which the actual's must equal. ``detail`` says why it failed."""

    leaf: AuxLeaf
    passed: bool
    detail: str = ""


ItemT = TypeVar("ItemT")


def aux_items(
    leaves: Sequence[AuxLeaf],
    item: Callable[[AuxLeaf, Any, torch.Tensor, torch.Tensor | None, torch.Tensor | None], ItemT],
) -> list[ItemT | AuxValue]:
    """Each leaf as what compares it, in order: an ``AuxValue`` for a leaf with no tensor to
    compare; else the item ``item(leaf, actual, expected, golden, rounded)`` makes, where
    ``expected`` is the reference's leaf as a tensor, ``actual`` the actual's (a tensor or a
    number becomes a tensor on the expected's device; anything else is passed as it is, and
    the comparison fails it), and the golden's and the rounded reference's leaves are tensors
    where the expected is inexact (None otherwise)."""
    found: list[ItemT | AuxValue] = []
    for leaf in leaves:
        if leaf.problem is not None:
            found.append(AuxValue(leaf, passed=False, detail=leaf.problem))
            continue
        expected = leaf_tensor(leaf.expected, None)
        if expected is None:  # not numeric: equal or not
            equal = bool(leaf.actual == leaf.expected)
            detail = f"{leaf.actual!r} differs from the reference's {leaf.expected!r}"
            found.append(AuxValue(leaf, passed=equal, detail="" if equal else detail))
            continue
        actual = leaf_tensor(leaf.actual, expected.device)
        golden = rounded = None
        if is_inexact(expected.dtype):
            golden = leaf_tensor(leaf.golden, None)
            rounded = leaf_tensor(leaf.rounded, None)
        given = leaf.actual if actual is None else actual
        found.append(item(leaf, given, expected, golden, rounded))
    return found
