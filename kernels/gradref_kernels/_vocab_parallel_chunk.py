"""The per-chunk math of the vocab-parallel loss: the unsharded loss's (``_chunk_torch``) on this
rank's slice of the vocabulary, with the all-reduces over the group that make each row's
statistics the full vocabulary's: the row maxima, then the sum-exps and the label's logit, then
the row sum K the gradient needs (vocab_parallel_jsd.py's docstring counts them)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._chunk_torch import soft_rows, soft_terms_
from ._options import LossOptions


class Group:
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


def local_labels(labels: Tensor, offset: int | Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """(held, index): which rows' labels fall in this rank's slice, and their column there
    (0 for the others, so that gather and scatter stay in range), each (n, 1)."""
    column = labels - offset
    held = (column >= 0) & (column < vocab)
    return held.unsqueeze(1), torch.where(held, column, 0).unsqueeze(1)


def jsd_chunk_(
    student: Tensor,
    teacher: Tensor | None,
    labels: Tensor,
    offset: int | Tensor,
    grad_dtype: torch.dtype,
    group: Group,
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
    weight_hard = options.weight_hard
    compute_hard = options.compute_hard
    vocab = student.shape[1]
    held, column = local_labels(labels, offset, vocab)

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

    # The soft loss from d = log T - log S by the unsharded loss's own step (see there): its
    # row sums are this rank's shares; K, the sum over the row that the gradient needs, is
    # round 3.
    diff = torch.sub(log_t, log_s, out=work)
    prob_s = log_s.exp_()
    row_sums = student.new_empty((3, student.shape[0]))  # the most soft_terms_ records
    grad, last_term, last_scale = soft_terms_(
        log_t,
        diff,
        prob_s,
        row_sums,
        options=options,
        shared_hard=weight_hard if shared and compute_hard else 0.0,
        whole_row=lambda k: group.sum_(k.clone()),
    )
    soft_share = soft_rows(row_sums, beta)

    if compute_hard and weight_hard != 0.0:
        grad.scatter_add_(1, column, torch.where(held, -weight_hard, 0.0).to(grad.dtype))
        if prob_hard is not None:
            grad.add_(prob_hard, alpha=weight_hard)
    # The last op writes the gradient, rounded once to the matmul dtype where it differs.
    if grad_dtype == grad.dtype:
        return soft_share, hard_rows, grad.add_(last_term, alpha=last_scale)
    grad_logits = torch.empty(grad.shape, dtype=grad_dtype, device=grad.device)
    torch.add(grad, last_term, alpha=last_scale, out=grad_logits)
    return soft_share, hard_rows, grad_logits
