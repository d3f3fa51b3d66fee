"""The rounded reference: the reference computed as if every step ran in the compute dtype.

A reference that upcasts inside (``.float()`` on bf16 inputs, a float32 softmax) is far more
accurate than the same computation carried out in bf16, so a budget counted from its error
alone fails a bf16 kernel that rounds like plain bf16 PyTorch. ``RoundToDtype`` is a
``TorchDispatchMode`` that rounds every floating-point result more precise than the compute
dtype to it (``x.to(compute).to(x.dtype)``), forward and backward: the reference's own
arithmetic, with the compute dtype's rounding after every operation.

Imported only where a rounded reference is asked for: it imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map


@dataclass(frozen=True)
class Rounded:
    """The reference computed with every floating-point result rounded to ``dtype``."""

    dtype: torch.dtype
    value: torch.Tensor
    arg_grads: tuple[torch.Tensor, ...]
    param_grads: Mapping[str, torch.Tensor]
    aux: Any = None


# torch's dispatch-mode base class is untyped.
class RoundToDtype(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Rounds each floating-point result more precise than ``dtype`` to ``dtype``.

    Results that alias an input keep their aliasing: an in-place or ``out=`` operation's
    written arguments are rounded in place, and a view (``view``, ``transpose``, ``split``,
    ``detach``) is left alone, since it shows a tensor that is either an input or was rounded
    when it was computed. Everything else is replaced by its rounded copy. The operations of
    the rounding itself run with the mode off (a mode is popped inside its own handler).
    """

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dtype = dtype
        self._epsilon = torch.finfo(dtype).eps
        # Whether a dtype is rounded, by dtype: finfo costs more than a dictionary lookup.
        self._rounds: dict[torch.dtype, bool] = {}

    def _round(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return value
        rounds = self._rounds.get(value.dtype)
        if rounds is None:
            rounds = self._rounds[value.dtype] = torch.finfo(value.dtype).eps < self._epsilon
        return value.to(self.dtype).to(value.dtype) if rounds else value

    def _round_in_place(self, value: Any) -> None:
        if isinstance(value, (list, tuple)):
            for tensor in value:
                self._round_in_place(tensor)
            return
        rounded = self._round(value)
        if rounded is not value:
            value.copy_(rounded)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        for position, argument in enumerate(schema.arguments):
            alias = argument.alias_info
            if alias is not None and alias.is_write:  # in place, out=, _foreach_*_
                written = args[position] if position < len(args) else kwargs.get(argument.name)
                self._round_in_place(written)
        returns = schema.returns
        if not returns:
            return out
        if len(returns) == 1:
            return out if returns[0].alias_info is not None else tree_map(self._round, out)
        return type(out)(
            [
                result if ret.alias_info is not None else tree_map(self._round, result)
                for ret, result in zip(returns, out)
            ]
        )
