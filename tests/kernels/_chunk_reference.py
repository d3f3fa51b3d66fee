"""The float64 reference of the per-chunk contract: what ``_chunk_torch.jsd_chunk_`` and
``_chunk_triton.jsd_chunk_`` must compute, from the full-logits reference and autograd.

Test support, so it lives beside the tests and stays out of the wheel: ``test_chunk_kernels.py``
imports it, and ``benchmarks/tune_chunk.py`` puts this folder on ``sys.path`` to check the
kernels at full size with it. It builds the loss from its definition (log-softmax, KL,
cross-entropy), so it shares no algebra with the kernels' closed-form gradients.
"""

from __future__ import annotations

import torch
from gradref_kernels._options import LossOptions
from gradref_kernels.reference import jsd_distillation_reference
from torch import Tensor

IGNORE_INDEX = -100


def chunk_options(beta: float, temperature: float, compute_hard: bool = True) -> LossOptions:
    """Options for checking a chunk function: ``ignore_index`` :data:`IGNORE_INDEX`, and hard
    and soft weights 0.4 and 0.7 (neither equal nor 1, so a dropped or swapped weight shows)."""
    return LossOptions(
        beta=beta,
        temperature=temperature,
        ignore_index=IGNORE_INDEX,
        weight_hard=0.4,
        weight_soft=0.7,
        compute_hard=compute_hard,
    )


def chunk_reference(
    student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, options: LossOptions
) -> tuple[Tensor, Tensor, Tensor]:
    """(dLoss/dstudent, soft, hard) of the summed loss (the kernels' convention), in float64
    from the full-logits reference and autograd.

    The reference takes inputs and weights and divides by the number of valid rows; an
    identity input with the transposed logits as the weight reproduces the logits, and the
    weight's gradient is the logits' one, transposed.
    """
    eye = torch.eye(student_logits.shape[0], dtype=torch.float64, device=student_logits.device)
    weight = student_logits.double().T.contiguous().requires_grad_(True)

    def loss(weight_hard: float, weight_soft: float) -> Tensor:
        return jsd_distillation_reference(
            eye,
            weight,
            eye,
            teacher_logits.double().T,
            labels,
            weight_hard_loss=weight_hard,
            weight_soft_loss=weight_soft,
            beta=options.beta,
            ignore_index=options.ignore_index,
            temperature=options.temperature,
        )

    soft = loss(0.0, 1.0)
    hard = loss(1.0, 0.0) if options.compute_hard else torch.zeros_like(soft)
    num_valid = max(1, int((labels != options.ignore_index).sum()))
    torch.autograd.backward(num_valid * (options.weight_soft * soft + options.weight_hard * hard))
    assert weight.grad is not None
    return weight.grad.T, num_valid * soft.detach(), num_valid * hard.detach()
