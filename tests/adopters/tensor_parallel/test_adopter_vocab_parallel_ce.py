"""vocab_parallel_ce at 2 ranks against torch's cross-entropy on the full logits.

Written the way a training library writes its tensor-parallel tests (Liger-Kernel's
test/megatron/test_cross_entropy.py, Megatron-LM's own), on pytest-gradref: none of their
process spawning, rendezvous ports, collective-library names, device checks or hand slicing of
the reference's gradient. Each test
body runs in two ranks (``gradref_ranks(2)``), which draw the same full logits and targets;
each rank runs the library on its columns of the logits (``gradref_rank.shard``), computes the
plain reference on the full tensors and compares its loss and its columns of the logits'
gradient with the reference's (``shards={"logits": -1}``), by the default verdict: a float64
golden, the kernel within twice the same-dtype reference's error. The plugin starts the ranks
and picks the collective library for the device (docs/multi-rank.md): the same file runs on
the CPU, on two GPUs, and under ``--gradref-simulate=npu --gradref-device=npu``.

The mutation tests plant the bugs such kernels ship with (a dropped all-reduce; the even-split
vocabulary offset, which only rank 1 of an uneven split gets wrong) and check that the same
comparison fails on the ranks that see them, naming the items that differ.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import vocab_parallel_ce
from torch import Tensor
from vocab_parallel_ce import VocabParallelCrossEntropy, vocab_parallel_cross_entropy

from pytest_gradref import RankContext, RankGradReference, ShardedReference, ShardSpec

ROWS = (2, 6)  # (batch, tokens): logits (2, 6, V), sharded along V
LOGIT_SCALE = 2.0


def draw(
    device: torch.device, dtype: torch.dtype, vocab: int, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Full logits, targets (a quarter of them ``ignore_index``, the first row's the last
    column) and a cotangent for ``reduction="none"``: the same on every rank."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(*ROWS, vocab, generator=gen) * LOGIT_SCALE
    target = torch.randint(0, vocab, ROWS, generator=gen)
    target[torch.rand(ROWS, generator=gen) < 0.25] = ignore_index
    target[0, 0] = vocab - 1  # a target in the last rank's last column
    cotangent = torch.randn(ROWS, generator=gen)
    return logits.to(device, dtype), target.to(device), cotangent.to(device, dtype)


def cross_entropy(
    logits: Tensor, target: Tensor, cotangent: Tensor | None = None, **options: Any
) -> Tensor:
    """The plain reference: torch's cross-entropy on the full (..., V) logits, as rows; a
    per-row loss (``reduction="none"``) is summed against ``cotangent``."""
    loss = F.cross_entropy(logits.flatten(0, -2), target.flatten(), **options)
    return loss if cotangent is None else (loss * cotangent.flatten()).sum()


def run_sharded(
    rank: RankContext, logits: Tensor, target: Tensor, cotangent: Tensor, **options: Any
) -> tuple[Tensor, Tensor]:
    """The library on this rank's columns of the logits, then backward: the loss (summed
    against ``cotangent`` where it is per row) and this rank's columns of the gradient."""
    local = rank.shard(logits, -1).requires_grad_()
    loss = VocabParallelCrossEntropy(**options)(local, target)
    if options.get("reduction") == "none":
        loss = (loss * cotangent).sum()
    loss.backward()
    assert local.grad is not None
    return loss.detach(), local.grad


def check(
    rank: RankContext,
    device: torch.device,
    grad_reference: RankGradReference,
    dtype: torch.dtype,
    vocab: int,
    **options: Any,
) -> None:
    logits, target, cotangent = draw(device, dtype, vocab, options.get("ignore_index", -100))
    weights = (cotangent,) if options.get("reduction") == "none" else ()
    shards: ShardSpec = {"logits": -1}  # each rank holds its slice of the vocabulary
    ref: ShardedReference = grad_reference(
        cross_entropy, logits, target, *weights, shards=shards, **options
    )
    ref.assert_close(*run_sharded(rank, logits, target, cotangent, **options))


# dtype, vocabulary (32: 16 + 16; 25: 13 + 12), options
CASES = [
    pytest.param(torch.float32, 32, {}, id="fp32-mean"),
    pytest.param(torch.bfloat16, 25, {"reduction": "sum"}, id="bf16-uneven-sum"),
    pytest.param(
        torch.float32, 25, {"reduction": "none", "ignore_index": 7}, id="fp32-uneven-none-ignore7"
    ),
    pytest.param(torch.bfloat16, 32, {"reduction": "none"}, id="bf16-none"),
    pytest.param(torch.bfloat16, 25, {"label_smoothing": 0.1}, id="bf16-uneven-mean-smoothing"),
]


@pytest.mark.parametrize(("dtype", "vocab", "options"), CASES)
@pytest.mark.gradref_ranks(2)
def test_matches_cross_entropy_on_the_full_logits(
    gradref_rank: RankContext,
    gradref_device: torch.device,
    grad_reference: RankGradReference,
    dtype: torch.dtype,
    vocab: int,
    options: dict[str, Any],
) -> None:
    check(gradref_rank, gradref_device, grad_reference, dtype, vocab, **options)


