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

No postponed annotations in this module: torch.library reads the operators' annotations at run
time, where Python 3.9 has no ``X | None``.
"""

from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import Tensor

from ._chunk_torch import accurate_sum
from ._matmuls import accumulate_product_, compute_logits, dense, mixed_matmul
from ._ops import scaled_cast_op
from ._options import LossOptions
from ._validation import check_label_range, check_options, check_tensors
from .fused_linear_jsd import LossOptionsModule

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["VocabParallelFusedLinearJSDLoss", "vocab_parallel_fused_linear_jsd"]

LossOutput = Union[Tensor, tuple[Tensor, Tensor, Tensor]]
ForwardOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


# --------------------------------------------------------------------------- the process group


class _Group:
    """The process group an operator names, and the all-reduces of the loss."""

    def __init__(self, group_name: str) -> None:
        import torch.distributed as dist

        self.dist = dist
        # Operators take strings, not ProcessGroup objects: the group travels by its name.
        # (torch's functional collectives resolve their group names the same way.)
        self.group = dist.distributed_c10d._resolve_process_group(group_name)  # type: ignore[attr-defined,arg-type]
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)

    def sum_(self, tensor: Tensor) -> Tensor:
        self.dist.all_reduce(tensor, op=self.dist.ReduceOp.SUM, group=self.group)
        return tensor

    def max_(self, tensor: Tensor) -> Tensor:
        self.dist.all_reduce(tensor, op=self.dist.ReduceOp.MAX, group=self.group)
        return tensor


def _group_name(group: Optional["ProcessGroup"], caller: str) -> str:
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


def _all_reduce_input_gradient(total: Tensor, group: _Group) -> None:
    """Sums the ranks' shares of the input gradient (a separate function so that a test can
    plant the bug of leaving it out)."""
    group.sum_(total)


# --------------------------------------------------------------------------- the vocabulary layout


def _vocabulary_offset(
    vocab: int, teacher_vocab: int, labels: Tensor, ignore_index: int, group: _Group
) -> Union[int, Tensor]:
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


# --------------------------------------------------------------------------- the per-chunk math


def _local_labels(labels: Tensor, offset: Union[int, Tensor], vocab: int) -> tuple[Tensor, Tensor]:
    """(held, index): which rows' labels fall in this rank's slice, and their column there
    (0 for the others, so that gather and scatter stay in range), each (n, 1)."""
    column = labels - offset
    held = (column >= 0) & (column < vocab)
    return held.unsqueeze(1), torch.where(held, column, 0).unsqueeze(1)


def _chunk_(
    student: Tensor,
    teacher: Optional[Tensor],
    labels: Tensor,
    offset: Union[int, Tensor],
    grad_dtype: torch.dtype,
    group: _Group,
    options: LossOptions,
) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk of ``n`` rows: (soft_rows, hard_rows, grad_logits).

    ``student`` (n, v) and ``teacher`` (n, v) float32 (float64) raw logits of this rank's
    vocabulary slice, used as scratch; ``teacher`` None when the soft loss is not computed.
    ``soft_rows`` (n,) is this rank's share of each row's soft loss (summed over the ranks
    later), ``hard_rows`` (n,) each row's full hard loss (the same on every rank);
    ``grad_logits`` (n, v) in ``grad_dtype`` is d(summed loss)/dlogits of this slice. As in
    :func:`gradref_kernels._chunk_torch.jsd_chunk_`, rows whose label is ``ignore_index`` get
    unspecified (finite) values, which the caller drops.
    """
    beta, temperature = options.beta, options.temperature
    weight_hard, weight_soft = options.weight_hard, options.weight_soft
    compute_hard = options.compute_hard
    vocab = student.shape[1]
    held, column = _local_labels(labels, offset, vocab)

    # Round 1: the row maxima over the full vocabulary (max(z / tau) = max(z) / tau, tau > 0).
    maxima = [student.amax(1)] + ([] if teacher is None else [teacher.amax(1)])
    row_max = group.max_(torch.stack(maxima)).unsqueeze(2)
    student.sub_(row_max[0])
    # The label's shifted logit, from the rank that holds it (zero elsewhere).
    label_logit = torch.where(held, student.gather(1, column), 0.0).squeeze(1)

    if teacher is None:  # the hard loss alone: softmax(z) over the student logits in place
        prob = student.exp_()
        sums = group.sum_(torch.stack([prob.sum(1), label_logit]))
        hard_rows = sums[0].log() - sums[1]
        grad = prob.mul_((weight_hard / sums[0]).unsqueeze(1))
        grad.scatter_add_(1, column, torch.where(held, -weight_hard, 0.0).to(grad.dtype))
        return torch.zeros_like(hard_rows), hard_rows, grad.to(grad_dtype)

    work = torch.empty_like(student)
    shared = options.shares_softmax(vocab, vocab)  # temperature 1: softmax(z) is S
    # The unscaled shifted student logits, kept for the hard loss's softmax.
    hard_logits = student.clone() if compute_hard and not shared else None
    if temperature != 1.0:
        student.mul_(1.0 / temperature)
    teacher.sub_(row_max[1])
    if temperature != 1.0:
        teacher.mul_(1.0 / temperature)
    # Round 2: the sum-exps of the shifted (and scaled) logits, and the label's logit.
    partial = [torch.exp(student, out=work).sum(1), torch.exp(teacher, out=work).sum(1)]
    if hard_logits is not None:
        partial.append(torch.exp(hard_logits, out=work).sum(1))
    if compute_hard:
        partial.append(label_logit)
    sums = group.sum_(torch.stack(partial))
    log_sum_exp = sums[: 2 + (hard_logits is not None)].log().unsqueeze(2)
    log_s = student.sub_(log_sum_exp[0])
    log_t = teacher.sub_(log_sum_exp[1])
    prob_hard = None
    if hard_logits is not None:
        prob_hard = hard_logits.sub_(log_sum_exp[2]).exp_()
    # The hard loss's log-sum-exp is S's at temperature 1, its own otherwise.
    hard_log_sum_exp = log_sum_exp[0 if hard_logits is None else 2, :, 0]
    hard_rows = (hard_log_sum_exp - sums[-1]) if compute_hard else torch.zeros_like(sums[0])

    # The soft loss from d = log T - log S, as _chunk_torch._slice_ builds it (see there): the
    # row sums here are this rank's shares; K, the sum over the row that the gradient needs,
    # is round 3.
    shared_hard = weight_hard if shared and compute_hard else 0.0
    diff = torch.sub(log_t, log_s, out=work)
    if beta == 0.0:
        # KL(T||S) = sum(T d) + sum(S - T); gradient (S - T) / tau.
        prob_t = log_t.exp_()
        soft_rows = torch.nansum(diff.mul_(prob_t), 1)
        prob_s = log_s.exp_()
        last_term = torch.sub(prob_s, prob_t, out=prob_t)
        soft_rows += last_term.sum(1)
        grad = prob_s.mul_(shared_hard)
        last_scale = weight_soft / temperature
    elif beta == 1.0:
        # KL(S||T) = -sum(S d) - sum(S - T); gradient S * (K - d) / tau, K = sum(S d).
        prob_s = log_s.exp_()
        s_minus_t = torch.sub(prob_s, log_t.exp_(), out=log_t)
        diff.clamp_min_(torch.finfo(diff.dtype).min)
        last_term = diff.mul_(prob_s)
        k_rows = last_term.sum(1)
        soft_rows = -k_rows - s_minus_t.sum(1)
        grad_scale = weight_soft / temperature
        grad = prob_s.mul_(group.sum_(k_rows).mul_(grad_scale).add_(shared_hard).unsqueeze(1))
        last_scale = -grad_scale
    else:
        # beta sum(T d) - sum(S L) - sum(S L b), L = log1p(b), b = beta expm1(d); gradient
        # (1 - beta) / tau * S * (K - L), K = sum(S L).
        soft_rows = torch.nansum(log_t.exp_().mul_(diff), 1).mul_(beta)
        prob_s = log_s.exp_()
        mix_ratio = diff.expm1_().mul_(beta)
        last_term = torch.special.xlog1py(prob_s, mix_ratio, out=log_t)
        k_rows = last_term.sum(1)
        soft_rows -= k_rows + mix_ratio.mul_(last_term).sum(1)
        grad_scale = weight_soft * (1.0 - beta) / temperature
        grad = prob_s.mul_(group.sum_(k_rows).mul_(grad_scale).add_(shared_hard).unsqueeze(1))
        last_scale = -grad_scale

    if compute_hard and weight_hard != 0.0:
        grad.scatter_add_(1, column, torch.where(held, -weight_hard, 0.0).to(grad.dtype))
        if prob_hard is not None:
            grad.add_(prob_hard, alpha=weight_hard)
    # The last op writes the gradient, rounded once to the matmul dtype where it differs.
    if grad_dtype == grad.dtype:
        return soft_rows, hard_rows, grad.add_(last_term, alpha=last_scale)
    grad_logits = torch.empty(grad.shape, dtype=grad_dtype, device=grad.device)
    torch.add(grad, last_term, alpha=last_scale, out=grad_logits)
    return soft_rows, hard_rows, grad_logits


