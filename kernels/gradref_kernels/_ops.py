"""The custom operators through which the fused loss reaches its chunk loop and its scaled cast:
what ``torch.compile`` sees of the kernel.

Dynamo and Inductor treat each operator as one opaque call with a fake implementation that
gives the shapes and dtypes of its results, so a compiled graph runs the same code as eager
(the Triton row kernel on CUDA, the portable math elsewhere) and nothing inside is traced:

- the choice of the per-chunk function and the matmul capability probe run when the operator
  runs (or, for the choice, when its fake implementation runs), never as traced code;
- the label check and the CPU's read of 1/num_valid read the host there, outside the graph;
- the loop over chunks is not unrolled, so the graph does not depend on the row count;
- the loop's storage reuse (the logit gradient written over the teacher logits, packed in
  another dtype) stays as it is, where functionalization would add copies;
- the mixed-dtype matmuls (``out_dtype=``) run eagerly, where Inductor (torch 2.13) has no
  lowering for them.

The chunk loop's operator is wrapped by :class:`._function.FusedLinearJSDFunction`, whose
backward only scales the saved gradients; the scaled cast is an operator of its own because
that backward is traced. Neither operator has an autograd formula: the Function calls the chunk
loop's with grad mode off, and backward calls the scaled cast on tensors that need no gradient.
"""

from typing import Optional

import torch
from torch import Tensor

from ._dispatch import select_chunk_kernel
from ._forward import ForwardResult, chunked_forward, new_gradients, work_dtype
from ._matmuls import dense
from ._options import LossOptions
from ._validation import check_label_range

# torch.library reads these annotations at run time, where Python 3.9 has no ``X | None``:
# hence Optional, and no postponed annotations in this module.
ForwardOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


def _absent(like: Tensor) -> Tensor:
    """Stands for a gradient that is not computed: an operator returns tensors only."""
    return like.new_empty(0)


@torch.library.custom_op("gradref_kernels::chunked_forward", mutates_args=())
def chunked_forward_op(
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
    implementation: str,
    need_grad_x: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> ForwardOutputs:
    """:func:`._forward.chunked_forward` of 2-D inputs and 1-D int64 labels, the loss options
    spelled out: ``(loss, soft, hard, inv_num_valid, grad_x, grad_weight, grad_bias)``, a
    gradient that is not needed as an empty tensor."""
    check_label_range(labels, weight.shape[0], ignore_index)
    result = chunked_forward(
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
        chunk_kernel=select_chunk_kernel(implementation, x.device, x.dtype),
        compute_soft=compute_soft,
        need_grad_x=need_grad_x,
        need_grad_weight=need_grad_weight,
        need_grad_bias=need_grad_bias,
    )
    return _outputs(x, result)


@chunked_forward_op.register_fake
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
    implementation: str,
    need_grad_x: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> ForwardOutputs:
    # Raises here, as the graph is built, when the implementation asked for cannot run.
    select_chunk_kernel(implementation, x.device, x.dtype)
    # The dtypes and shapes come from the rule the chunk loop allocates by.
    loss, soft, hard, inv_num_valid = (x.new_empty((), dtype=work_dtype(x.dtype)) for _ in range(4))
    grad_x, grad_weight, grad_bias = new_gradients(
        x,
        weight,
        need_grad_x=need_grad_x,
        need_grad_weight=need_grad_weight,
        need_grad_bias=need_grad_bias,
    )
    return _outputs(
        x, ForwardResult(loss, soft, hard, inv_num_valid, grad_x, grad_weight, grad_bias)
    )


def _outputs(like: Tensor, result: ForwardResult) -> ForwardOutputs:
    """The operator's outputs, a gradient that is not computed as an empty tensor."""
    return (
        result.loss,
        result.soft,
        result.hard,
        result.inv_num_valid,
        _absent(like) if result.grad_x is None else result.grad_x,
        _absent(like) if result.grad_weight is None else result.grad_weight,
        _absent(like) if result.grad_bias is None else result.grad_bias,
    )


@torch.library.custom_op("gradref_kernels::scaled_cast", mutates_args=())
def scaled_cast_op(
    source: Tensor, scale: Tensor, dtype: torch.dtype, implementation: str
) -> Tensor:
    """``(source * scale).to(dtype)`` rounded once, by the scaled cast of the per-chunk
    function that ``implementation`` selects for ``dtype`` inputs on source's device; a plain
    multiply where source already has ``dtype``."""
    if source.dtype == dtype:  # a scaling alone (compiled steps route it here too)
        return source * scale
    chunk_kernel = select_chunk_kernel(implementation, source.device, dtype)
    return chunk_kernel.scaled_cast(source.contiguous(), scale, dtype)


@scaled_cast_op.register_fake
def _(source: Tensor, scale: Tensor, dtype: torch.dtype, implementation: str) -> Tensor:
    return source.new_empty(source.shape, dtype=dtype)
