"""The systematic part of an error: its least-squares fit by a scale of the golden and a bias,
from sums the batched pass computes on the device (or, for an item outside it, read one by
one)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pytest_gradref.verdict.statistics import signed


@dataclass(frozen=True)
class SideFit:
    """One side's systematic error: a scale (relative), a bias (in the item's units), and
    the norm of the rest (its noise)."""

    scale: float
    bias: float
    residual: float


@dataclass(frozen=True)
class LeastSquares:
    """The least-squares fit of an error ``e`` by ``scale * golden + bias``, from sums: the
    part of an error that is correlated with the result (a scale) or the same everywhere (a
    bias), which rounding is not. ``n`` elements, the golden's sum and sum of squares
    (non-finite elements count as zeros). With the golden (nearly) constant the two cannot be
    told apart, and the fit is a scale alone. The standard errors are the fit's own, from what
    it leaves (the residual) as if every element erred independently and alike; elements that
    err together are what the rounding spread's runs are for (spread.py)."""

    n: float
    sum_g: float
    sum_gg: float

    @property
    def _det(self) -> float:
        return self.n * self.sum_gg - self.sum_g * self.sum_g

    @property
    def separable(self) -> bool:
        return self._det > 1e-9 * self.n * self.sum_gg

    def fit(self, sum_e: float, sum_eg: float, sum_ee: float) -> SideFit:
        if self.separable:
            scale = (self.n * sum_eg - self.sum_g * sum_e) / self._det
            bias = (self.sum_gg * sum_e - self.sum_g * sum_eg) / self._det
        else:
            scale = sum_eg / self.sum_gg if self.sum_gg > 0 else 0.0
            bias = 0.0
        residual = sum_ee - scale * sum_eg - bias * sum_e
        return SideFit(scale, bias, math.sqrt(max(residual, 0.0)))

    def standard_errors(self, residual_norm: float) -> tuple[float, float]:
        """The scale's and the bias's."""
        if self.separable:
            variance = residual_norm**2 / max(self.n - 2, 1)
            return math.sqrt(variance * self.n / self._det), math.sqrt(
                variance * self.sum_gg / self._det
            )
        if self.sum_gg <= 0:
            return 0.0, 0.0
        variance = residual_norm**2 / max(self.n - 1, 1)
        return math.sqrt(variance / self.sum_gg), 0.0


def host_fit(tensor: torch.Tensor, golden: torch.Tensor, design: LeastSquares) -> SideFit:
    """A side's least-squares fit, its sums read to the host one by one (an item outside the
    batched pass)."""
    g = golden.detach().to(torch.float64)
    error = signed(tensor.detach().to(device=g.device, dtype=torch.float64), g)
    finite = g.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    # Elementwise, not torch.dot: a tensor subclass need not implement it.
    sum_e, sum_eg, sum_ee = error.sum(), (error * finite).sum(), error.square().sum()
    return design.fit(float(sum_e), float(sum_eg), float(sum_ee))
