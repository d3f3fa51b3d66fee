"""The forward pass of the fused loss: the loop over chunks of rows, which computes the losses and
the student's gradients together."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import _chunk_torch
from ._dispatch import ChunkKernel
from ._matmuls import MeanScale, accumulate_product_, compute_logits, input_gradient_, packed_over
from ._options import LossOptions


@dataclass
class ForwardResult:
    """What the forward pass produces: the losses, and the gradients. The weight and bias
    gradients are those of the summed loss (grad_output = num_valid), which backward scales by
    ``inv_num_valid * grad_output``; so is the input gradient where :func:`input_grad_is_mean`
    says no (float16 inputs, in a float32 buffer), else it is that of the mean loss already."""

    loss: Tensor
    soft: Tensor
    hard: Tensor
    inv_num_valid: Tensor
    grad_x: Tensor | None
    grad_weight: Tensor | None
    grad_bias: Tensor | None


def input_grad_is_mean(dtype: torch.dtype) -> bool:
    """Whether the forward pass's input gradient is that of the mean loss, rounded to the input
    dtype, rather than a float32 sum waiting for backward's scaling (float16, whose range
    cannot hold the per-row gradients of a mean over many rows)."""
    return dtype != torch.float16


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the forward pass computes and sums in, for inputs of ``dtype``: that of the
    logits, the losses, 1/num_valid and the weight and bias gradient sums (float32, float64
    for float64 inputs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def new_gradients(
    x: Tensor,
    weight: Tensor,
    *,
    need_grad_x: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
    grad_x_dtype: torch.dtype | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The buffers of the input, weight and bias gradients (None where not needed), in the
    dtypes and shapes the forward pass returns them in: the chunk loop fills them, and the
    custom operator's fake implementation returns them as they are, made of fake tensors, so
    the two cannot disagree. ``grad_x_dtype``: the input gradient's, where it is not the
    unsharded loss's (the vocab-parallel loss keeps a float32 share for backward's sum)."""
    acc_dtype = work_dtype(x.dtype)
    if grad_x_dtype is None:
        grad_x_dtype = x.dtype if input_grad_is_mean(x.dtype) else torch.float32
    grad_x = torch.empty(x.shape, dtype=grad_x_dtype, device=x.device) if need_grad_x else None
    # The first chunk overwrites the weight-gradient sum, so it needs no zeroing pass, unless
    # there are no rows at all.
    new_sum = torch.empty if x.shape[0] > 0 else torch.zeros
    grad_weight = (
        new_sum(weight.shape, dtype=acc_dtype, device=x.device) if need_grad_weight else None
    )
    grad_bias = (
        torch.zeros(weight.shape[0], dtype=acc_dtype, device=x.device) if need_grad_bias else None
    )
    return grad_x, grad_weight, grad_bias