# --------------------------------------------------------------------------- the chunk loop


def _masked_total(rows: Tensor, valid: Tensor) -> Tensor:
    """The sum over the valid rows; torch.where so that an ignored row's value cannot turn it
    into NaN."""
    return accurate_sum(torch.where(valid, rows, 0.0))


def _forward(
    x: Tensor,
    weight: Tensor,
    teacher_x: Tensor,
    teacher_weight: Tensor,
    labels: Tensor,
    bias: Optional[Tensor],
    teacher_bias: Optional[Tensor],
    *,
    options: LossOptions,
    chunk_size: int,
    compute_soft: bool,
    group: _Group,
    need_grad_x: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> ForwardOutputs:
    """The losses and this rank's gradients, ``chunk_size`` rows at a time (see the module
    docstring); the input gradient is this rank's float32 share, summed in backward."""
    device = x.device
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    offset = _vocabulary_offset(
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

    grad_x = torch.empty(x.shape, dtype=acc_dtype, device=device) if need_grad_x else None
    # The first chunk overwrites the weight gradient's sum: no zeroing pass unless no rows.
    new_sum = torch.empty if x.shape[0] > 0 else torch.zeros
    grad_weight = None
    if need_grad_weight:
        grad_weight = new_sum(weight.shape, dtype=acc_dtype, device=device)
    grad_bias = None
    if need_grad_bias:
        grad_bias = torch.zeros(weight.shape[0], dtype=acc_dtype, device=device)
    soft_parts: list[Tensor] = []
    hard_parts: list[Tensor] = []

    for start in range(0, x.shape[0], chunk_size):
        end = min(start + chunk_size, x.shape[0])
        student = compute_logits(x[start:end], weight, bias, acc_dtype)
        teacher = None
        if compute_soft:
            teacher = compute_logits(teacher_x[start:end], teacher_weight, teacher_bias, acc_dtype)
        soft_rows, hard_rows, grad_logits = _chunk_(
            student, teacher, labels[start:end], offset, grad_dtype, group, options
        )
        del student, teacher
        chunk_valid = valid[start:end]
        soft_parts.append(_masked_total(soft_rows, chunk_valid))
        hard_parts.append(_masked_total(hard_rows, chunk_valid))
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

    def total(parts: list[Tensor]) -> Tensor:
        if not parts:
            return torch.zeros((), dtype=acc_dtype, device=device)
        return accurate_sum(torch.stack(parts))

    # The hard loss is every rank's already; the soft loss's shares are summed.
    soft = group.sum_(total(soft_parts)) * inv_num_valid
    hard = total(hard_parts) * inv_num_valid
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


# --------------------------------------------------------------------------- the operators


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
    return _forward(
        dense(x),
        dense(weight),
        dense(teacher_x),
        dense(teacher_weight),
        labels,
        bias,
        teacher_bias,
        options=LossOptions(
            beta=beta,
            temperature=temperature,
            ignore_index=ignore_index,
            weight_hard=weight_hard,
            weight_soft=weight_soft,
            compute_hard=compute_hard,
        ),
        chunk_size=chunk_size,
        compute_soft=compute_soft,
        group=_Group(group_name),
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
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    scalar = x.new_empty((), dtype=acc_dtype)
    return (
        scalar,
        torch.empty_like(scalar),
        torch.empty_like(scalar),
        torch.empty_like(scalar),
        x.new_empty(x.shape, dtype=acc_dtype) if need_grad_x else x.new_empty(0),
        x.new_empty(weight.shape, dtype=acc_dtype) if need_grad_weight else x.new_empty(0),
        x.new_empty(weight.shape[:1], dtype=acc_dtype) if need_grad_bias else x.new_empty(0),
    )


@torch.library.custom_op("gradref_kernels::vocab_parallel_input_grad", mutates_args=())
def vocab_parallel_input_grad_op(
    share: Tensor, scale: Tensor, dtype: torch.dtype, group_name: str
) -> Tensor:
    """The input gradient: every rank's float32 ``share`` times ``scale``, summed over the
    ranks, rounded once to ``dtype``. ``share`` is left as it is (a second backward, with
    ``retain_graph=True``, reduces it again)."""
    total = share * scale.to(share.dtype)
    _all_reduce_input_gradient(total, _Group(group_name))
    return total if total.dtype == dtype else total.to(dtype)


@vocab_parallel_input_grad_op.register_fake
def _(share: Tensor, scale: Tensor, dtype: torch.dtype, group_name: str) -> Tensor:
    return share.new_empty(share.shape, dtype=dtype)


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
        bias: Optional[Tensor],
        teacher_bias: Optional[Tensor],
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
            options.beta,
            options.temperature,
            options.ignore_index,
            options.weight_hard,
            options.weight_soft,
            options.compute_hard,
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
    def backward(ctx: Any, grad_loss: Tensor, *_: Any) -> tuple[Optional[Tensor], ...]:
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
    student_bias: Optional[Tensor] = None,
    teacher_bias: Optional[Tensor] = None,
    weight_hard_loss: float = 0.5,
    weight_soft_loss: float = 0.5,
    beta: float = 0.5,
    ignore_index: int = -100,
    temperature: float = 1.0,
    compiled: bool = True,
    chunk_size: int = 1024,
    return_soft_hard_loss: bool = False,
    *,
    group: Optional["ProcessGroup"] = None,
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
        group: Optional["ProcessGroup"] = None,
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
        student_bias: Optional[Tensor] = None,
        teacher_bias: Optional[Tensor] = None,
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