@pytest.mark.gradref_ranks(2)
def test_functional_form_and_errors(
    gradref_rank: RankContext, gradref_device: torch.device
) -> None:
    logits, target, _ = draw(gradref_device, torch.float32, 25, -100)
    local = gradref_rank.shard(logits, -1)
    # The functional form, on an explicit group, is the module's on the default one.
    functional = vocab_parallel_cross_entropy(local, target, group=gradref_rank.group)
    assert torch.equal(functional, VocabParallelCrossEntropy()(local, target))
    with pytest.raises(ValueError, match="reduction='avg'; it must be one of mean, sum, none"):
        vocab_parallel_cross_entropy(local, target, reduction="avg")
    with pytest.raises(ValueError, match=r"target of shape \(12,\)"):
        vocab_parallel_cross_entropy(local, target.flatten())
    # A vocabulary of one column leaves rank 1 none: every rank raises, none hangs.
    one_column, zeros, _ = draw(gradref_device, torch.float32, 1, -100)
    with pytest.raises(ValueError, match=r"rank 1 of 2 holds no vocabulary columns"):
        vocab_parallel_cross_entropy(gradref_rank.shard(one_column, -1), zeros)


@pytest.mark.gradref_ranks(2)
def test_what_crosses_the_collective(
    gradref_rank: RankContext, gradref_device: torch.device
) -> None:
    # Every all-reduce, in the order the library's docstring gives (the mutations below drop
    # them by this order): (elements, dtype, op). Backward communicates nothing.
    logits, target, cotangent = draw(gradref_device, torch.bfloat16, 25, -100)
    calls: list[tuple[int, torch.dtype, Any]] = []
    all_reduce = dist.all_reduce

    def recorded(tensor: Tensor, op: Any = dist.ReduceOp.SUM, **kwargs: Any) -> Any:
        calls.append((tensor.numel(), tensor.dtype, op))
        return all_reduce(tensor, op=op, **kwargs)

    with mock.patch.object(dist, "all_reduce", recorded):
        run_sharded(gradref_rank, logits, target, cotangent, label_smoothing=0.1)
    rows, add = target.numel(), dist.ReduceOp.SUM
    assert calls == [
        (gradref_rank.world_size, torch.int64, add),  # the shards' vocabulary sizes
        (rows, torch.float32, dist.ReduceOp.MAX),  # row maxima
        (rows, torch.float32, add),  # target logits
        (rows, torch.float32, add),  # sum-exps
        (rows, torch.float32, add),  # the logits' sums, for label smoothing
    ]


# --------------------------------------------------------------------------- mutations


@contextmanager
def dropped_all_reduce(index: int) -> Iterator[None]:
    """The library with its ``index``-th all-reduce of a call left out, on every rank (so
    the ranks still meet in the others)."""
    calls = itertools.count()
    all_reduce = dist.all_reduce

    def maybe(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        return None if next(calls) == index else all_reduce(tensor, *args, **kwargs)

    with mock.patch.object(dist, "all_reduce", maybe):
        yield


def even_split_vocab_range(
    local_vocab: int, group: Any, device: torch.device
) -> tuple[int, int, int]:
    """Megatron's offset, ``rank * local_vocab``, right for equal shards only: on an uneven
    split rank 1 starts one column early, and rank 0 cannot tell."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    start = rank * local_vocab
    return start, start + local_vocab, world_size * local_vocab


# The library's all-reduces in order (its docstring), but the first, of the vocabulary sizes,
# whose absence the library reports itself (a rank of no columns): what each one's absence
# breaks. Backward needs no target logit, so without its all-reduce the gradients stay right.
@pytest.mark.parametrize(
    ("index", "differ"),
    [
        pytest.param(1, "2 of 2 items differ", id="row-max"),
        pytest.param(2, "1 of 2 items differ", id="target-logit"),
        pytest.param(3, "2 of 2 items differ", id="sum-exp"),
    ],
)
@pytest.mark.gradref_ranks(2)
def test_a_dropped_all_reduce_is_caught(
    gradref_rank: RankContext,
    gradref_device: torch.device,
    grad_reference: RankGradReference,
    index: int,
    differ: str,
) -> None:
    logits, target, cotangent = draw(gradref_device, torch.float32, 25, -100)
    ref = grad_reference(cross_entropy, logits, target, shards={"logits": -1})
    with dropped_all_reduce(index):
        loss, grad = run_sharded(gradref_rank, logits, target, cotangent)
    with pytest.raises(AssertionError, match=rf"{differ}\n- value:"):
        ref.assert_close(loss, grad)


@pytest.mark.gradref_ranks(2)
def test_an_even_split_offset_is_caught_on_rank_1(
    gradref_rank: RankContext, gradref_device: torch.device, grad_reference: RankGradReference
) -> None:
    with mock.patch.object(vocab_parallel_ce, "vocab_range", even_split_vocab_range):
        check(gradref_rank, gradref_device, grad_reference, torch.float32, 32)  # equal shards
        logits, target, cotangent = draw(gradref_device, torch.float32, 25, -100)
        loss, grad = run_sharded(gradref_rank, logits, target, cotangent)
    ref = grad_reference(cross_entropy, logits, target, shards={"logits": -1})
    # The loss is wrong on both ranks (its target logits are all-reduced); the gradient only
    # in rank 1's columns, which rank 0's comparison does not see.
    expected = {
        0: r"1 of 2 items differ\n- value:",
        1: r"(?s)2 of 2 items differ\n- value:.*\n- gradient of argument 0 \(logits\), shard 1 "
        r"of 2 along dim 2 \[13:25\]:",
    }
    with pytest.raises(AssertionError, match=expected[gradref_rank.rank]):
        ref.assert_close(loss, grad)
