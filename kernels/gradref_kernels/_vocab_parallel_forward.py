"""The forward pass of the vocab-parallel loss: the vocabulary layout over the ranks, then the loop
over chunks of rows, as the unsharded loss's (``_forward``), whose dtype rule, gradient buffers
and sum of the chunks' parts it shares."""

from __future__ import annotations

import torch
from torch import Tensor

from ._chunk_torch import masked_sum
from ._forward import new_gradients, summed, work_dtype
from ._matmuls import accumulate_product_, compute_logits, mixed_matmul
from ._options import LossOptions
from ._validation import check_label_range
from ._vocab_parallel_chunk import Group, jsd_chunk_

# The forward operator's outputs: (loss, soft, hard, inv_num_valid, grad_x, grad_weight,
# grad_bias), a gradient not computed an empty tensor.
ForwardOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def vocabulary_offset(
    vocab: int, teacher_vocab: int, labels: Tensor, ignore_index: int, group: Group
) -> int | Tensor:
    """The first vocabulary index this rank holds: the rows of the ranks before it, from one
    all-reduce of every rank's shapes. Checks the labels against the full vocabulary and the
    row counts against each other: on the host where that is free (the CPU) or the device has
    no asynchronous assert, on the device otherwise."""
    rows = labels.shape[0]
    layout = torch.zeros(group.size, 3, dtype=torch.int64, device=labels.device)
    layout[group.rank, 0] = vocab
    layout[group.rank, 1] = teacher_vocab
    layout[group.rank, 2] = rows
    group.sum_(layout)
    if labels.device.type != "cpu":
        total = layout[:, 0].sum()
        in_range = ((labels >= 0) & (labels < total)) | (labels == ignore_index)
        consistent = (layout[:, 0] == layout[:, 1]).all() & (layout[:, 2] == rows).all()
        try:
            torch._assert_async(
                in_range.all() & consistent,
                "vocab-parallel JSD: true_labels outside the full vocabulary, or ranks with "
                "different row counts or student/teacher vocabulary slices",
            )
            offset: Tensor = layout[: group.rank, 0].sum()
            return offset
        except NotImplementedError:
            pass
    sizes, teacher_sizes, counts = (list(column) for column in zip(*layout.tolist()))
    if sizes != teacher_sizes:
        raise ValueError(
            "student_weight and teacher_weight must hold the same vocabulary rows on every rank, "
            f"got student rows {sizes} and teacher rows {teacher_sizes} by rank"
        )
    if len(set(counts)) > 1:
        raise ValueError(
            f"student_input has {counts} rows by rank: the hidden states and true_labels must "
            "be the same (replicated) on every rank of the group"
        )
    check_label_range(labels.cpu(), sum(sizes), ignore_index)
    return int(sum(sizes[: group.rank]))


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
    compute_soft: bool,
    group: Group,
    need_grad_x: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> ForwardOutputs:
    """The losses and this rank's gradients, ``chunk_size`` rows at a time (see the module
    docstring); the input gradient is this rank's float32 share, summed in backward."""
    device = x.device
    acc_dtype = work_dtype(x.dtype)
    offset = vocabulary_offset(
        weight.shape[0], teacher_weight.shape[0], labels, options.ignore_index, group
    )
    valid = labels != options.ignore_index
    inv_num_valid = valid.sum().clamp_min(1).to(acc_dtype).reciprocal()
    kept_rows = valid.unsqueeze(1).to(x.dtype)
    # The logit gradient goes into the matmuls in the matmul dtype where the device multiplies
    # that into float32 (CUDA); elsewhere the products run on float32 operands, so it stays
    # float32 (no rounding, no conversion pass).
    mixed = mixed_matmul(device.type, x.dtype) and acc_dtype == torch.float32
    grad_dtype = weight.dtype if mixed else acc_dtype
    weight_acc = weight.to(acc_dtype) if need_grad_x and not mixed else weight

    # The input gradient is this rank's float32 (float64) share, summed over the ranks and
    # rounded once in backward.
    grad_x, grad_weight, grad_bias = new_gradients(
        x,
        weight,
        need_grad_x=need_grad_x,
        need_grad_weight=need_grad_weight,
        need_grad_bias=need_grad_bias,
        grad_x_dtype=acc_dtype,
    )
    soft_parts: list[Tensor] = []
    hard_parts: list[Tensor] = []

    for start in range(0, x.shape[0], chunk_size):
        end = min(start + chunk_size, x.shape[0])
        student = compute_logits(x[start:end], weight, bias, acc_dtype)
        teacher = None
        if compute_soft:
            teacher = compute_logits(teacher_x[start:end], teacher_weight, teacher_bias, acc_dtype)
        soft_rows, hard_rows, grad_logits = jsd_chunk_(
            student, teacher, labels[start:end], offset, grad_dtype, group, options
        )
        del student, teacher
        chunk_valid = valid[start:end]
        soft_parts.append(masked_sum(soft_rows, chunk_valid))
        hard_parts.append(masked_sum(hard_rows, chunk_valid))
        if grad_bias is not None:
            grad_logits.mul_(kept_rows[start:end].to(grad_logits.dtype))
            grad_bias.add_(grad_logits.sum(dim=0, dtype=acc_dtype))
        if grad_x is not None:
            if mixed:
                torch.mm(grad_logits, weight, out_dtype=torch.float32, out=grad_x[start:end])
            else:
                torch.mm(grad_logits, weight_acc, out=grad_x[start:end])
        if grad_weight is not None:
            x_kept = x[start:end] * kept_rows[start:end]
            accumulate_product_(
                grad_weight, grad_logits.t(), x_kept.to(grad_logits.dtype), first=start == 0
            )
        del grad_logits

    # The hard loss is every rank's already; the soft loss's shares are summed.
    soft = group.sum_(summed(soft_parts, acc_dtype, device)) * inv_num_valid
    hard = summed(hard_parts, acc_dtype, device) * inv_num_valid
    if grad_x is not None:
        grad_x.masked_fill_(~valid.unsqueeze(1), 0.0)
    # An operator returns tensors only, none twice: a gradient not computed is an empty one.
    return (
        options.weight_hard * hard + options.weight_soft * soft,
        soft,
        hard,
        inv_num_valid,
        x.new_empty(0) if grad_x is None else grad_x,
        x.new_empty(0) if grad_weight is None else grad_weight,
        x.new_empty(0) if grad_bias is None else grad_bias,
    )
