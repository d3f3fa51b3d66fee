"""Per-chunk math of the fused-linear JSD loss in plain PyTorch: the portable path.

Runs on any device PyTorch runs on (CPU, CUDA, Ascend NPU, ...). Nothing builds an autograd
graph and nothing reads a tensor value on the host. The rows of a chunk are processed in
slices of a few hundred rows: every step is one PyTorch op (``log_softmax``, ``softmax``,
``entr``, ``xlogy``, ``addcmul`` ...) that reads its inputs once and writes into one of four
or five slice-sized scratch buffers, so the chunk needs no ``(n, V)`` buffer besides its two
logits tensors. For ``0 < beta < 1`` a slice takes fifteen passes over its rows, about 32
float32 reads and writes per logit; the last op writes the gradient over the teacher logits,
rounded once to their dtype, ready for the matmuls. The math is for the summed loss, so every
scale factor is a Python number (a device scalar such as 1/num_valid would send the
elementwise ops down PyTorch's broadcasting path, up to twice as slow), and rows whose label
is ``ignore_index`` are left out of the losses but not masked in the gradient: the caller
drops them.

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

The mixture's loss is evaluated from the same three sums, ``beta*sum(T log T) +
(1-beta)*sum(S log S) - sum(M log M)``, each accurate to a few ulps of its magnitude: the
absolute error (~1e-6 for entropies near log V) is the one log-space float32 math has anyway.
``entr`` (``-x log x``) and ``xlogy`` (``x log y``), both 0 where ``x`` is 0, keep teacher
probabilities of exactly zero (a masked vocabulary entry) from turning ``0 * log 0`` into NaN.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Rows per slice: a slice buffer holds about this many elements (128 MiB in float32, 256 rows
# of the Llama-3 vocabulary). The slices bound the scratch memory (four or five buffers) to a
# fraction of a chunk's logits; much smaller slices would leave the device waiting for the
# host to launch their ops (benchmarks/tune_chunk.py sweeps the size).
SLICE_ELEMENTS = 1 << 25


def _row_setup(labels: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(valid, safe_labels), each (n, 1): the mask of rows that count, and labels with
    ignored rows pointed at class 0 so that gather and scatter stay in range."""
    valid = (labels != ignore_index).unsqueeze(1)
    return valid, labels.unsqueeze(1).masked_fill(~valid, 0)


def accurate_sum(values: Tensor) -> Tensor:
    """Sum of a 1-D tensor to about one rounding step of the result.

    A plain float32 sum of a few hundred row losses is off by a few ulps; one correction with
    the residuals ``values - mean`` (much smaller numbers, so summed with much smaller absolute
    error) recovers them. Two extra passes over n numbers, no host sync. An infinite total
    (an infinite KL) stays infinite rather than turning into inf - inf = NaN."""
    total = values.sum()
    correction = (values - total / max(values.numel(), 1)).sum()
    return torch.where(total.isfinite(), total + correction, total)


def _masked_sum(rows: Tensor, valid: Tensor) -> Tensor:
    """Sum of the per-row values of the valid rows as a 0-dim tensor.

    torch.where rather than a multiplication by the mask, so an ignored row whose loss is inf
    or NaN (nothing stops that) cannot turn the sum into NaN."""
    return accurate_sum(torch.where(valid, rows, 0.0).flatten())


def _row_sum(x: Tensor) -> Tensor:
    return x.sum(dim=-1, keepdim=True)


def _shares_softmax(temperature: float, vocab_s: int, vocab_t: int) -> bool:
    """Whether softmax(z), the hard loss's, is S itself (no scaling, no padding)."""
    return temperature == 1.0 and vocab_t == vocab_s


