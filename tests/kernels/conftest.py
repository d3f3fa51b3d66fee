"""Shared inputs and runner for the fused-linear JSD kernel tests.

Tensors are drawn on the CPU from a local generator and then moved to the gradref device, so
every device sees the same numbers and no test seeds anything device-specific.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

# Logits of about this standard deviation: a realistic spread of probabilities (the largest
# near 0.5, the smallest far below float32's epsilon) without saturating bfloat16.
LOGIT_SCALE = 2.0


@dataclasses.dataclass(frozen=True)
class JSDInputs:
    """The seven tensor arguments of ``fused_linear_jsd`` and ``jsd_distillation_reference``,
    in their positional order."""

    student_input: Tensor
    student_weight: Tensor
    teacher_input: Tensor
    teacher_weight: Tensor
    true_labels: Tensor
    student_bias: Tensor | None
    teacher_bias: Tensor | None

    @property
    def args(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @property
    def grad_argnums(self) -> tuple[int, ...]:
        """Positions of the tensors that get gradients: student input, weight (and bias)."""
        return (0, 1) if self.student_bias is None else (0, 1, 5)

    def replace(self, **changes: Any) -> JSDInputs:
        return dataclasses.replace(self, **changes)

    def run(self, fn: Callable[..., Tensor], **kwargs: Any) -> tuple[Tensor, tuple[Tensor, ...]]:
        """``fn(*self.args, **kwargs)`` on fresh leaf copies of the student tensors, then
        ``backward()``: the detached loss and the gradients, aligned with grad_argnums."""
        args = list(self.args)
        for position in self.grad_argnums:
            args[position] = args[position].detach().clone().requires_grad_(True)
        loss = fn(*args, **kwargs)
        loss.backward()
        return loss.detach(), tuple(args[position].grad for position in self.grad_argnums)


def make_inputs(
    device: torch.device,
    dtype: torch.dtype,
    *,
    rows: int | tuple[int, ...],
    student_hidden: int,
    teacher_hidden: int,
    vocab: int,
    teacher_vocab: int | None = None,
    bias: bool = True,
    ignore_index: int = -100,
    ignored_share: float = 0.25,
    seed: int = 0,
) -> JSDInputs:
    """Random inputs: ``rows`` (an int, or a leading shape such as (B, T)) of hidden states,
    weights scaled so the logits have a standard deviation of about LOGIT_SCALE, and labels of
    which a random ``ignored_share`` is set to ``ignore_index``."""
    gen = torch.Generator().manual_seed(seed)
    shape = (rows,) if isinstance(rows, int) else tuple(rows)
    teacher_vocab = vocab if teacher_vocab is None else teacher_vocab

    def randn(*size: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(size, generator=gen) * scale).to(device=device, dtype=dtype)

    labels = torch.randint(0, vocab, shape, generator=gen)
    labels[torch.rand(shape, generator=gen) < ignored_share] = ignore_index
    return JSDInputs(
        student_input=randn(*shape, student_hidden),
        student_weight=randn(vocab, student_hidden, scale=LOGIT_SCALE / math.sqrt(student_hidden)),
        teacher_input=randn(*shape, teacher_hidden),
        teacher_weight=randn(
            teacher_vocab, teacher_hidden, scale=LOGIT_SCALE / math.sqrt(teacher_hidden)
        ),
        true_labels=labels.to(device),
        student_bias=randn(vocab) if bias else None,
        teacher_bias=randn(teacher_vocab) if bias else None,
    )


@pytest.fixture
def make_jsd_inputs(gradref_device: torch.device) -> Callable[..., JSDInputs]:
    """``make_jsd_inputs(dtype, rows=..., ...)``: :func:`make_inputs` on the gradref device
    (or on ``device=`` for the few checks of pure math that run on the CPU everywhere)."""

    def make(dtype: torch.dtype, device: torch.device | None = None, **kwargs: Any) -> JSDInputs:
        return make_inputs(device or gradref_device, dtype, **kwargs)

    return make


@pytest.fixture
def triton_device(gradref_device: torch.device) -> torch.device:
    """The gradref device, for tests of the Triton kernels; skips, saying why, where they
    cannot run there."""
    # Imported here, not at the top: pytest loads this file before the root conftest's
    # pytest_configure chooses Triton's interpreter, and Triton fixes it at import.
    from gradref_kernels._chunk_triton import triton_unavailable_reason

    reason = triton_unavailable_reason(gradref_device)
    if reason is not None:
        pytest.skip(reason)
    return gradref_device
