"""The rounded reference: the reference computed as if every step ran in the compute dtype.

A reference that upcasts inside (``.float()`` on bf16 inputs, a float32 softmax) is far more
accurate than the same computation carried out in bf16, so a budget counted from its error
alone fails a bf16 kernel that rounds like plain bf16 PyTorch. ``RoundToDtype`` is a
``TorchDispatchMode`` that rounds every floating-point result more precise than the compute
dtype to it (``x.to(compute).to(x.dtype)``), forward and backward: the reference's own
arithmetic, with the compute dtype's rounding after every operation.

``ResultMode`` is what it is built on: a dispatch mode that replaces each operation's floating
results while keeping their aliasing; the rounding spread's perturbation (spread.py) is the
other one.

Imported only where a rounded reference or a spread is asked for: it imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from pytest_gradref.reference.differentiation import Outputs


@dataclass(frozen=True)
class Rounded:
    """The reference computed with every floating-point result rounded to ``dtype``."""

    dtype: torch.dtype
    value: Outputs
    arg_grads: tuple[torch.Tensor, ...]
    param_grads: Mapping[str, torch.Tensor]
    aux: Any = None


# torch's dispatch-mode base class is untyped.
class ResultMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Replaces each operation's floating-point results by ``transform(func, args, kwargs,
    result)``.

    Results that alias an input keep their aliasing: an in-place or ``out=`` operation's
    written arguments are transformed in place, and a view (``view``, ``transpose``, ``split``,
    ``detach``) is left alone, since it shows a tensor that is either an input or was
    transformed when it was computed. Everything else is replaced by its transformed copy. The
    operations of the transform itself run with the mode off (a mode is popped inside its own
    handler). ``func``, ``args`` and ``kwargs`` are the operation's, ``position`` the index of
    the return the result is (0 for an argument written in place).
    """

    def transform(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        result: torch.Tensor,
        position: int,
    ) -> torch.Tensor:
        raise NotImplementedError

    def _map(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], value: Any, position: int
    ) -> Any:
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            return value
        return self.transform(func, args, kwargs, value, position)

    def _in_place(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], value: Any
    ) -> None:
        if isinstance(value, (list, tuple)):
            for tensor in value:
                self._in_place(func, args, kwargs, tensor)
            return
        changed = self._map(func, args, kwargs, value, 0)
        if changed is not value:
            value.copy_(changed)

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
                self._in_place(func, args, kwargs, written)
        returns = schema.returns
        if not returns:
            return out

        def fresh(value: Any, position: int) -> Any:
            return tree_map(lambda leaf: self._map(func, args, kwargs, leaf, position), value)

        if len(returns) == 1:
            return out if returns[0].alias_info is not None else fresh(out, 0)
        return type(out)(
            [
                result if ret.alias_info is not None else fresh(result, position)
                for position, (ret, result) in enumerate(zip(returns, out))
            ]
        )


class RoundToDtype(ResultMode):
    """Rounds each floating-point result more precise than ``dtype`` to ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dtype = dtype
        self._epsilon = torch.finfo(dtype).eps
        # Whether a dtype is rounded, by dtype: finfo costs more than a dictionary lookup.
        self._rounds: dict[torch.dtype, bool] = {}

    def transform(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        result: torch.Tensor,
        position: int,
    ) -> torch.Tensor:
        rounds = self._rounds.get(result.dtype)
        if rounds is None:
            rounds = self._rounds[result.dtype] = torch.finfo(result.dtype).eps < self._epsilon
        return result.to(self.dtype).to(result.dtype) if rounds else result
