"""Differences between tensors in float64, as every kind of item measures them: which tensors
the batched pass can read in bulk, the signed and absolute differences (equal infinities
differ by 0, as in torch.testing), the statistics an item outside that pass reads one by one,
and where the worst element is."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import methodcaller
from typing import Any

import torch


def batchable(*tensors: torch.Tensor, on: torch.device) -> bool:
    """Real floating strided plain tensors, compared in float64 on ``on`` (where they are, for
    a tolerance; where the golden is, for a budget).

    A tensor subclass (DTensor, a wrapper subclass with ``__torch_dispatch__``) cannot be read
    in bulk (``tolist`` refuses it, and its statistics are subclass tensors too): its items
    are checked alone, with operations and scalar reads that go through the subclass, as
    torch.testing's do. ``type(t)`` rather than isinstance, since every subclass is an
    instance of torch.Tensor; a plain nn.Parameter is a plain tensor.
    """
    plain = (torch.Tensor, torch.nn.Parameter)
    return on.type != "mps" and all(
        type(t) in plain
        and t.is_floating_point()
        and t.dtype.itemsize > 1
        and t.layout == torch.strided
        for t in tensors
    )


def stacked(tensors: Sequence[torch.Tensor], golden: torch.Tensor) -> torch.Tensor:
    """The tensors (each of the golden's shape) stacked into one float64 tensor where the
    golden is."""
    first = tensors[0]
    if all(t.dtype == first.dtype and t.device == golden.device for t in tensors):
        return torch.stack([t.detach() for t in tensors]).to(torch.float64)
    return torch.stack([t.detach().to(device=golden.device, dtype=torch.float64) for t in tensors])


def signed(actual: torch.Tensor, golden: torch.Tensor) -> torch.Tensor:
    """actual - golden (float64 tensors on one device, broadcast), 0 where the two are equal
    (infinities of one sign too, as torch.testing has them), NaN where either is NaN."""
    return torch.where(actual == golden, 0.0, actual - golden)


def difference(actual: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """|actual - expected| and |expected|, in float64 on expected's device. Equal elements
    differ by 0, infinities of the same sign included (as torch.testing treats them), where
    the subtraction would give NaN."""
    a = actual.detach().to(device=expected.device, dtype=torch.float64)
    e = expected.detach().to(torch.float64)
    diff = torch.where(a == e, 0.0, a - e).abs_()
    return diff, e.abs()  # new tensors: the callers may change them in place


def finite(magnitude: torch.Tensor) -> torch.Tensor:
    """Magnitudes with NaN and infinities as 0: the scale of what the item can be measured
    by (an infinity matched exactly is no error, and it sets no scale)."""
    return magnitude.nan_to_num(nan=0.0, posinf=0.0)


def ratio(error: float, magnitude: float) -> float:
    """A relative error: 0 for no error (even of a zero), inf for an error of a zero."""
    if error == 0:
        return 0.0
    return error / magnitude if magnitude > 0 else math.inf


def divide(a: float, b: float) -> float:
    """a / b for magnitudes as float64 tensors divide them (inf for a nonzero a over 0, NaN
    for 0 / 0)."""
    if b == 0:
        return math.nan if a == 0 or math.isnan(a) else math.inf
    return a / b


def nan_max(a: float, b: float) -> float:
    """The larger of two numbers, NaN where either is (as torch.maximum)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


@dataclass(frozen=True)
class HostStats:
    """An item's differences read to the host one statistic at a time."""

    max_abs: float
    max_rel: float
    used: float  # greatest share of the tolerance used by one element (0 without one)
    norm: float  # ||actual - expected||
    magnitude_norm: float  # ||expected||, finite elements
    scale: float  # max|expected|, finite elements


def host_stats(
    actual: torch.Tensor,
    expected: torch.Tensor,
    rtol: float | None = None,
    atol: float = 0.0,
) -> HostStats:
    """Greatest absolute and relative difference and the norms, computed in float64 on
    expected's device, and with a tolerance (``rtol``, ``atol``) the greatest
    |a - e| / (atol + rtol * |e|); with host reads, for the items the batched pass leaves
    out."""
    diff, magnitude = difference(actual, expected)
    if diff.numel() == 0:
        return HostStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    zero = torch.zeros_like(diff)
    relative = torch.where(diff == 0, zero, diff / magnitude)
    used = 0.0
    if rtol is not None:
        allowed = atol + rtol * magnitude
        used = float(torch.where(diff == 0, zero, diff / allowed).max())
    # A mask, not boolean indexing: a sharded DTensor cannot index by a data-dependent shape.
    finite_magnitude = torch.where(magnitude.isfinite(), magnitude, zero)
    return HostStats(
        float(diff.max()),
        float(relative.max()),
        used,
        float(diff.norm()),
        float(finite_magnitude.norm()),
        float(finite_magnitude.max()),
    )


def worst_index(actual: torch.Tensor, expected: torch.Tensor) -> str:
    """Where |actual - expected| is greatest (NaN counting as greatest), for a failure message;
    a tensor subclass that cannot locate it (torch 2.6's DTensor has no argmax) says so."""
    diff, _ = difference(actual, expected)
    try:
        flat = int(diff.nan_to_num(nan=float("inf")).argmax())
    except (NotImplementedError, RuntimeError) as error:
        return f"(not located: {type(diff).__name__} {str(error).splitlines()[0]})"
    return str(tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)))


def whole_where_mixed(tensors: Mapping[str, torch.Tensor | None]) -> dict[str, Any]:
    """Of an item's tensors by name, each distributed one (a DTensor: one with
    ``full_tensor``) made whole where the item mixes it with plain tensors, which DTensor's
    operators and torch.testing refuse; empty where none needs it. The shapes agree already (a
    DTensor's shape is the whole tensor's), so the plain side is the whole tensor, not a
    shard; where every side is distributed, each stays as it is. On a mesh of several ranks
    this gathers, as full_tensor always does."""
    distributed = {name for name, t in tensors.items() if hasattr(t, "full_tensor")}
    if not distributed or len(distributed) == len(tensors):
        return {}
    whole = methodcaller("full_tensor")  # DTensor's, unknown to torch.Tensor's type
    return {name: whole(tensors[name]) for name in distributed}