def _slice_(
    student: Tensor,
    teacher: Tensor,
    labels: Tensor,
    buffers: Tensor,
    *,
    beta: float,
    temperature: float,
    weight_hard: float,
    weight_soft: float,
    compute_hard: bool,
) -> tuple[Tensor, Tensor | None]:
    """Row losses of a slice of ``r`` rows; writes the gradient into ``teacher[:, :Vs]``.

    ``student`` (r, Vs) raw logits in the work dtype (read only), ``teacher`` (r, Vt) raw
    logits in any floating dtype, ``labels`` (r, 1) from :func:`_row_setup`, ``buffers``
    (4 or 5, R >= r, Vt) scratch in the work dtype, the fifth for the unscaled softmax when
    :func:`_shares_softmax` is False and the hard loss is computed. Returns the (r, 1) soft
    and hard losses (hard None when not ``compute_hard``), unweighted and unmasked.
    """
    rows, vocab_s = student.shape
    vocab_t = teacher.shape[1]
    log_s, buf_a, buf_b, buf_c, *buf_p = (b[:rows] for b in buffers.unbind(0))
    inv_tau = 1.0 / temperature
    shared = _shares_softmax(temperature, vocab_s, vocab_t)
    hard_grad = compute_hard and weight_hard != 0.0

    # log S, the scaled student logits zero-padded to the teacher's width (padding with zeros
    # is the same before or after scaling).
    if shared:
        torch.log_softmax(student, -1, out=log_s)
    else:
        torch.mul(student, inv_tau, out=buf_a[:, :vocab_s])
        buf_a[:, vocab_s:].zero_()
        torch.log_softmax(buf_a, -1, out=log_s)

    hard_rows = prob_hard = None
    if compute_hard:
        log_p = log_s if shared else torch.log_softmax(student, -1, out=buf_p[0][:, :vocab_s])
        hard_rows = log_p.gather(1, labels).neg_()
        if hard_grad and not shared:
            prob_hard = log_p.exp_()

    def teacher_(fn: object, out: Tensor, tmp: Tensor) -> Tensor:
        # (log-)softmax of teacher / tau in the work dtype. A low-precision teacher is copied
        # first: softmax(dtype=) would convert it into a temporary anyway, more slowly.
        source = teacher
        if temperature != 1.0 or teacher.dtype != out.dtype:
            source = tmp.copy_(teacher)
            if temperature != 1.0:
                source.mul_(inv_tau)
        return fn(source, -1, out=out)  # type: ignore[operator]

    # The hard loss's share of the coefficient of S in the gradient.
    shared_hard = weight_hard if shared and hard_grad else 0.0
    entr = torch.special.entr  # -x log x, 0 at x = 0
    if beta == 0.0:
        # KL(T||S) = sum T log T - sum T log S; gradient (S - T) / tau.
        grad_scale = weight_soft / temperature
        prob_t = teacher_(torch.softmax, buf_a, buf_b)
        neg_t_log_t = _row_sum(entr(prob_t, out=buf_b))
        t_log_s = _row_sum(torch.mul(prob_t, log_s, out=buf_b))
        soft_rows = -neg_t_log_t - t_log_s
        grad = log_s.exp_().mul_(grad_scale + shared_hard)
        last_term, last_scale = prob_t, -grad_scale
    elif beta == 1.0:
        # KL(S||T) = sum S (log S - log T); gradient S * ((log S - log T) - KL) / tau.
        grad_scale = weight_soft / temperature
        log_t = teacher_(torch.log_softmax, buf_a, buf_b)
        # Where T is exactly 0, log T = -inf; clamped, an underflowed S there adds 0 rather
        # than 0 * inf = NaN (an S above 0 makes the KL overflow to inf, as it should).
        diff = torch.sub(log_s, log_t.clamp_min_(torch.finfo(log_t.dtype).min), out=buf_a)
        prob_s = torch.exp(log_s, out=buf_b)
        s_diff = torch.mul(prob_s, diff, out=buf_c)
        soft_rows = _row_sum(s_diff)
        # grad_scale * S * diff + (shared_hard - grad_scale * KL) * S
        grad = prob_s.mul_(shared_hard - grad_scale * soft_rows)
        last_term, last_scale = s_diff, grad_scale
    else:
        # beta * KL(T||M) + (1-beta) * KL(S||M) = beta sum T log T + (1-beta) sum S log S
        # - sum M log M; gradient (1-beta)/tau * S * (r - k), r = log S - log M, k = sum(S r).
        # M enters as M/beta = T + (1-beta)/beta * S (one op), its log beta added to the sums.
        grad_scale = weight_soft * (1.0 - beta) / temperature
        log_beta = math.log(beta)
        prob_s = torch.exp(log_s, out=buf_a)
        neg_s_log_s = entr(prob_s, out=buf_b)
        s_log_s = -_row_sum(neg_s_log_s)
        prob_t = teacher_(torch.softmax, log_s, buf_c)  # log S is not needed any more
        t_log_t = -_row_sum(entr(prob_t, out=buf_c))
        mix = prob_t.add_(prob_s, alpha=(1.0 - beta) / beta)
        m_log_m = log_beta - beta * _row_sum(entr(mix, out=buf_c))
        # -S r - S log beta = -S log S + S log(M/beta), summed as such for an accurate k.
        neg_r_term = neg_s_log_s.add_(torch.special.xlogy(prob_s, mix, out=buf_c))
        k = -_row_sum(neg_r_term) - log_beta
        soft_rows = beta * t_log_t + (1.0 - beta) * s_log_s - m_log_m
        # grad_scale * S * (r - k) = -grad_scale * neg_r_term - grad_scale * (log beta + k) * S
        grad = prob_s.mul_(shared_hard - grad_scale * (log_beta + k))
        last_term, last_scale = neg_r_term, -grad_scale

    if hard_grad:
        grad.scatter_add_(1, labels, grad.new_full(labels.shape, -weight_hard))
        if prob_hard is not None:
            grad[:, :vocab_s].add_(prob_hard, alpha=weight_hard)
    # The last op writes the gradient over the teacher logits, rounded once to their dtype.
    torch.add(grad[:, :vocab_s], last_term[:, :vocab_s], alpha=last_scale, out=teacher[:, :vocab_s])
    return soft_rows, hard_rows


