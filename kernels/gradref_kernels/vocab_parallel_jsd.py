"""Vocab-parallel fused-linear JSD: the LM heads sharded along the vocabulary over a process group.

``vocab_parallel_fused_linear_jsd`` / ``VocabParallelFusedLinearJSDLoss`` take the arguments of
:func:`gradref_kernels.fused_linear_jsd` plus ``group`` (keyword-only; default: the default
process group). Each rank passes the same (replicated) hidden states and labels and its own
slice of the student and teacher LM heads (and biases): the rows ``[offset, offset + v)`` of
the full vocabulary, in rank order. The slices may differ in size, as ``torch.chunk`` and
DTensor's ``Shard(0)`` cut a vocabulary the world size does not divide; every rank must hold at
least one row, and the student's and teacher's slices must match row for row (a teacher
vocabulary wider than the student's, which the unsharded loss pads, is not supported here).
The loss returned is the full loss, the same on every rank; the input gradient is the full one
(summed over the ranks); the weight and bias gradients are this rank's slices.

Communication, per call (``W`` ranks, ``n`` rows in a chunk, ``H`` the student's hidden size):

1. one all-reduce (SUM) of ``3 W`` int64: each rank's vocabulary rows, teacher rows and input
   rows; it gives this rank's vocabulary offset and the full vocabulary (for the label check);
2. per chunk, three dependent all-reduces of float32 per-row statistics: the MAX of the row
   maxima (student, teacher: ``2n``); the SUM of the shifted sum-exps (student and teacher
   scaled by the temperature, the unscaled student's when the temperature is not 1 and the hard
   loss is computed) and of the label's shifted logit, which only its holder contributes
   (``3n`` or ``4n``); and, for ``0 < beta``, the SUM of ``K = sum(S L)`` (``sum(S d)`` for
   ``beta = 1``), the one full-vocabulary sum the soft loss's gradient needs (``n``);
3. one all-reduce (SUM) of the soft loss's local share (a scalar); the hard loss needs none,
   every rank having every row's log-sum-exp and label logit after step 2;
4. in backward, one all-reduce (SUM) of the input gradient, ``(N, H)`` in float32 (float64 for
   float64 inputs): each rank holds the product of its slice of the logit gradient with its
   slice of the weight, kept unrounded so that the full gradient is rounded to the input dtype
   once, as the unsharded kernel's is. The weight and bias gradients stay local.

So a row costs at most ``4 H + 28`` bytes of all-reduced payload (``4 H + 12`` for the hard
loss alone; a ring all-reduce moves ``2 (W - 1) / W`` times the payload per rank). The input
gradient dominates: the least any vocab-parallel loss can all-reduce is that gradient in the
input dtype, ``2 H`` bytes for bfloat16, ``4 H`` for float32, plus a few per-row statistics;
so this is the minimum's size for float32 and twice it for bfloat16, the price of rounding the
summed gradient once rather than each rank's share and every partial sum of the reduction.

The per-chunk math is the portable PyTorch path's (:mod:`gradref_kernels._chunk_torch`): the
same loss terms built from ``d = log T - log S`` and the same closed-form gradients, with the
log-softmaxes taken over the full vocabulary from the all-reduced maxima and sum-exps, and the
matmul helpers of :mod:`gradref_kernels._matmuls`. There is no Triton path:
``implementation="triton"`` raises, ``"auto"`` and ``"torch"`` run this one on every device.
A chunk holds ``(chunk_size, v)`` float32 buffers: the student and teacher logits, one of
scratch, one more for the unscaled softmax when the temperature is not 1, and the logit
gradient in the matmul dtype where the device multiplies it into float32 (CUDA); elsewhere the
input-gradient product runs on a float32 copy of the local weight, made once per call. The
input gradient's share is a float32 ``(N, H)`` buffer.

Its time, peak memory and all-reduced bytes at one rank, beside the unsharded paths', are
``benchmarks/bench_vocab_parallel.py``'s (``benchmarks/results/h200/vocab_parallel_w1_s1.txt``).
Each of W ranks holds about 1/W of the vocabulary's work.

Under ``torch.compile`` the chunk loop (collectives included) is one custom operator,
``gradref_kernels::vocab_parallel_forward``, and backward's all-reduce and rounding of the
input gradient another, ``gradref_kernels::vocab_parallel_input_grad``: both run eagerly
inside the compiled step, the process group named by its ``group_name``.

Errors: every rank checks its own arguments first, and an argument error raises where it is
seen, so where only some ranks see one (a slice of the wrong size on one rank) the others wait
in the first collective until the process group's timeout. What needs every rank's shapes (equal
row counts, labels in the full vocabulary) is checked after the first all-reduce: on the CPU on
the host, as a ValueError on every rank; elsewhere on the device (``torch._assert_async``), so
that nothing waits for the host.

Split as the unsharded loss is: the per-chunk math with its all-reduces
(``_vocab_parallel_chunk``), the vocabulary layout and the chunk loop
(``_vocab_parallel_forward``, sharing ``_forward``'s dtype rule, gradient buffers and sum of
parts), the two custom operators (``_vocab_parallel_ops``), and here the autograd Function and
the public API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Union

import torch
from torch import Tensor

from ._ops import scaled_cast_op
from ._options import LossOptions
from ._validation import check_options, check_tensors
from ._vocab_parallel_ops import vocab_parallel_forward_op, vocab_parallel_input_grad_op
from .fused_linear_jsd import LossOptionsModule

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["VocabParallelFusedLinearJSDLoss", "vocab_parallel_fused_linear_jsd"]

LossOutput = Union[Tensor, tuple[Tensor, Tensor, Tensor]]


# --------------------------------------------------------------------------- the process group


def _group_name(group: ProcessGroup | None, caller: str) -> str:
    """The name of ``group`` (None: the default group), or a RuntimeError saying how to get one."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{caller} needs torch.distributed initialised: call "
            "torch.distributed.init_process_group() first (or use fused_linear_jsd, unsharded)"
        )
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup or None (the default group), "
            f"got {type(group).__name__}"
        )
    return str(group.group_name)


