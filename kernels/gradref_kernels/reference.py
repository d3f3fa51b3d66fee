"""Plain-PyTorch reference of the fused-linear JSD distillation loss.

Full logits, eager, differentiable with ``loss.backward()`` and with
``torch.func.grad_and_value`` alike. The matmuls run in the inputs' dtype (on float32 copies,
rounded once, where the CPU has no fast kernel for it: :func:`_linear`) and, by default, the
rest in at least float32 (``upcast``), as production losses do: called with float64 tensors it
is the golden reference, called with bfloat16 ones it is as accurate as a bfloat16 kernel can be
expected to be, so a kernel that falls short of it fails the tests' default verdict. With
``upcast=False`` everything is in the inputs' dtype: what a naive same-dtype implementation
gets (the benchmarks' memory baseline). The tests and the benchmarks compare the kernel with it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ._matmuls import products_via_float32

__all__ = ["jsd_distillation_reference"]


def jsd_distillation_reference(
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
    upcast: bool = True,
) -> Tensor:
    """``weight_hard_loss * hard + weight_soft_loss * soft`` as a 0-dim tensor: of at least
    float32 (``upcast``), or of the inputs' dtype.

    Same arguments and semantics as :func:`gradref_kernels.fused_linear_jsd` (inputs of shape
    ``(..., hidden)``, labels of shape ``(...)``):

    - hard: cross-entropy of the unscaled student logits, rows labelled ``ignore_index`` left out;
    - soft: ``beta * KL(T||M) + (1-beta) * KL(S||M)`` with ``M = beta*T + (1-beta)*S`` over the
      temperature-scaled logits (``beta = 0``: ``KL(T||S)``, ``beta = 1``: ``KL(S||T)``), the
      student's zero-padded to the teacher's vocabulary when that is larger;
    - both summed over the valid rows and divided by their number (at least 1).

    The teacher's logits are detached: gradients flow to the student's tensors only.
    """
    student_logits = _linear(student_input, student_weight, student_bias)
    teacher_logits = _linear(teacher_input, teacher_weight, teacher_bias).detach()
    if upcast:  # promote_types: float64 logits stay float64 for the golden
        student_logits = student_logits.to(torch.promote_types(student_logits.dtype, torch.float32))
        teacher_logits = teacher_logits.to(torch.promote_types(teacher_logits.dtype, torch.float32))
    vocab = student_logits.shape[-1]
    student_logits = student_logits.reshape(-1, vocab)
    teacher_logits = teacher_logits.reshape(-1, teacher_logits.shape[-1])
    labels = true_labels.reshape(-1)
    valid = labels != ignore_index
    num_valid = valid.sum().clamp_min(1)

    hard = F.cross_entropy(student_logits, labels, ignore_index=ignore_index, reduction="sum")

    pad = teacher_logits.shape[-1] - vocab
    scaled_student = student_logits / temperature
    if pad:
        scaled_student = F.pad(scaled_student, (0, pad))
    log_s = F.log_softmax(scaled_student, dim=-1)
    log_t = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        per_token = F.kl_div(log_s, log_t, reduction="none", log_target=True)
    elif beta == 1:
        per_token = F.kl_div(log_t, log_s, reduction="none", log_target=True)
    else:
        log_m = torch.logaddexp(log_s + math.log(1 - beta), log_t + math.log(beta))
        per_token = beta * F.kl_div(log_m, log_t, reduction="none", log_target=True) + (
            1 - beta
        ) * F.kl_div(log_m, log_s, reduction="none", log_target=True)
    soft = torch.where(valid, per_token.sum(dim=-1), 0.0).sum()

    return (weight_hard_loss * hard + weight_soft_loss * soft) / num_valid


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear`` in the inputs' dtype; where its products are a scalar loop (a CPU without
    oneDNN kernels for bfloat16 or float16, :func:`._matmuls.products_via_float32`), the same
    computed on float32 copies and rounded once, as the fast kernels compute it. Backward then
    rounds alike: the logits' gradient arrives in the inputs' dtype (theirs), is multiplied
    exactly in float32, and each input's gradient is rounded once to its dtype by the copy's
    backward."""
    if not products_via_float32(x.device.type, x.dtype):
        return F.linear(x, weight, bias)
    wide_bias = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), wide_bias).to(x.dtype)
