"""Per-chunk math of the fused-linear JSD loss in plain PyTorch: the portable path.

Runs on any device PyTorch runs on (CPU, CUDA, Ascend NPU, ...). Nothing builds an autograd
graph and nothing reads a tensor value on the host. The rows of a chunk are processed in
slices of a few hundred rows: every step is one PyTorch op (``log_softmax``, ``exp``,
``expm1``, ``xlog1py``, ``sum`` ...) that reads its inputs once and writes into the teacher or
student logits (scratch once read) or a slice-sized buffer, so the chunk needs no ``(n, V)``
buffer besides its two logits tensors. For ``0 < beta < 1`` a slice takes sixteen passes over
its rows, about 35 float32 reads and writes per logit; the last op writes the gradient,
rounded once to the matmul dtype. The math is for the summed loss, so every scale factor is a
Python number (a device scalar such as 1/num_valid would send the elementwise ops down
PyTorch's broadcasting path, up to twice as slow), and rows whose label is ``ignore_index``
are left out of the losses but not masked in the gradient: the caller drops them. The fused
loss hands this path float32 teacher logits (a bfloat16 teacher would cost a conversion pass
per slice) and has the bfloat16 gradient packed at the start of their storage.

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

The loss is not evaluated as that difference of entropies: late in distillation, with the
student close to the teacher, the divergence is tiny next to entropies of up to log V, and
their float32 difference keeps few of its digits (2e-2 off at a per-row JSD of 2e-6). Every
term is built from ``d = log T - log S`` per element instead, which is small there and exact
to the rounding of the log-probabilities: with ``b = beta * expm1(d)`` and
``L = log(M / S) = log1p(b)`` (so ``r = -L``),

- ``0 < beta < 1``: ``beta * sum(T d) - sum(S L) - sum(S L b)`` (= ``beta sum(T d) -
  sum(M L)``, since ``M = S (1 + b)``);
- ``beta = 0``: ``sum(T d) + sum(S - T)``; ``beta = 1``: ``-sum(S d) - sum(S - T)``.

Per element these are ``beta (T log(T/M) - T + M) + (1-beta) (S log(S/M) - S + M)`` and the
generalised KL ``a log(a/b) - a + b``: non-negative, of second order in ``d``, and unmoved to
first order by the rounding of the log-sum-exps (the ``sum(S - T)`` terms, zero in exact
arithmetic, cancel theirs). A teacher probability of exactly zero (a masked vocabulary entry,
``d = -inf``) makes ``T d`` NaN, which ``nansum`` counts as the zero it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._options import LossOptions

# Rows per slice: a slice buffer holds at most about this many elements (256 MiB in float32,
# 523 rows of the Llama-3 vocabulary; a chunk is cut into equal slices below that). The
# slices bound the scratch memory (one buffer for bf16 inputs at temperature 1, up to four)
# to a fraction of a chunk's logits; smaller slices run slower (the figures are in
# benchmarks/results/h200/design-notes.md).
SLICE_ELEMENTS = 1 << 26


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


def masked_sum(rows: Tensor, valid: Tensor) -> Tensor:
    """Sum of the per-row values of the valid rows as a 0-dim tensor.

    torch.where rather than a multiplication by the mask, so an ignored row whose loss is inf
    or NaN (nothing stops that) cannot turn the sum into NaN."""
    return accurate_sum(torch.where(valid, rows, 0.0).flatten())


def _soft_loss_terms(beta: float) -> tuple[float, ...]:
    """Coefficients: a row's soft loss from the row sums :func:`_slice_` records.

    With ``d = log T - log S`` per element (see the module docstring):
    beta = 0: [sum T d, sum(S - T)], KL(T||S) = sum(T d - T + S);
    beta = 1: [sum S d, sum(S - T)], KL(S||T) = sum(-S d + T - S);
    otherwise: [sum T d, sum S L, sum S L b], ``L = log1p(b)``, ``b = beta * expm1(d)``:
    beta * sum(T d) - sum(M L), with M L = S L (1 + b).
    """
    if beta == 0.0:
        return (1.0, 1.0)
    if beta == 1.0:
        return (-1.0, -1.0)
    return (beta, -1.0, -1.0)


def _whole_row(row_sums: Tensor) -> Tensor:
    return row_sums


def soft_terms_(
    log_t: Tensor,
    diff: Tensor,
    prob_s: Tensor,
    sums: Tensor,
    *,
    options: LossOptions,
    shared_hard: float = 0.0,
    whole_row: Callable[[Tensor], Tensor] = _whole_row,
) -> tuple[Tensor, Tensor, float]:
    """The soft loss's row sums and its gradient's terms for ``r`` rows of log-probabilities.

    ``log_t`` (r, V) is log T, ``diff`` (r, V) is d = log T - log S and ``prob_s`` (r, V) is S,
    each in its own buffer, all three used as scratch. The row sums of
    :func:`_soft_loss_terms` go into ``sums`` (k, r). Returns ``(grad, last_term,
    last_scale)``: the gradient with respect to the logits is ``grad + last_scale *
    last_term``, ``grad`` lying in ``prob_s`` (with ``shared_hard`` S of the hard loss's
    gradient, where it shares S's softmax) and ``last_term`` in ``log_t``, so the caller adds
    the hard loss's other terms to ``grad`` and writes the sum where it wants it, rounded once.

    The gradient needs K, a sum over the whole row (``sum(S L)``, ``sum(S d)``): these rows
    may be one shard of the vocabulary, and ``whole_row`` turns a (r, 1) sum over the shard
    into the whole row's (an all-reduce over the shards, _vocab_parallel_chunk.py), without
    changing its argument; the row sums in ``sums`` stay the shard's.
    """
    beta, temperature, weight_soft = options.beta, options.temperature, options.weight_soft
    if beta == 0.0:
        # KL(T||S) = sum(T d) + sum(S - T) (each term small where S ~ T; sum S and sum T
        # apart would each carry a rounding of 1); gradient (S - T) / tau.
        prob_t = log_t.exp_()
        torch.nansum(diff.mul_(prob_t), -1, out=sums[0])
        s_minus_t = torch.sub(prob_s, prob_t, out=prob_t)
        torch.sum(s_minus_t, -1, out=sums[1])
        return prob_s.mul_(shared_hard), s_minus_t, weight_soft / temperature
    if beta == 1.0:
        # KL(S||T) = -sum(S d) - sum(S - T); gradient S * (-d + K) / tau, K = sum(S d). d is
        # clamped where T is exactly 0 (d = -inf), whose S d would otherwise be NaN.
        grad_scale = weight_soft / temperature
        torch.sum(torch.sub(prob_s, log_t.exp_(), out=log_t), -1, out=sums[1])
        diff.clamp_min_(torch.finfo(diff.dtype).min)
        s_diff = torch.mul(diff, prob_s, out=log_t)
        k = whole_row(torch.sum(s_diff, -1, keepdim=True, out=sums[0].unsqueeze(1)))
        # grad_scale * S * K + shared_hard * S - grad_scale * S d
        return prob_s.mul_(k.mul(grad_scale).add_(shared_hard)), s_diff, -grad_scale
    # beta * KL(T||M) + (1-beta) * KL(S||M) = beta sum(T d) - sum(M L), L = log(M / S)
    # = log1p(b), b = beta expm1(d), M = S (1 + b); gradient (1-beta)/tau * S * (K - L),
    # K = sum(S L). Every term is small where S ~ T, none a difference of large ones. T d is
    # NaN where T is exactly 0 (d = -inf): nansum counts it as the 0 it is.
    grad_scale = weight_soft * (1.0 - beta) / temperature
    torch.nansum(log_t.exp_().mul_(diff), -1, out=sums[0])
    mix_ratio = diff.expm1_().mul_(beta)  # b
    s_log = torch.special.xlog1py(prob_s, mix_ratio, out=log_t)  # S L
    k = whole_row(torch.sum(s_log, -1, keepdim=True, out=sums[1].unsqueeze(1)))
    torch.sum(mix_ratio.mul_(s_log), -1, out=sums[2])
    return prob_s.mul_(k.mul(grad_scale).add_(shared_hard)), s_log, -grad_scale


def soft_rows(sums: Tensor, beta: float) -> Tensor:
    """Each row's soft loss from the row sums :func:`soft_terms_` records."""
    rows = torch.zeros_like(sums[0])
    for coefficient, row_sums in zip(_soft_loss_terms(beta), sums):
        rows.add_(row_sums, alpha=coefficient)
    return rows


def _slice_(
    student: Tensor,
    teacher: Tensor,
    labels: Tensor,
    grad_out: Tensor,
    sums: Tensor,
    label_log_p: Tensor | None,
    buffers: list[Tensor],
    *,
    options: LossOptions,
) -> None:
    """One slice of ``r`` rows: the row sums of :func:`_soft_loss_terms` into ``sums``
    (3, r), log softmax(z) at the label into ``label_log_p`` (r, 1) when the hard loss is
    computed, and the gradient into ``grad_out`` (r, Vs).

    ``student`` (r, Vs) raw logits in the work dtype and ``teacher`` (r, Vt) raw logits in any
    floating dtype are both used as scratch; ``labels`` (r, 1) from :func:`_row_setup`;
    ``buffers`` from :func:`_slice_buffers`. ``grad_out`` may lie in the teacher logits' storage
    (row i within rows 0..i): it is written last, by an op that reads neither logits tensor.
    """
    temperature, weight_hard = options.temperature, options.weight_hard
    rows, vocab_s = student.shape
    vocab_t = teacher.shape[1]
    views = [b[:rows] for b in buffers]
    work, taken = views[0], 1
    shared = options.shares_softmax(vocab_s, vocab_t)
    hard_grad = label_log_p is not None and weight_hard != 0.0

    # The teacher first, in the work dtype (copied when it comes in another) and scaled in
    # place: log T goes to the work buffer, and the teacher logits are scratch from then on.
    scratch = teacher
    if teacher.dtype != work.dtype:
        scratch, taken = views[taken].copy_(teacher), taken + 1
    if temperature != 1.0:
        scratch.mul_(1.0 / temperature)
    log_t = torch.log_softmax(scratch, -1, out=work)

    # log S of the scaled student logits zero-padded to the teacher's width (padding with
    # zeros is the same before or after scaling). ``prob_s`` is where S will be: the student
    # logits once log S is taken from them, else log S's own buffer, exponentiated in place.
    prob_hard = None
    if shared:
        log_s = torch.log_softmax(student, -1, out=scratch)
        prob_s = student
        if label_log_p is not None:
            label_log_p.copy_(log_s.gather(1, labels))
    else:
        if label_log_p is not None:
            prob_hard = torch.log_softmax(student, -1, out=views[-1][:, :vocab_s])
            label_log_p.copy_(prob_hard.gather(1, labels))
            prob_hard.exp_()
        torch.mul(student, 1.0 / temperature, out=scratch[:, :vocab_s])
        scratch[:, vocab_s:].zero_()
        log_s = torch.log_softmax(scratch, -1, out=student if vocab_t == vocab_s else views[taken])
        prob_s = log_s

    # d = log T - log S goes to the scratch (over log S itself when that lies there), S next
    # to it.
    if shared:
        prob_s = torch.exp(log_s, out=prob_s)
        diff = torch.sub(log_t, log_s, out=scratch)
    else:
        diff = torch.sub(log_t, log_s, out=scratch)
        prob_s = prob_s.exp_()
    # The coefficient of S in the hard loss's gradient, S - onehot(label), when S is softmax(z).
    # The gradient's two terms never lie in the scratch, since grad_out may.
    shared_hard = weight_hard if shared and hard_grad else 0.0
    grad, last_term, last_scale = soft_terms_(
        log_t, diff, prob_s, sums, options=options, shared_hard=shared_hard
    )

    if hard_grad:
        grad.scatter_add_(1, labels, grad.new_full(labels.shape, -weight_hard))
        if prob_hard is not None:
            grad[:, :vocab_s].add_(prob_hard, alpha=weight_hard)
    # The last op writes the gradient, rounded once to grad_out's dtype.
    torch.add(grad[:, :vocab_s], last_term[:, :vocab_s], alpha=last_scale, out=grad_out)


def _slice_buffers(
    student_logits: Tensor,
    teacher_logits: Tensor,
    rows: int,
    options: LossOptions,
) -> list[Tensor]:
    """Scratch for :func:`_slice_`, (rows, Vt) in the work dtype, in the order it takes them:
    one work buffer; one for the teacher logits when they come in another dtype (they are
    scratch otherwise); and when the hard loss cannot share S's softmax, one for log S if the
    student logits are narrower than the teacher's (they hold it otherwise) and one for the
    unscaled softmax if the hard loss is computed."""
    vocab_s, vocab_t = student_logits.shape[1], teacher_logits.shape[1]
    shared = options.shares_softmax(vocab_s, vocab_t)
    count = 1 + (teacher_logits.dtype != student_logits.dtype)
    count += (not shared and vocab_t != vocab_s) + (options.compute_hard and not shared)
    return list(student_logits.new_empty((count, rows, vocab_t)).unbind(0))


def _chunk_(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    grad_out: Tensor,
    slice_rows: int,
    *,
    options: LossOptions,
) -> tuple[Tensor, Tensor]:
    """:func:`jsd_chunk_` in slices of ``slice_rows`` rows."""
    rows = teacher_logits.shape[0]
    valid, safe_labels = _row_setup(labels, options.ignore_index)
    coefficients = _soft_loss_terms(options.beta)
    sums = student_logits.new_empty((len(coefficients), rows))
    label_log_p = student_logits.new_empty((rows, 1)) if options.compute_hard else None
    buffers = _slice_buffers(student_logits, teacher_logits, min(slice_rows, rows), options)
    for start in range(0, rows, slice_rows):
        part = slice(start, start + slice_rows)
        _slice_(
            student_logits[part],
            teacher_logits[part],
            safe_labels[part],
            grad_out[part],
            sums[:, part],
            None if label_log_p is None else label_log_p[part],
            buffers,
            options=options,
        )
    soft_sum = masked_sum(soft_rows(sums, options.beta).unsqueeze(1), valid)
    if label_log_p is None:
        return soft_sum, torch.zeros_like(soft_sum)
    return soft_sum, -masked_sum(label_log_p, valid)


def jsd_chunk_(
    student_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    *,
    grad_out: Tensor,
    options: LossOptions,
) -> tuple[Tensor, Tensor]:
    """Summed losses and logits-gradient of one chunk of rows.

    Args:
        student_logits: (n, Vs) float32 (float64 for float64 inputs) contiguous raw student
            logits, bias included. Used as scratch: undefined afterwards.
        teacher_logits: (n, Vt) contiguous raw teacher logits, ``Vt >= Vs``, best in the
            student's dtype (a low-precision teacher costs a conversion pass); when
            ``Vt > Vs`` the temperature-scaled student logits are padded with zeros to ``Vt``
            columns (Liger-Kernel's convention for a teacher vocabulary padded for
            efficiency). Used as scratch: undefined afterwards, but for ``grad_out``.
        labels: (n,) int64 class indices into the student vocabulary, or
            ``options.ignore_index``.
        grad_out: (n, Vs), any floating dtype: receives d(Loss)/dlogits, rounded once, where
            ``Loss = weight_soft * soft + weight_hard * hard`` summed over the valid rows.
            Rows whose label is ``ignore_index`` receive unspecified values (finite for finite
            logits): the caller drops them. It may share storage with ``teacher_logits`` if
            each of its rows lies within the rows of the teacher logits up to the same one
            (the fused loss packs the bfloat16 gradient at the start of the float32 teacher
            logits' storage): slices are written in order, each after the teacher logits of
            its rows (and so of every row before) are read.
        options: beta, temperature, ignore_index, the weights, and whether to compute the hard
            loss (:class:`~gradref_kernels._options.LossOptions`).

    Returns:
        (soft_sum, hard_sum): 0-dim tensors, this chunk's unweighted soft and hard losses
        summed over its valid rows (hard_sum is zero when not compute_hard).
    """
    rows, vocab_t = teacher_logits.shape
    slices = -(-rows // max(1, SLICE_ELEMENTS // vocab_t))
    return _chunk_(
        student_logits,
        teacher_logits,
        labels,
        grad_out,
        max(1, -(-rows // max(1, slices))),
        options=options,
    )


def scaled_cast(
    source: Tensor, scale: Tensor, dtype: torch.dtype, out: Tensor | None = None
) -> Tensor:
    """``(source * scale).to(dtype)`` rounded once, into ``out`` if given: one multiplication
    in the source's dtype whose result is cast as it is stored (the twin of
    ``_chunk_triton.scaled_cast``). ``scale`` is a 0-dim tensor on source's device."""
    if out is None:
        out = torch.empty(source.shape, dtype=dtype, device=source.device)
    return torch.mul(source, scale, out=out)


def cross_entropy_chunk_(logits: Tensor, labels: Tensor, *, options: LossOptions) -> Tensor:
    """Hard loss only, for calls whose soft loss is neither weighted nor returned.

    ``logits`` (n, V) float32/float64 raw student logits, OVERWRITTEN with
    ``weight_hard * d(hard)/dlogits`` of the hard loss summed over the valid rows (ignored
    rows: unspecified, as in :func:`jsd_chunk_`); returns this chunk's unweighted hard loss
    summed over its valid rows, as a 0-dim tensor. Needs no extra (n, V) buffer.
    """
    valid, safe_labels = _row_setup(labels, options.ignore_index)
    target = logits.gather(1, safe_labels)
    row_max = logits.amax(dim=-1, keepdim=True)
    probs = logits.sub_(row_max).exp_()
    row_sum = probs.sum(dim=-1, keepdim=True)
    hard_rows = row_max + row_sum.log() - target
    probs.mul_(options.weight_hard / row_sum)
    probs.scatter_add_(1, safe_labels, probs.new_full(safe_labels.shape, -options.weight_hard))
    return masked_sum(hard_rows, valid)
