"""The vocab-parallel loss's two custom operators: the chunk loop with its collectives, and
backward's all-reduce and rounding of the input gradient. Under ``torch.compile`` both run
eagerly inside the compiled step; the process group travels by its name.

No postponed annotations in this module: torch.library reads the operators' annotations at run
time, where Python 3.9 has no ``X | None``.
"""

from typing import Optional

import torch
from torch import Tensor

from ._forward import new_gradients, work_dtype
from ._matmuls import dense
from ._options import LossOptions
from ._vocab_parallel_chunk import Group
from ._vocab_parallel_forward import ForwardOutputs, chunked_forward


def all_reduce_input_gradient(total: Tensor, group: Group) -> None:
    """Sums the ranks' shares of the input gradient (a separate function so that a test can
    plant the bug of leaving it out)."""
    group.sum_(total)


@torch.library.custom_op("gradref_kernels::vocab_parallel_forward", mutates_args=())
def vocab_parallel_forward_op(
    x: Tensor,
    weight: Tensor,
    teacher_x: Tensor,
    teacher_weight: Tensor,
    labels: Tensor,
    bias: Optional[Tensor],
    teacher_bias: Optional[Tensor],
    beta: float,
    temperature: float,
    ignore_index: int,
    weight_hard: float,
    weight_soft: float,
    compute_hard: bool,
    compute_soft: bool,
    chunk_size: int,
    group_name: str,
    need_grad_x: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> ForwardOutputs:
    """The chunk loop with its collectives: ``(loss, soft, hard, inv_num_valid, grad_x,
    grad_weight, grad_bias)``, grad_x this rank's float32 share, a gradient that is not
    needed an empty tensor."""
    return chunked_forward(
        dense(x),
        dense(weight),
        dense(teacher_x),
        dense(teacher_weight),
        labels,
        bias,
        teacher_bias,
        options=LossOptions.from_op_args(
            (beta, temperature, ignore_index, weight_hard, weight_soft, compute_hard)
        ),
        chunk_size=chunk_size,
        compute_soft=compute_soft,
        group=Group(group_name),
        need_grad_x=need_grad_x,
        need_grad_weight=need_grad_weight,
        need_grad_bias=need_grad_bias,
    )


@vocab_parallel_forward_op.register_fake
def _(
    x: Tensor,
    weight: Tensor,
    teacher_x: Tensor,
    teacher_weight: Tensor,
    labels: Tensor,
    bias: Optional[Tensor],
    teacher_bias: Optional[Tensor],
    beta: float,
    temperature: float,
    ignore_index: int,
    weight_hard: float,
    weight_soft: float,
    compute_hard: bool,
    compute_soft: bool,
    chunk_size: int,
    group_name: str,
    need_grad_x: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> ForwardOutputs:
    # The buffers the chunk loop fills, made by the same function, of fake tensors.
    scalar = x.new_empty((), dtype=work_dtype(x.dtype))
    grads = new_gradients(
        x,
        weight,
        need_grad_x=need_grad_x,
        need_grad_weight=need_grad_weight,
        need_grad_bias=need_grad_bias,
        grad_x_dtype=work_dtype(x.dtype),
    )
    grad_x, grad_weight, grad_bias = (x.new_empty(0) if g is None else g for g in grads)
    return (
        scalar,
        torch.empty_like(scalar),
        torch.empty_like(scalar),
        torch.empty_like(scalar),
        grad_x,
        grad_weight,
        grad_bias,
    )


@torch.library.custom_op("gradref_kernels::vocab_parallel_input_grad", mutates_args=())
def vocab_parallel_input_grad_op(
    share: Tensor, scale: Tensor, dtype: torch.dtype, group_name: str
) -> Tensor:
    """The input gradient: every rank's float32 ``share`` times ``scale``, summed over the
    ranks, rounded once to ``dtype``. ``share`` is left as it is (a second backward, with
    ``retain_graph=True``, reduces it again)."""
    total = share * scale.to(share.dtype)
    all_reduce_input_gradient(total, Group(group_name))
    return total if total.dtype == dtype else total.to(dtype)


@vocab_parallel_input_grad_op.register_fake
def _(share: Tensor, scale: Tensor, dtype: torch.dtype, group_name: str) -> Tensor:
    return share.new_empty(share.shape, dtype=dtype)