# --------------------------------------------------------------------------- autograd


class VocabParallelJSDFunction(torch.autograd.Function):
    """Forward computes the loss and this rank's gradients for grad_output = 1; backward
    all-reduces the input gradient and scales the local weight and bias gradients."""

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
        group_name: str,
        grad_enabled: bool,
        return_soft_hard_loss: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        # needs_input_grad ignores torch.no_grad(), hence grad_enabled from the caller.
        need = [grad_enabled and flag for flag in ctx.needs_input_grad]
        compute_soft = (
            options.weight_soft != 0.0 or return_soft_hard_loss or not options.compute_hard
        )
        need_grads = (need[0], need[1], bias is not None and need[5])
        loss, soft, hard, inv_num_valid, grad_x, grad_weight, grad_bias = vocab_parallel_forward_op(
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
            group_name,
            *need_grads,
        )
        ctx.save_for_backward(
            inv_num_valid,
            *(g if flag else None for g, flag in zip((grad_x, grad_weight, grad_bias), need_grads)),
        )
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.group_name = group_name
        ctx.mark_non_differentiable(soft, hard)
        return loss, soft, hard

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        inv_num_valid, grad_x, grad_weight, grad_bias = ctx.saved_tensors
        # A 0-dim product on the device: no host sync, whatever grad_loss is.
        scale = grad_loss * inv_num_valid
        x_dtype, weight_dtype, bias_dtype = ctx.dtypes
        if grad_x is not None:
            grad_x = vocab_parallel_input_grad_op(grad_x, scale, x_dtype, ctx.group_name)
        if grad_weight is not None:
            grad_weight = _scaled(grad_weight, scale, weight_dtype)
        if grad_bias is not None:
            grad_bias = _scaled(grad_bias, scale, bias_dtype)
        return (grad_x, grad_weight, None, None, None, grad_bias) + (None,) * 6


