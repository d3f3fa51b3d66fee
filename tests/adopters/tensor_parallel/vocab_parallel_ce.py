"""vocab_parallel_ce: a tensor-parallel cross-entropy, the logits sharded along the vocabulary.

It stands for the vocab-parallel cross-entropy of a training library (Megatron-LM's
``vocab_parallel_cross_entropy``, Liger-Kernel's tests of it), written the way those are: an
``autograd.Function`` over this rank's shard of the logits, torch.distributed collectives on a
process group (the default one unless given), and a small functional and ``nn.Module`` API.
It imports nothing from the test plugin: it is the code under test.

Each rank of the group holds the columns ``[start, start + v)`` of the full ``(..., V)`` logits,
the ranks' shards contiguous and in rank order; the shards may differ in size (``torch.chunk``
and DTensor's ``Shard(-1)`` cut a vocabulary the world size does not divide), and each must
hold at least one column. ``target`` is the same full tensor on every rank (class indices into
the full vocabulary). The loss returned is the full loss, the same on every rank.

Communication per call, every all-reduce over ``group``, in this order:

1. SUM of ``W`` int64 (``W`` ranks): each rank's vocabulary size, which gives this rank's
   ``start`` and the full ``V``;
2. MAX of the row maxima (float32, one per row);
3. SUM of the target logit (shifted by the row maximum), which only the rank holding the
   target's column contributes (the others add 0);
4. SUM of the shifted sum-exp;
5. with ``label_smoothing > 0``, SUM of the shifted logits' sum over the vocabulary.

Backward is local, no communication: this rank's columns of
``softmax - (1 - eps) onehot(target) - eps / V``, times the row's incoming gradient, zero on
ignored rows. Everything is computed in float32 (float64 for float64 logits); the loss comes
back in the logits' dtype, as ``torch.nn.functional.cross_entropy``'s does, and the gradient
too, rounded once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["VocabParallelCrossEntropy", "vocab_parallel_cross_entropy", "vocab_range"]

REDUCTIONS = ("mean", "sum", "none")


def vocab_range(
    local_vocab: int, group: dist.ProcessGroup | None, device: torch.device
) -> tuple[int, int, int]:
    """``(start, end, full_vocab)``: this rank's columns of the full vocabulary, from every
    rank's shard size (one all-reduce of ``W`` int64 on ``device``, so the shards may differ in
    size). Every rank raises the same ValueError where a rank holds no columns."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    sizes = torch.zeros(world_size, dtype=torch.int64, device=device)
    sizes[rank] = local_vocab
    dist.all_reduce(sizes, group=group)
    counts: list[int] = sizes.tolist()
    if 0 in counts:
        raise ValueError(
            f"rank {counts.index(0)} of {world_size} holds no vocabulary columns (the shards "
            f"hold {counts}): every rank must hold at least one (torch.chunk and DTensor's "
            "Shard leave the last ranks empty when the vocabulary is small for the world "
            "size); use fewer ranks"
        )
    start = sum(counts[:rank])
    return start, start + local_vocab, sum(counts)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """forward(logits, target, group, ignore_index, label_smoothing): the per-row loss, float32
    (float64 for float64 logits), 0 on ignored rows; backward: this rank's slice of the logits'
    gradient, in the logits' dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        target: Tensor,
        group: dist.ProcessGroup | None,
        ignore_index: int,
        label_smoothing: float,
    ) -> Tensor:
        start, end, vocab = vocab_range(logits.shape[-1], group, logits.device)
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))

        row_max = x.amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = x - row_max.unsqueeze(-1)

        # The target's logit, on the rank whose columns hold it; 0 elsewhere.
        elsewhere = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(elsewhere, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(elsewhere, 0.0)
        dist.all_reduce(target_logit, group=group)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        log_sum_exp = sum_exp.log()

        loss = log_sum_exp - target_logit
        if label_smoothing > 0.0:
            # eps times the mean over the vocabulary of -log_softmax.
            sum_logits = shifted.sum(dim=-1)
            dist.all_reduce(sum_logits, group=group)
            smooth = log_sum_exp - sum_logits / vocab
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        ignored = target == ignore_index
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, elsewhere, ignored)
        ctx.label_smoothing = label_smoothing
        ctx.vocab = vocab
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        softmax, local_target, elsewhere, ignored = ctx.saved_tensors
        # In place on the saved softmax, as Megatron's backward does: a second backward
        # (retain_graph=True) raises autograd's in-place error rather than reading a changed one.
        grad = softmax
        eps = ctx.label_smoothing
        if eps > 0.0:
            grad.sub_(eps / ctx.vocab)
        onehot = (~elsewhere).to(grad.dtype) * (1.0 - eps)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot.unsqueeze(-1))
        scale = grad_loss.to(grad.dtype).masked_fill(ignored, 0.0)
        grad.mul_(scale.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Cross-entropy of the full logits, given this rank's shard of them.

    Args:
        logits: ``(..., v)``, this rank's columns of the full ``(..., V)`` logits.
        target: ``(...)``, class indices into the full vocabulary, the same on every rank;
            rows equal to ``ignore_index`` add nothing to the loss.
        ignore_index, reduction, label_smoothing: as ``torch.nn.functional.cross_entropy``'s
            (``mean`` divides by the rows not ignored).
        group: the process group the vocabulary is sharded over; default, the default group.
            Every rank of it must call the loss, and backward.

    Returns:
        The loss in the logits' dtype: a scalar, or ``(...)`` for ``reduction="none"``.
    """
    _check(logits, target, reduction, label_smoothing)
    losses: Tensor = _VocabParallelCrossEntropy.apply(  # type: ignore[no-untyped-call]
        logits, target, group, ignore_index, float(label_smoothing)
    )
    if reduction == "sum":
        losses = losses.sum()
    elif reduction == "mean":
        losses = losses.sum() / (target != ignore_index).sum()
    return losses.to(logits.dtype)


def _check(logits: Tensor, target: Tensor, reduction: str, label_smoothing: float) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}; it must be one of {', '.join(REDUCTIONS)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r}; it must be in [0, 1]")
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} and target of shape {tuple(target.shape)}: "
            "the target needs one class index per row of the logits, (...) for (..., v)"
        )


class VocabParallelCrossEntropy(torch.nn.Module):
    """Module form of :func:`vocab_parallel_cross_entropy`, as ``nn.CrossEntropyLoss`` is of
    ``cross_entropy``: the options fixed at construction, ``forward(logits, target)``."""

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.group = group

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return vocab_parallel_cross_entropy(
            logits,
            target,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            group=self.group,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}"
        )
