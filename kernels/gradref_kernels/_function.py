"""The autograd Function of the fused loss: forward runs the chunk loop's operator, backward
scales its gradients by grad_output."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._forward import input_grad_is_mean
from ._ops import chunked_forward_op, scaled_cast_op
from ._options import LossOptions


class FusedLinearJSDFunction(torch.autograd.Function):
    """Forward computes the loss and the student gradients for grad_output = 1 (one pass of
    matmuls, as Liger-Kernel does); backward only scales them by grad_output."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        teacher_x: Tensor,
        teacher_weight: Tensor,
        labels: Tensor,
        bias: Tensor | None,
        teacher_bias: Tensor | None,
        options: LossOptions,
        chunk_size: int,
        implementation: str,
        grad_enabled: bool,
        return_soft_hard_loss: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        # needs_input_grad ignores torch.no_grad(), hence grad_enabled from the caller.
        need = [grad_enabled and flag for flag in ctx.needs_input_grad]
        compute_soft = (
            options.weight_soft != 0.0 or return_soft_hard_loss or not options.compute_hard
        )
        need_grads = (need[0], need[1], bias is not None and need[5])
        loss, soft, hard, inv_num_valid, grad_x, grad_weight, grad_bias = chunked_forward_op(
            x,
            weight,
            teacher_x,
            teacher_weight,
            labels,
            bias,
            teacher_bias,
            *options.as_op_args(),
            compute_soft,
            chunk_size,
            implementation,
            *need_grads,
        )
        ctx.save_for_backward(
            inv_num_valid,
            *(g if flag else None for g, flag in zip((grad_x, grad_weight, grad_bias), need_grads)),
        )
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.input_grad_is_mean = input_grad_is_mean(x.dtype)
        ctx.implementation = implementation
        ctx.mark_non_differentiable(soft, hard)
        return loss, soft, hard

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        inv_num_valid, *saved = ctx.saved_tensors
        # A 0-dim product on the device: no host sync, whatever grad_loss is (1, a loss
        # scale, the gradient flowing from a larger graph).
        scale = grad_loss * inv_num_valid
        # The input gradient of a mean loss needs grad_output alone (exact for 1 and for
        # power-of-two loss scales, in any dtype).
        scales = (grad_loss if ctx.input_grad_is_mean else scale, scale, scale)
        grads = [
            None if g is None else _scale_to(g, s, dtype, ctx.implementation)
            for g, s, dtype in zip(saved, scales, ctx.dtypes)
        ]
        return (grads[0], grads[1], None, None, None, grads[2]) + (None,) * 6


def _scale_to(grad: Tensor, scale: Tensor, dtype: torch.dtype, implementation: str) -> Tensor:
    """``grad * scale`` as ``dtype``: a float32 sum is scaled and rounded in one pass."""
    if grad.dtype != dtype or torch.compiler.is_compiling():
        # Compiled, every scaling stays inside the operator too: Inductor's CPU code for an
        # in-place multiply of the operator's outputs corrupted the heap (a float32 step,
        # torch 2.13) and, under ATEN_CPU_CAPABILITY=avx2, scaled every other 8 elements only.
        scaled: Tensor = scaled_cast_op(grad, scale.to(grad.dtype), dtype, implementation)
        return scaled
    # A multi-tensor kernel reads the 0-dim scale on the device once; ``grad * scale`` would
    # broadcast it through the generic mixed-dtype elementwise path, several times slower on
    # a bfloat16 gradient.
    return torch._foreach_mul([grad], scale)[0]