def _chunk_(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    slice_rows: int | None,
    *,
    ignore_index: int,
    compute_hard: bool,
    **options: float,
) -> tuple[Tensor, Tensor]:
    """:func:`jsd_chunk_` in slices of ``slice_rows`` rows, or in one piece for None."""
    rows, vocab_t = teacher_logits.shape
    valid, safe_labels = _row_setup(labels, ignore_index)
    shared = _shares_softmax(options["temperature"], student_logits.shape[1], vocab_t)
    num_buffers = 4 if shared or not compute_hard else 5
    if slice_rows is None:
        buffers = student_logits.new_empty((num_buffers, rows, vocab_t))
        soft_rows, hard_rows = _slice_(
            student_logits,
            teacher_logits,
            safe_labels,
            buffers,
            compute_hard=compute_hard,
            **options,
        )
    else:
        buffers = student_logits.new_empty((num_buffers, min(slice_rows, rows), vocab_t))
        soft_rows = student_logits.new_empty((rows, 1))
        hard_rows = student_logits.new_empty((rows, 1)) if compute_hard else None
        for start in range(0, rows, slice_rows):
            part = slice(start, start + slice_rows)
            soft, hard = _slice_(
                student_logits[part],
                teacher_logits[part],
                safe_labels[part],
                buffers,
                compute_hard=compute_hard,
                **options,
            )
            soft_rows[part] = soft
            if hard_rows is not None and hard is not None:
                hard_rows[part] = hard
    soft_sum = _masked_sum(soft_rows, valid)
    if hard_rows is None:
        return soft_sum, torch.zeros_like(soft_sum)
    return soft_sum, _masked_sum(hard_rows, valid)


def jsd_chunk_(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    *,
    beta: float,
    temperature: float,
    ignore_index: int,
    weight_hard: float,
    weight_soft: float,
    compute_hard: bool,
) -> tuple[Tensor, Tensor]:
    """Summed losses and logits-gradient of one chunk; the gradient goes over the teacher logits.

    Args:
        student_logits: (n, Vs) float32 (float64 for float64 inputs) raw student logits,
            bias included. Left as they are.
        teacher_logits: (n, Vt) raw teacher logits in any floating dtype (the matmul's),
            ``Vt >= Vs``, read in the student's dtype; when ``Vt > Vs`` the temperature-scaled
            student logits are padded with zeros to ``Vt`` columns (Liger-Kernel's convention
            for a teacher vocabulary padded for efficiency). OVERWRITTEN: the first ``Vs``
            columns receive d(Loss)/dlogits, rounded once to the teacher's dtype, where
            ``Loss = weight_soft * soft + weight_hard * hard`` summed over the valid rows; the
            other columns are left as they are. Rows whose label is ``ignore_index`` receive
            unspecified values (finite for finite logits): the caller drops them.
        labels: (n,) int64 class indices into the student vocabulary, or ``ignore_index``.
        beta: weight of the teacher in the mixture, in [0, 1]; 0 is KL(T||S), 1 is KL(S||T).
        temperature: positive; scales both logits for the soft loss only.
        ignore_index: label value of rows that are left out.
        weight_hard: weight of the hard (cross-entropy) loss in the gradient.
        weight_soft: weight of the soft (JSD) loss in the gradient.
        compute_hard: whether to compute the hard loss (and its gradient) at all.

    Returns:
        (soft_sum, hard_sum): 0-dim tensors, this chunk's unweighted soft and hard losses
        summed over its valid rows (hard_sum is zero when not compute_hard).
    """
    return _chunk_(
        student_logits,
        teacher_logits,
        labels,
        max(1, SLICE_ELEMENTS // teacher_logits.shape[1]),
        beta=beta,
        temperature=temperature,
        ignore_index=ignore_index,
        weight_hard=weight_hard,
        weight_soft=weight_soft,
        compute_hard=compute_hard,
    )


def jsd_chunk_unsliced_(
    student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, **options: object
) -> tuple[Tensor, Tensor]:
    """:func:`jsd_chunk_` as one slice: what ``torch.compile`` fuses (it needs no slices to
    keep intermediates out of memory, and a loop over a dynamic row count would not trace)."""
    return _chunk_(student_logits, teacher_logits, labels, None, **options)  # type: ignore[arg-type]


def cross_entropy_chunk_(
    logits: Tensor, labels: Tensor, *, ignore_index: int, weight_hard: float
) -> Tensor:
    """Hard loss only, for calls whose soft loss is neither weighted nor returned.

    ``logits`` (n, V) float32/float64 raw student logits, OVERWRITTEN with
    ``weight_hard * d(hard)/dlogits`` of the hard loss summed over the valid rows (ignored
    rows: unspecified, as in :func:`jsd_chunk_`); returns this chunk's unweighted hard loss
    summed over its valid rows, as a 0-dim tensor. Needs no extra (n, V) buffer.
    """
    valid, safe_labels = _row_setup(labels, ignore_index)
    target = logits.gather(1, safe_labels)
    row_max = logits.amax(dim=-1, keepdim=True)
    probs = logits.sub_(row_max).exp_()
    row_sum = probs.sum(dim=-1, keepdim=True)
    hard_rows = row_max + row_sum.log() - target
    probs.mul_(weight_hard / row_sum)
    probs.scatter_add_(1, safe_labels, probs.new_full(safe_labels.shape, -weight_hard))
    return _masked_sum(hard_rows, valid)
