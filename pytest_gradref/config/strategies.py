"""The names of the gradient strategies (no torch, nothing else imported)."""

from __future__ import annotations

from typing import Literal

# How reference gradients are computed: what a backend may choose as its default.
Strategy = Literal["autograd", "grad_and_value"]
STRATEGIES: tuple[Strategy, ...] = ("autograd", "grad_and_value")

# What a run or a test may ask for: a strategy, or crosscheck (both, compared).
StrategyChoice = Literal["autograd", "grad_and_value", "crosscheck"]
STRATEGY_CHOICES: tuple[StrategyChoice, ...] = ("autograd", "grad_and_value", "crosscheck")
