"""The autograd Function of the fused loss: forward runs the chunk loop, backward scales its
gradients by grad_output."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._dispatch import ChunkKernel, ScaledCast
from ._forward import chunked_forward
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
        chunk_kernel: ChunkKernel,
        grad_enabled: bool,
        return_soft_hard_loss: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        # needs_input_grad ignores torch.no_grad(), hence grad_enabled from the caller.
        need = [grad_enabled and flag for flag in ctx.needs_input_grad]
        compute_soft = (
            options.weight_soft != 0.0 or return_soft_hard_loss or not options.compute_hard
        )
        result = chunked_forward(
            x,
            weight,
            teacher_x,
            teacher_weight,
            labels,
            bias,
            teacher_bias,
            options=options,
            chunk_size=chunk_size,
            chunk_kernel=chunk_kernel,
            compute_soft=compute_soft,
            need_grad_x=need[0],
            need_grad_weight=need[1],
            need_grad_bias=bias is not None and need[5],
        )
        ctx.save_for_backward(
            result.inv_num_valid, result.grad_x, result.grad_weight, result.grad_bias
        )
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.input_grad_is_mean = result.input_grad_is_mean
        ctx.scaled_cast = chunk_kernel.scaled_cast
        ctx.mark_non_differentiable(result.soft, result.hard)
        return result.loss, result.soft, result.hard

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
            None if g is None else _scale_to(g, s, dtype, ctx.scaled_cast)
            for g, s, dtype in zip(saved, scales, ctx.dtypes)
        ]
        return (grads[0], grads[1], None, None, None, grads[2]) + (None,) * 6


def _scale_to(grad: Tensor, scale: Tensor, dtype: torch.dtype, scaled_cast: ScaledCast) -> Tensor:
    """``grad * scale`` as ``dtype``: a float32 sum is scaled and rounded in one pass."""
    if grad.dtype != dtype:
        return scaled_cast(grad, scale.to(grad.dtype), dtype)
    # A multi-tensor kernel reads the 0-dim scale on the device once; ``grad * scale`` would
    # broadcast it through the generic mixed-dtype elementwise path, several times slower on
    # a bfloat16 gradient.
    return torch._foreach_mul([grad], scale)[0]
