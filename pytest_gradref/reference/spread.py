"""The rounding spread: how far correct computations of the reference stray from the golden,
estimated from a few randomly rounded runs of the reference.

One draw of the reference's rounding error is no bound on another's: a kernel that sums in
another order draws its own, and the ratio of the two is unbounded where the item cancels (a
sum of large terms near zero, a gradient entry that cancels over many rows) or where rounding
errors move together (the logits' rounding, spread over a whole weight gradient). So where an
item fails its budget, the verdict asks how large a correct computation's error of that item
is. It runs the reference ``RUNS`` times under ``RandomRounding``: Monte Carlo arithmetic at
the reference's own precisions. Every operation's floating result is rounded once more,
stochastically (up or down, with the probability of its distance to each), in its own dtype,
so each run rounds where the reference rounds, in the dtypes it rounds in (bf16 where it
computes in bf16, float32 where it upcasts), by a fresh draw. An operation that sums terms
(``sum``, ``mean``, the matrix products, ``cumsum``, convolutions, ``nll_loss``) also gets the
error of one rounding in its accumulation dtype (float32 for half precision, as torch
accumulates) at the size of its terms, their magnitudes summed (for a matrix product bounded
by the norms of the row and the column: no second product): the first-order term of a sum's
error bound, which another order or blocking of the sum may reach. Operations that
only create, copy or select values are exact and left alone. Each run's error against the
golden is a draw of a correct computation's error, of the item as of every other; their
spread is what the verdict (verdict/budget_item.py) lets an item's error reach.

The runs are seeded (run 0, 1, ...), so a verdict is reproducible and the test's own random
state is untouched; they run only where an item fails without them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from pytest_gradref.reference.differentiation import Problem, Result
from pytest_gradref.reference.rounding import ResultMode

# How many randomly rounded runs estimate the spread: with 16, an allowance of 10 coefficients of
# variation (budget_criteria.spread_factor) lets a correct scalar through at a rate under 1e-5.
RUNS = 16

_aten = torch.ops.aten
# The matrix products, whose half-precision result a run need not compute: it rounds their
# float32 product, and torch multiplies half-precision matrices in a scalar loop on CPUs without
# oneDNN kernels for them (x86 before AVX-512), hundreds of times slower than in float32.
_PRODUCTS = frozenset(
    {
        _aten.mm,
        _aten.bmm,
        _aten.mv,
        _aten.dot,
        _aten.addmm,
        _aten.addmv,
        _aten.baddbmm,
        _aten.addbmm,
    }
)
# The operations whose result sums terms, with the operation that sums their magnitudes:
# the same operation on the absolute values of its inputs, except nll_loss, whose terms are
# the negated log-probabilities it picks, and the products, whose sum is bounded instead.
_SUMS = _PRODUCTS | {_aten.sum, _aten.mean, _aten.cumsum, _aten.convolution}
# What an operation raises where a tensor (a subclass's layout) cannot take a step of the
# rounding: the step is skipped, never the test.
_CANNOT = (RuntimeError, TypeError, NotImplementedError)
# The operations whose result is exact, since it creates a constant or copies, selects or
# moves values without arithmetic: a correct computation rounds none of them (the seed of a
# backward pass, ones_like, rounded at random would scale every gradient by the same factor).
# (A cast that rounds is no such copy: it is rounded as every other result.)
_EXACT = frozenset(
    getattr(_aten, name)
    for name in (
        "_unsafe_view",
        "abs",
        "amax",
        "amin",
        "cat",
        "clamp",
        "clamp_max",
        "clamp_min",
        "clone",
        "constant_pad_nd",
        "copy",
        "copy_",
        "embedding",
        "empty",
        "empty_like",
        "empty_strided",
        "fill",
        "fill_",
        "flip",
        "full",
        "full_like",
        "gather",
        "index",
        "index_put",
        "index_put_",
        "index_select",
        "lift_fresh",
        "lift_fresh_copy",
        "masked_fill",
        "masked_fill_",
        "max",
        "maximum",
        "min",
        "minimum",
        "neg",
        "new_empty",
        "new_empty_strided",
        "new_full",
        "new_ones",
        "new_zeros",
        "ones",
        "ones_like",
        "relu",
        "repeat",
        "roll",
        "scalar_tensor",
        "scatter",
        "select_backward",
        "slice_backward",
        "sort",
        "stack",
        "threshold_backward",
        "topk",
        "tril",
        "triu",
        "where",
        "zero_",
        "zeros",
        "zeros_like",
    )
    if hasattr(_aten, name)
)


def _magnitude(value: Any) -> Any:
    """An operation's argument for the sum of its terms' magnitudes: floating tensors and
    factors (addmm's alpha and beta) as their absolute values; integers (dimensions) as
    they are."""
    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
        return value.abs()
    if isinstance(value, float):
        return abs(value)
    return value


def _writes(func: Any) -> bool:
    """Whether the operation writes an argument in place (whose input is gone after it)."""
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


# Each working dtype's integer view and exponent bits: masked, they leave 2**floor(log2|x|)
# (0 for 0).
_EXPONENT_BITS = {
    torch.float32: (torch.int32, 0x7F800000),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}


def _digits(dtype: torch.dtype) -> int:
    """The significand's bits, the implicit one included (bf16 8, fp16 11, float32 24)."""
    return round(-math.log2(torch.finfo(dtype).eps)) + 1


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where torch accumulates a sum of ``dtype``: float32 for half precision."""
    return torch.float32 if torch.finfo(dtype).eps > torch.finfo(torch.float32).eps else dtype


def _row_norms(matrix: torch.Tensor, dim: int) -> torch.Tensor:
    norms: torch.Tensor = torch.linalg.vector_norm(matrix.detach().float(), dim=dim)
    return norms


def _product_terms(packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """For a matrix product, a bound of the sum of its terms' magnitudes at each output:
    the norms of the row and the column it multiplies (Cauchy-Schwarz), an outer product of
    two vectors instead of a second product; plus the added input's magnitude (addmm's
    ``beta * input``). None for an operation that is no matrix product."""
    beta = abs(kwargs.get("beta", 1))
    alpha = abs(kwargs.get("alpha", 1))
    if packet is _aten.mm:
        a, b = args[:2]
        return _row_norms(a, 1)[:, None] * _row_norms(b, 0)[None, :]
    if packet is _aten.bmm:
        a, b = args[:2]
        return _row_norms(a, 2)[..., None] * _row_norms(b, 1)[:, None, :]
    if packet is _aten.mv:
        a, v = args[:2]
        return _row_norms(a, 1) * _row_norms(v, 0)
    if packet is _aten.dot:
        a, b = args[:2]
        return _row_norms(a, 0) * _row_norms(b, 0)
    if packet in (_aten.addmm, _aten.baddbmm, _aten.addmv, _aten.addbmm):
        added, a, b = args[:3]
        if packet is _aten.addmm:
            products = _row_norms(a, 1)[:, None] * _row_norms(b, 0)[None, :]
        elif packet is _aten.addmv:
            products = _row_norms(a, 1) * _row_norms(b, 0)
        else:
            products = _row_norms(a, 2)[..., None] * _row_norms(b, 1)[:, None, :]
            if packet is _aten.addbmm:
                products = products.sum(0)
        return beta * added.detach().float().abs() + alpha * products
    return None


def _in_float32(value: Any) -> Any:
    """An operation's argument for its computation before rounding to half precision:
    floating tensors and dtypes as float32 (where torch computes half precision anyway)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(torch.float32)
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.float32
    return value