def summed(parts: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The chunks' partial sums of a loss, summed at the end (not in a running float32
    scalar); zero where there were no chunks."""
    if not parts:
        return torch.zeros((), dtype=dtype, device=device)
    return _chunk_torch.accurate_sum(torch.stack(parts))


def chunked_forward(
    x: Tensor,
    weight: Tensor,
    teacher_x: Tensor,
    teacher_weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    teacher_bias: Tensor | None,
    *,
    options: LossOptions,
    chunk_size: int,
    chunk_kernel: ChunkKernel,
    compute_soft: bool,
    need_grad_x: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> ForwardResult:
    """Losses and gradients of 2-D inputs, ``chunk_size`` rows at a time."""
    device = x.device
    acc_dtype = work_dtype(x.dtype)
    valid = labels != options.ignore_index
    # The chunk functions work on the summed loss, so that their elementwise ops scale by
    # Python numbers only, and 1/num_valid (a device tensor: reading the count on the host
    # would synchronise) is applied to the float32 results before their one rounding: to the
    # losses here, to the input gradient chunk by chunk as it leaves its matmul, and to the
    # float32 weight-gradient sum in backward together with grad_output. float16 keeps its
    # input gradient in float32 too, at the summed scale, until backward: the per-row
    # gradients of a mean over many rows underflow in float16 before a loss scaler's factor
    # arrives.
    inv_num_valid = valid.sum().clamp_min(1).to(acc_dtype).reciprocal()
    mean_scale = None
    if input_grad_is_mean(x.dtype):
        # Read on the host where that is free and the product rounds to a low precision
        # (this loop runs inside a custom operator, so the read never reaches a traced graph).
        readable = device.type == "cpu" and x.dtype == torch.bfloat16
        host = float(inv_num_valid) if readable else None
        mean_scale = MeanScale(inv_num_valid, host)
    # The chunk functions leave the logit gradients of ignored rows unspecified; they are
    # dropped on the small side of the matmuls: zero input rows in the weight gradient's
    # product, zeroed rows of grad_input.
    kept_rows = valid.unsqueeze(1).to(x.dtype)
    soft_parts: list[Tensor] = []
    hard_parts: list[Tensor] = []

    grad_x, grad_weight_acc, grad_bias_acc = new_gradients(
        x,
        weight,
        need_grad_x=need_grad_x,
        need_grad_weight=need_grad_weight,
        need_grad_bias=need_grad_bias,
    )
    # Where the logit gradients are written over teacher logits in the matmul dtype (the
    # Triton path), two chunks' worth wait for one weight-gradient matmul with twice the inner
    # dimension: the float32 sum is read and written half as often (the gain is in
    # benchmarks/results/h200/design-notes.md). The PyTorch path's float32 teacher logits would
    # cost twice the memory for it.
    pair_chunks = compute_soft and need_grad_weight and not chunk_kernel.float_teacher
    block_rows = 2 * chunk_size if pair_chunks else chunk_size
    teacher_block = (
        torch.empty(
            min(block_rows, x.shape[0]), teacher_weight.shape[0], dtype=x.dtype, device=device
        )
        if pair_chunks
        else None
    )
    block_start = 0  # first row whose logit gradient waits for the weight-gradient matmul

    for start in range(0, x.shape[0], chunk_size):
        end = min(start + chunk_size, x.shape[0])
        x_chunk = x[start:end]
        student_logits = compute_logits(x_chunk, weight, bias, acc_dtype)
        if compute_soft:
            teacher_dtype = acc_dtype if chunk_kernel.float_teacher else x.dtype
            rows_in_block = None
            if teacher_block is not None:
                rows_in_block = teacher_block[start - block_start : end - block_start]
            teacher_logits = compute_logits(
                teacher_x[start:end], teacher_weight, teacher_bias, teacher_dtype, rows_in_block
            )
            # The gradient goes over the teacher logits, in the matmul dtype (ChunkKernel).
            if chunk_kernel.float_teacher:
                grad_logits = packed_over(teacher_logits, weight.dtype, weight.shape[0])
            else:
                grad_logits = teacher_logits[:, : weight.shape[0]]
            soft_chunk, hard_chunk = chunk_kernel.fn(
                student_logits,
                teacher_logits,
                labels[start:end],
                grad_out=grad_logits,
                options=options,
            )
            if not grad_logits.is_contiguous():
                teacher_logits[:, weight.shape[0] :].zero_()  # the bytes between its rows
            del teacher_logits  # grad_logits keeps its storage
            soft_parts.append(soft_chunk)
        else:
            hard_chunk = _chunk_torch.cross_entropy_chunk_(
                student_logits,
                labels[start:end],
                options=options,
            )
            grad_logits = student_logits.to(weight.dtype)
        del student_logits  # free it before the gradient matmuls
        hard_parts.append(hard_chunk)

        if grad_bias_acc is not None:
            # The bias gradient sums the logit gradients themselves: mask them (rarely needed).
            grad_logits.mul_(kept_rows[start:end])
            grad_bias_acc.add_(grad_logits.sum(dim=0, dtype=acc_dtype))
        if grad_x is not None:
            input_gradient_(
                grad_x[start:end], grad_logits, weight, mean_scale, chunk_kernel.scaled_cast
            )
        if end - block_start == block_rows or end == x.shape[0]:
            if grad_weight_acc is not None:
                x_kept = x[block_start:end] * kept_rows[block_start:end]
                block_grad = (
                    grad_logits
                    if teacher_block is None
                    else teacher_block[: end - block_start, : weight.shape[0]]
                )
                accumulate_product_(grad_weight_acc, block_grad.t(), x_kept, first=block_start == 0)
                del block_grad
            block_start = end
        del grad_logits  # before the next chunk allocates its own (block_grad may be it too)

    if grad_x is not None:
        grad_x.masked_fill_(~valid.unsqueeze(1), 0.0)

    soft = summed(soft_parts, acc_dtype, device) * inv_num_valid
    hard = summed(hard_parts, acc_dtype, device) * inv_num_valid
    # The float32 weight-gradient sum waits for backward, which scales it by
    # grad_output / num_valid and rounds it once.
    return ForwardResult(
        loss=options.weight_hard * hard + options.weight_soft * soft,
        soft=soft,
        hard=hard,
        inv_num_valid=inv_num_valid,
        grad_x=grad_x,
        grad_weight=grad_weight_acc,
        grad_bias=grad_bias_acc,
    )
