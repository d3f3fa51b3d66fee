"""Per-chunk math of the fused-linear JSD loss in plain PyTorch: the portable path.

Runs on any device PyTorch runs on (CPU, CUDA, Ascend NPU, ...). Every step is an in-place
or ``out=`` tensor op: nothing builds an autograd graph, nothing reads a tensor value on the
host, and a chunk of ``n`` rows needs one extra ``(n, Vt)`` buffer besides the two logits
buffers it is given (two when the teacher vocabulary is larger than the student's).

``gradref_kernels._chunk_triton`` implements :func:`jsd_chunk_` with the same contract.

Gradient of the soft loss with respect to the student logits ``z`` of one row, with
``S = softmax(z / tau)``, ``T = softmax(t / tau)``, ``M = beta*T + (1-beta)*S`` and
``r = log S - log M``. Writing the loss as ``beta*sum(T log T) + (1-beta)*sum(S log S) -
sum(M log M)``, its derivative with respect to ``S_k`` is ``(1-beta)*r_k`` (the ``+1`` terms
of the last two cancel); the softmax Jacobian ``diag(S) - S S^T`` and ``d(z/tau)/dz`` then
give:

- ``0 < beta < 1``: ``(1-beta)/tau * S * (r - sum(S*r))``
- ``beta = 0`` (``KL(T||S)``): ``(S - T)/tau``
- ``beta = 1`` (``KL(S||T)``): ``S * ((log S - log T) - KL(S||T)) / tau``
- hard loss (cross-entropy of the unscaled logits): ``softmax(z) - onehot(label)``
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _row_setup(
    labels: Tensor, ignore_index: int, inv_num_valid: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(valid, row_weight, safe_labels), each (n, 1): the mask of rows that count, their
    weight inv_num_valid (0 for ignored rows) and labels with ignored rows pointed at class 0
    so gather/scatter stay in range (their weight is 0, so class 0 is never touched)."""
    valid = (labels != ignore_index).unsqueeze(1)
    row_weight = torch.where(valid, inv_num_valid, 0.0)
    safe_labels = labels.unsqueeze(1).masked_fill(~valid, 0)
    return valid, row_weight, safe_labels


def accurate_sum(values: Tensor) -> Tensor:
    """Sum of a 1-D tensor to about one rounding step of the result.

    A plain float32 sum of a few hundred row losses is off by a few ulps; one correction with
    the residuals ``values - mean`` (much smaller numbers, so summed with much smaller absolute
    error) recovers them. Two extra passes over n numbers, no host sync. An infinite total
    (an infinite KL) stays infinite rather than turning into inf - inf = NaN."""
    total = values.sum()
    correction = (values - total / max(values.numel(), 1)).sum()
    return torch.where(total.isfinite(), total + correction, total)


def _masked_sum(rows: Tensor, valid: Tensor, inv_num_valid: Tensor) -> Tensor:
    """Sum of the per-row values of the valid rows, times inv_num_valid, as a 0-dim tensor.

    torch.where rather than a multiplication by the row weight, so an ignored row whose loss
    is inf (nothing stops that) cannot turn the sum into NaN."""
    return accurate_sum(torch.where(valid, rows, 0.0).flatten()) * inv_num_valid


def _log_softmax_(x: Tensor, scratch: Tensor, inv_temperature: float) -> Tensor:
    """x := log_softmax(x * inv_temperature, dim=-1) in place; returns the (n, 1) log-sum-exp
    of ``x * inv_temperature``. ``scratch`` (same shape) receives the exponentials."""
    row_max = x.amax(dim=-1, keepdim=True)
    # (x - max) * inv_temperature in one pass: out = input + alpha * other
    torch.add(row_max * -inv_temperature, x, alpha=inv_temperature, out=x)
    torch.exp(x, out=scratch)
    log_sum = scratch.sum(dim=-1, keepdim=True).log_()
    x.sub_(log_sum)
    return row_max.mul_(inv_temperature).add_(log_sum)


def _logsumexp(x: Tensor, scratch: Tensor) -> Tensor:
    """(n, 1) log-sum-exp of the rows of ``x``, leaving ``x`` untouched (exp goes to scratch)."""
    row_max = x.amax(dim=-1, keepdim=True)
    torch.sub(x, row_max, out=scratch).exp_()
    return scratch.sum(dim=-1, keepdim=True).log_().add_(row_max)