class RandomRounding(ResultMode):
    """Rounds each floating result less precise than float64 at random in its dtype. A half
    precision result is computed again in float32 and rounded stochastically (up or down,
    with the probability of its distance to each); a float32 one, which a float64 computation
    would cost too much to redo, gets the error of one more rounding (uniform within the unit
    roundoff) before it is rounded to nearest again. An operation that sums terms also gets,
    before the rounding, the error of one rounding in its accumulation dtype at its terms'
    magnitudes. The noise is drawn from generators seeded with ``seed``. Either way a run's
    error is a fresh draw, which is the reference's own rounding at most twice over in
    variance: the verdict divides the runs' rms by sqrt(2) (compare.spread_factor). With
    ``dtype`` (a rounded reference's compute dtype), each result is rounded to that dtype where
    it is less precise than the result's own, as the rounded reference rounds it
    (rounding.py), and kept in its own."""

    def __init__(self, seed: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seed = seed
        self.dtype = dtype
        self._generators: dict[torch.device, torch.Generator] = {}

    def _uniform(self, like: torch.Tensor) -> torch.Tensor:
        """Uniform noise in (-1, 1) shaped and placed as ``like``, from this run's generator
        on its device, or drawn on the CPU and moved where the device has none.

        Four numbers come from each 64-bit draw: its 16-bit lanes, less their top bit, are
        2**15 evenly spaced values, symmetric about 0. A uniform_ draw per number took twice
        as long on the CPU (benchmarks/results/cpu/rounding_spread.txt), and it was most of a
        spread's time; a dither of 2**-15 steps sets a half-precision result's chance to
        round up to within 2**-15 of its distance, far below what 16 runs resolve. An
        accelerator's uniform_ is one kernel against the lanes' five, so it draws there
        (benchmarks/results/h100/rounding_spread.txt), as does a tensor subclass on a device
        with a generator (a DTensor), in its own layout."""
        generator = self._generator(like.device)
        drawn_in_place = like.device.type != "cpu" or type(like) is not torch.Tensor
        if generator.device == like.device and drawn_in_place:
            return torch.empty_like(like).uniform_(-1, 1, generator=generator)
        count = like.numel()
        words = torch.empty((count + 3) // 4, dtype=torch.int64, device=generator.device)
        lanes = words.random_(generator=generator).view(torch.int16)[:count] & 0x7FFF
        noise = lanes.to(like.dtype).mul_(2.0**-14).sub_(1.0 - 2.0**-15)
        return noise.reshape(like.shape).to(like.device)

    def _generator(self, device: torch.device) -> torch.Generator:
        """This run's generator for ``device``: its own, or the CPU's where it has none."""
        generator = self._generators.get(device)
        if generator is None:
            try:
                generator = torch.Generator(device=device)
            except RuntimeError:
                generator = self._generators.get(torch.device("cpu")) or torch.Generator()
            if generator.device not in self._generators:
                generator.manual_seed(self.seed)
                self._generators[generator.device] = generator
            self._generators[device] = generator
        return generator

    def _product_of_half(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> torch.dtype | None:
        """The half-precision dtype of a matrix product of tensors in that dtype whose result
        this run rounds in it, or None: such a result is rounded from its float32
        product alone (``_rounded``), so the product in half precision need not run."""
        if func.overloadpacket not in _PRODUCTS or func._overloadname != "default":
            return None  # out= and out_dtype= overloads go the general way
        dtypes = {
            leaf.dtype for leaf in [*args, *kwargs.values()] if isinstance(leaf, torch.Tensor)
        }
        if len(dtypes) != 1:
            return None
        (dtype,) = dtypes
        if not dtype.is_floating_point or torch.finfo(dtype).eps <= torch.finfo(torch.float32).eps:
            return None
        if self.dtype is not None and torch.finfo(self.dtype).eps > torch.finfo(dtype).eps:
            return None  # a rounded reference's coarser dtype rounds the half result itself
        return dtype

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        dtype = self._product_of_half(func, args, kwargs)
        if dtype is not None:
            try:
                exact = func(*tree_map(_in_float32, args), **tree_map(_in_float32, kwargs))
            except _CANNOT:
                exact = None  # computed in its dtype and rounded as it is, the general way
            if exact is not None:
                try:
                    # The float32 product rounded to nearest stands in for the half result only
                    # as its dtype and shape: _rounded rounds ``exact``, as the general way does.
                    return self._rounded(func, args, kwargs, exact.to(dtype), 0, exact)
                except _CANNOT:
                    # A subclass that cannot draw noise of its layout: its result is kept, as
                    # transform keeps it.
                    return func(*args, **kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _terms(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The sum of the terms' magnitudes at each output of an operation that sums terms
        (a bound of it for a matrix product), or None."""
        packet = func.overloadpacket
        if packet is _aten.nll_loss_forward:
            return func(-args[0].abs(), *args[1:], **kwargs)[0]
        if packet in (_aten.sum, _aten.mean, _aten.cumsum, _aten.convolution):
            return func(*tree_map(_magnitude, args), **tree_map(_magnitude, kwargs))
        return _product_terms(packet, args, kwargs)

    def transform(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        result: torch.Tensor,
        position: int,
    ) -> torch.Tensor:
        try:
            return self._rounded(func, args, kwargs, result, position)
        except _CANNOT:
            # A tensor subclass that cannot draw noise of its own layout (a sharded DTensor's
            # uniform_): its result is kept, and the spread counts the rounding of the rest.
            return result

    def _rounded(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        result: torch.Tensor,
        position: int,
        exact: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``result`` rounded at random; ``exact`` is its half-precision operation's float32
        result where the caller has it (a matrix product's, which is then not recomputed)."""
        packet = func.overloadpacket
        target = result.dtype
        if self.dtype is not None and torch.finfo(self.dtype).eps > torch.finfo(target).eps:
            target = self.dtype
        exempt = result.numel() == 0 or target == torch.float64 or packet in _EXACT
        if exempt or result.is_complex():
            return result
        half = torch.finfo(target).eps > torch.finfo(torch.float32).eps
        # The noise is worked in float32 unless the result is float64 (a rounded reference's
        # float64 step): float32 carries it, and the value it perturbs, with 2**-24 of their
        # size, a step of the target's rounding 2**-16 (bf16) or 2**-13 (fp16) of one, or,
        # for a float32 target, one rounding of the perturbed value to nearest, which is the
        # one the noise models; half the memory traffic of float64 and a cheaper draw.
        work = torch.float64 if result.dtype == torch.float64 else torch.float32
        value = (result if exact is None else exact).to(work)
        if exact is None and half and target == result.dtype and not _writes(func):
            try:  # the result before its rounding: the operation in float32
                found = func(*tree_map(_in_float32, args), **tree_map(_in_float32, kwargs))
                exact = found[position] if isinstance(found, (tuple, list)) else found
                value = exact.to(work)
            except _CANNOT:
                pass  # rounded again as it is
        # The error of the accumulation's rounding, for an operation that sums terms.
        accumulated: torch.Tensor | None = None
        if position == 0 and (packet in _SUMS or packet is _aten.nll_loss_forward):
            terms = self._terms(func, args, kwargs)
            if terms is not None:
                unit = torch.finfo(accumulation_dtype(target)).eps / 2
                magnitudes = terms.to(value).abs()
                accumulated = self._uniform(value).mul_(magnitudes).mul_(unit)
        if not half:  # one more rounding's error, then (once, with the accumulation's) nearest
            unit = torch.finfo(target).eps / 2
            if accumulated is None:
                noisy = torch.addcmul(value, self._uniform(value), value.abs(), value=unit)
            else:
                error = torch.addcmul(accumulated, self._uniform(value), value.abs(), value=unit)
                noisy = value + error
            return noisy.to(target).to(result.dtype)
        if accumulated is not None:
            value = value + accumulated
        # Stochastic rounding: dithered by up to half a step of the target dtype at each
        # element's magnitude, then rounded to nearest. |x| in [2**k, 2**(k+1)) has a step of
        # 2**(k + 1 - digits); 2**k is x's exponent bits alone (0 for a zero, which is exact
        # and stays so, and for a float32 subnormal, far below any step of interest).
        bits, exponent = _EXPONENT_BITS[work]
        power = (value.view(bits) & exponent).view(work)
        half_step = power * 2.0 ** -_digits(target)
        dithered = torch.addcmul(value, self._uniform(value), half_step)
        return dithered.to(target).to(result.dtype)


def _whole(result: Result) -> Result:
    return result


@dataclass
class Spread:
    """The reference problem's randomly rounded runs, computed once, on first demand.

    ``problem`` is the reference's problem, in its own dtypes; ``strategy`` its strategy;
    ``rounded_to`` the compute dtype of a rounded reference (``rounded=True``), whose every
    step the runs round in that dtype; ``select`` what a test compares of a run (a rank's
    slice of each gradient, sharding.py).
    """

    problem: Problem
    strategy: Callable[[Problem], Result]
    rounded_to: torch.dtype | None = None
    select: Callable[[Result], Result] = _whole
    _runs: list[Result] = field(default_factory=list, repr=False)

    @property
    def ran(self) -> bool:
        """Whether the runs were made (an item asked for them)."""
        return bool(self._runs)

    def results(self) -> tuple[Result, ...]:
        if not self._runs:
            self._runs.extend(
                self.strategy(
                    replace(self.problem, mode=partial(RandomRounding, run, self.rounded_to))
                )
                for run in range(RUNS)
            )
        return tuple(self.select(run) for run in self._runs)