def _scaled(grad: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """``grad * scale`` as ``dtype``, a float32 sum scaled and rounded in one pass, as the
    unsharded loss's backward does: through its ``scaled_cast`` operator under torch.compile
    (Inductor's CPU code for an in-place multiply of an operator's outputs corrupted the heap on
    torch 2.13) and wherever the dtype changes, else by one multi-tensor multiply that reads
    the 0-dim scale on the device."""
    if grad.dtype != dtype or torch.compiler.is_compiling():
        scaled: Tensor = scaled_cast_op(grad, scale.to(grad.dtype), dtype, "torch")
        return scaled
    return torch._foreach_mul([grad], scale)[0]


# --------------------------------------------------------------------------- the public API


def vocab_parallel_fused_linear_jsd(
    student_input: Tensor,
    student_weight: Tensor,
    teacher_input: Tensor,
    teacher_weight: Tensor,
    true_labels: Tensor,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    weight_hard_loss: float = 0.5,
    weight_soft_loss: float = 0.5,
    beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
    compiled: bool = True,
    chunk_size: int = 1024,
    return_soft_hard_loss: bool = False,
    *,
    group: ProcessGroup | None = None,
    implementation: str = "auto",
) -> LossOutput:
    """:func:`gradref_kernels.fused_linear_jsd` with the LM heads sharded along the vocabulary.

    Every argument means what it means there, with these differences:

    - ``student_weight``, ``teacher_weight`` (and the biases): this rank's rows of the full
      ``(V, H)`` heads (``(V,)`` biases), the ranks' slices contiguous and in rank order, of any
      sizes of at least one row (``torch.chunk`` / DTensor ``Shard(0)`` slices, for instance);
      the student's and teacher's slices the same rows (no wider teacher vocabulary);
    - ``student_input``, ``teacher_input``, ``true_labels``: the same full tensors on every rank
      (labels index the full vocabulary);
    - ``group``: keyword-only, the process group the vocabulary is sharded over (default: the
      default process group); every rank of it must call the loss, and backward;
    - ``implementation``: ``"auto"`` and ``"torch"`` run the portable PyTorch math on every
      device; there is no Triton path (``"triton"`` raises).

    Returns the full loss (and soft and hard losses), the same on every rank. Backward gives
    ``student_input`` the full gradient (all-reduced over the group) and the weight and bias
    this rank's slices of theirs.

    Raises:
        TypeError, ValueError: as fused_linear_jsd, and for slices that do not fit together.
        RuntimeError: torch.distributed is not initialised, or ``implementation="triton"``.
    """
    check_options(beta, temperature, ignore_index, chunk_size, implementation)
    if implementation == "triton":
        raise RuntimeError(
            "the vocab-parallel loss has no Triton path: use implementation='torch' or 'auto' "
            "(both run the portable PyTorch math)"
        )
    _check_slices(student_weight, teacher_weight)
    check_tensors(
        {
            "student_input": student_input,
            "student_weight": student_weight,
            "teacher_input": teacher_input,
            "teacher_weight": teacher_weight,
            "true_labels": true_labels,
            "student_bias": student_bias,
            "teacher_bias": teacher_bias,
        }
    )
    group_name = _group_name(group, "vocab_parallel_fused_linear_jsd")
    weight_hard = float(weight_hard_loss)
    options = LossOptions(
        beta=float(beta),
        temperature=float(temperature),
        ignore_index=ignore_index,
        weight_hard=weight_hard,
        weight_soft=float(weight_soft_loss),
        compute_hard=weight_hard != 0.0 or bool(return_soft_hard_loss),
    )
    outputs: tuple[Tensor, Tensor, Tensor] = VocabParallelJSDFunction.apply(  # type: ignore[no-untyped-call]
        student_input.reshape(-1, student_input.shape[-1]),
        student_weight,
        teacher_input.reshape(-1, teacher_input.shape[-1]),
        teacher_weight,
        true_labels.reshape(-1).long().contiguous(),
        student_bias,
        teacher_bias,
        options,
        chunk_size,
        group_name,
        torch.is_grad_enabled(),
        bool(return_soft_hard_loss),
    )
    return outputs if return_soft_hard_loss else outputs[0]


def _check_slices(student_weight: Any, teacher_weight: Any) -> None:
    """This rank's slices: at least one row, the same rows for the student and the teacher."""
    if not isinstance(student_weight, Tensor) or not isinstance(teacher_weight, Tensor):
        return  # check_tensors names it
    if student_weight.dim() != 2 or teacher_weight.dim() != 2:
        return
    rank = _rank_phrase()
    if student_weight.shape[0] == 0:
        raise ValueError(
            f"student_weight has no vocabulary rows{rank}: every rank must hold at least one "
            "(torch.chunk and DTensor's Shard(0) leave the last ranks empty when the vocabulary "
            "is small for the world size); use fewer ranks"
        )
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"student_weight has {student_weight.shape[0]} vocabulary rows{rank} and "
            f"teacher_weight {teacher_weight.shape[0]}: the vocab-parallel loss needs the "
            "same slice of one vocabulary for both (a teacher vocabulary wider than the "
            "student's is supported unsharded only, by fused_linear_jsd)"
        )


def _rank_phrase() -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return f" on rank {dist.get_rank()}"
    return ""


class VocabParallelFusedLinearJSDLoss(LossOptionsModule):
    """Module form of :func:`vocab_parallel_fused_linear_jsd`: the options, ``group``
    included, fixed at construction (and checked there); ``forward`` takes the tensors."""

    def __init__(
        self,
        weight_hard_loss: float = 0.5,
        weight_soft_loss: float = 0.5,
        beta: float = 0.5,
        ignore_index: int = -100,
        temperature: float = 1.0,
        compiled: bool = True,
        chunk_size: int = 1024,
        return_soft_hard_loss: bool = False,
        *,
        group: ProcessGroup | None = None,
        implementation: str = "auto",
    ) -> None:
        super().__init__(
            weight_hard_loss,
            weight_soft_loss,
            beta,
            ignore_index,
            temperature,
            compiled,
            chunk_size,
            return_soft_hard_loss,
            implementation=implementation,
        )
        self.group = group

    def forward(
        self,
        student_input: Tensor,
        student_weight: Tensor,
        teacher_input: Tensor,
        teacher_weight: Tensor,
        true_labels: Tensor,
        student_bias: Tensor | None = None,
        teacher_bias: Tensor | None = None,
    ) -> LossOutput:
        """The loss (or ``(loss, soft_loss, hard_loss)``) of
        :func:`vocab_parallel_fused_linear_jsd`."""
        return vocab_parallel_fused_linear_jsd(
            student_input,
            student_weight,
            teacher_input,
            teacher_weight,
            true_labels,
            student_bias,
            teacher_bias,
            self.weight_hard_loss,
            self.weight_soft_loss,
            self.beta,
            self.ignore_index,
            self.temperature,
            self.compiled,
            self.chunk_size,
            self.return_soft_hard_loss,
            group=self.group,
            implementation=self.implementation,
        )