def _log_mixture(log_s: Tensor, log_t: Tensor, beta: float, out: Tensor) -> Tensor:
    """out := log((1-beta)*S + beta*T) = logaddexp(log S + log(1-beta), log T + log(beta)),
    computed as logaddexp(log S + log((1-beta)/beta), log T) + log(beta) to stay in ``out``."""
    torch.add(log_s, math.log1p(-beta) - math.log(beta), out=out)
    torch.logaddexp(out, log_t, out=out)
    return out.add_(math.log(beta))


def jsd_chunk_(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    inv_num_valid: Tensor,
    *,
    beta: float,
    temperature: float,
    ignore_index: int,
    weight_hard: float,
    weight_soft: float,
    compute_hard: bool,
) -> tuple[Tensor, Tensor]:
    """Loss and logits-gradient of one chunk of rows, in place.

    Args:
        student_logits: (n, Vs) float32 (float64 for float64 inputs) contiguous raw student
            logits, bias included. OVERWRITTEN with dLoss/dlogits, where
            ``Loss = weight_soft*soft + weight_hard*hard`` and both are already divided by the
            number of valid rows in the whole batch. Rows whose label is ``ignore_index`` get a
            zero gradient.
        teacher_logits: (n, Vt) raw teacher logits of the same dtype, ``Vt >= Vs``; when
            ``Vt > Vs`` the temperature-scaled student logits are padded with zeros to ``Vt``
            columns (Liger-Kernel's convention for a teacher vocabulary padded for efficiency).
            Used as scratch: its contents are undefined afterwards.
        labels: (n,) int64 class indices into the student vocabulary, or ``ignore_index``.
        inv_num_valid: 0-dim tensor of the logits' dtype, 1 / max(1, valid rows in the batch);
            it scales the losses and the gradient alike (the fused loss passes 1 for float16,
            whose range cannot hold a mean's per-row gradients, and divides later).
        beta: weight of the teacher in the mixture, in [0, 1]; 0 is KL(T||S), 1 is KL(S||T).
        temperature: positive; scales both logits for the soft loss only.
        ignore_index: label value of rows that are left out.
        weight_hard: weight of the hard (cross-entropy) loss in the gradient.
        weight_soft: weight of the soft (JSD) loss in the gradient.
        compute_hard: whether to compute the hard loss (and its gradient) at all.

    Returns:
        (soft_sum, hard_sum): 0-dim tensors, this chunk's unweighted soft and hard losses
        already multiplied by ``inv_num_valid`` (hard_sum is zero when not compute_hard).
    """
    vocab_s = student_logits.shape[1]
    valid, row_weight, safe_labels = _row_setup(labels, ignore_index, inv_num_valid)
    # The one extra (n, Vt) buffer: exponentials, then the per-element loss terms.
    scratch = torch.empty_like(teacher_logits)

    hard_sum = inv_num_valid.new_zeros(())
    hard_grad = compute_hard and weight_hard != 0.0
    if compute_hard:
        lse_hard = _logsumexp(student_logits, scratch[:, :vocab_s])
        hard_rows = lse_hard - student_logits.gather(1, safe_labels)
        hard_sum = _masked_sum(hard_rows, valid, inv_num_valid)

    if teacher_logits.shape[1] > vocab_s:
        # Pad with zeros: identical before or after dividing by the temperature.
        log_s = torch.zeros_like(teacher_logits)
        log_s[:, :vocab_s] = student_logits
    else:
        log_s = student_logits
    log_t = teacher_logits
    lse_s = _log_softmax_(log_s, scratch, 1.0 / temperature)
    _log_softmax_(log_t, scratch, 1.0 / temperature)

    def hard_probs(out: Tensor) -> Tensor:
        # softmax(z) from log S: z = tau * (log S + lse_s), so softmax(z) = exp(tau * log S +
        # tau * lse_s - lse_hard). Must run while log_s still holds log S.
        shift = lse_s * temperature - lse_hard
        return torch.add(shift, log_s[:, :vocab_s], alpha=temperature, out=out).exp_()

    # A teacher logit of -inf (a masked vocabulary entry) gives log T = -inf where T = 0; the
    # loss terms T * (log T - ...) clamp the difference so that 0 * (-inf) does not give NaN.
    finite_min = torch.finfo(scratch.dtype).min
    grad_scale = row_weight * (weight_soft / temperature)
    prob_hard = None
    if beta == 0.0:
        # KL(T||S) = sum T (log T - log S); gradient (S - T) / tau.
        torch.sub(log_t, log_s, out=scratch).clamp_(min=finite_min)
        prob_t = log_t.exp_()
        soft_rows = scratch.mul_(prob_t).sum(dim=-1, keepdim=True)
        if hard_grad:
            prob_hard = hard_probs(scratch[:, :vocab_s])
        log_s.exp_().sub_(prob_t).mul_(grad_scale)
    elif beta == 1.0:
        # KL(S||T) = sum S (log S - log T); gradient S * ((log S - log T) - KL) / tau.
        torch.sub(log_s, log_t, out=scratch)
        if hard_grad:
            prob_hard = hard_probs(log_t[:, :vocab_s])
        prob_s = log_s.exp_()
        soft_rows = scratch.mul_(prob_s).sum(dim=-1, keepdim=True)
        prob_s.mul_(-grad_scale * soft_rows).addcmul_(scratch, grad_scale)
    else:
        # beta * KL(T||M) + (1-beta) * KL(S||M); gradient (1-beta)/tau * S * (r - sum(S r)).
        log_m = _log_mixture(log_s, log_t, beta, out=scratch)
        torch.sub(log_t, log_m, out=scratch).clamp_(min=finite_min)
        prob_t = log_t.exp_()
        teacher_rows = scratch.mul_(prob_t).sum(dim=-1, keepdim=True)
        # log M is needed again for r. Recomputing log T from T costs two passes but saves a
        # fourth (n, Vt) buffer; log(exp(log T)) is exact to rounding wherever T is a normal
        # number, and where T underflows the mixture is dominated by S anyway.
        log_m = _log_mixture(log_s, prob_t.log_(), beta, out=scratch)
        ratio = torch.sub(log_s, log_m, out=scratch)  # r = log S - log M
        if hard_grad:
            prob_hard = hard_probs(log_t[:, :vocab_s])
        prob_s = log_s.exp_()
        student_rows = ratio.mul_(prob_s).sum(dim=-1, keepdim=True)
        soft_rows = beta * teacher_rows + (1.0 - beta) * student_rows
        grad_scale = grad_scale * (1.0 - beta)
        prob_s.mul_(-grad_scale * student_rows).addcmul_(ratio, grad_scale)
    soft_sum = _masked_sum(soft_rows, valid, inv_num_valid)

    grad = log_s[:, :vocab_s]
    if prob_hard is not None:
        hard_scale = row_weight * weight_hard
        grad.addcmul_(prob_hard, hard_scale).scatter_add_(1, safe_labels, -hard_scale)
    if log_s is not student_logits:
        student_logits.copy_(grad)
    return soft_sum, hard_sum


def cross_entropy_chunk_(
    logits: Tensor,
    labels: Tensor,
    inv_num_valid: Tensor,
    *,
    ignore_index: int,
    weight_hard: float,
) -> Tensor:
    """Hard loss only, for calls whose soft loss is neither weighted nor returned.

    ``logits`` (n, V) float32/float64 raw student logits, OVERWRITTEN with
    ``weight_hard * d(hard)/dlogits``; returns this chunk's unweighted hard loss times
    ``inv_num_valid`` as a 0-dim tensor. Needs no extra (n, V) buffer.
    """
    valid, row_weight, safe_labels = _row_setup(labels, ignore_index, inv_num_valid)
    target = logits.gather(1, safe_labels)
    row_max = logits.amax(dim=-1, keepdim=True)
    probs = logits.sub_(row_max).exp_()
    row_sum = probs.sum(dim=-1, keepdim=True)
    hard_rows = row_max + row_sum.log() - target
    hard_scale = row_weight * weight_hard
    probs.mul_(hard_scale / row_sum).scatter_add_(1, safe_labels, -hard_scale)
    return _masked_sum(hard_rows, valid, inv_num_valid)
