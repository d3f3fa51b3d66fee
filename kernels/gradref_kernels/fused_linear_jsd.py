"""Chunked fused-linear JSD distillation loss: the functional and the module.

A drop-in for Liger-Kernel's ``liger_fused_linear_jsd`` / ``LigerFusedLinearJSDLoss`` (same
argument names, order, defaults and semantics) that never materialises the full ``(N, V)``
logits: rows are processed ``chunk_size`` at a time, and the gradients with respect to the
student's input, weight and bias are computed during the forward pass from the closed-form
gradient with respect to the logits (see :mod:`gradref_kernels._chunk_torch`).

This module is the public face; the parts live in private modules: the argument checks
(``_validation``), the loss options handed down as one object (``_options``), the choice of
the per-chunk function (``_dispatch``), the matmuls (``_matmuls``), the loop over chunks
(``_forward``), the custom operators that ``torch.compile`` sees (``_ops``), the autograd
Function (``_function``), and the per-chunk math (``_chunk_torch``, ``_chunk_triton``).

Under ``torch.compile`` (default, ``fullgraph=True``, ``dynamic=True``, in a compiled module)
the loop over chunks is one custom operator and backward's scaled cast another: a compiled
step runs the same kernels as eager, with no graph break and nothing in the graph that reads
the host or depends on the row count.

Per chunk of ``n`` rows: the student logits in float32 (float64 for float64 inputs) and the
teacher logits (in the matmul dtype for the Triton kernel, in float32 for the PyTorch math);
the per-chunk function writes dLoss/dlogits, in the matmul dtype, over the teacher logits'
storage with no bytes between its rows, then ``grad_input = dZ @ W`` and
``grad_weight += dZ^T @ X`` run in the weight dtype, the latter summed over chunks in float32
(inside the matmul where the device supports it; on the Triton path over two chunks' dZ at a
time). Besides its inputs and gradients, a call holds these two ``(n, V)`` buffers at a time
(on the Triton path the teacher logits of two chunks), plus the PyTorch path's slice buffers
(:data:`gradref_kernels._chunk_torch.SLICE_ELEMENTS`) and a float32 ``(n, H)`` product; nothing
grows with N. The gradient of the weight is accumulated in a float32 ``(V, H)`` buffer (the
gradient itself for float32 weights), which backward scales and rounds in one pass. Nothing
reads a tensor value on the host, except on the CPU (the label check, and 1/num_valid for the
matmul that rounds ``grad_input``), inside the custom operator.

Where this differs from Liger-Kernel 0.8.5, on purpose:

- chunks hold exactly ``chunk_size`` rows (Liger splits into ``N // chunk_size`` chunks, so
  its chunks can be almost twice as large); the loss does not depend on the chunking;
- logits, softmax and loss are float32 whatever the input dtype (Liger takes the log-softmax
  of bfloat16 logits), and the weight gradient is accumulated in float32 (Liger: in bfloat16);
- ``backward`` scales by ``grad_output`` on the device, without Liger's host sync. Every
  gradient is rounded to the input dtype once, after its scaling by 1/num_valid: ``grad_input``
  chunk by chunk in forward (float16's waits in float32 for backward, since the per-row
  gradients of a mean over many rows would underflow in it before a loss scaler's factor
  arrives), the weight and bias gradients from their float32 sums in backward;
- the soft and hard losses returned with ``return_soft_hard_loss`` are detached (logging only);
- inputs may have leading batch dimensions, ``(B, T, H)`` with labels ``(B, T)``;
- labels outside ``[0, V)`` other than ``ignore_index`` are rejected;
- the soft loss, and the teacher's matmul, are skipped when it is neither weighted nor
  returned, as Liger skips the hard loss;
- ``compiled`` is accepted and has no effect: the Triton path is fused already, and the
  portable path is fast enough eager (and runs where inductor does not); under an outer
  ``torch.compile`` both stay what they are eagerly (see above).
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from ._function import FusedLinearJSDFunction
from ._options import LossOptions
from ._validation import check_options, check_tensors

__all__ = ["FusedLinearJSDLoss", "fused_linear_jsd"]

LossOutput = Union[Tensor, tuple[Tensor, Tensor, Tensor]]


def fused_linear_jsd(
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
    compiled: bool = True,
    chunk_size: int = 1024,
    return_soft_hard_loss: bool = False,
    *,
    implementation: str = "auto",
) -> LossOutput:
    """Fused linear layer + JSD knowledge-distillation loss, computed chunk by chunk.

    ``loss = weight_hard_loss * hard + weight_soft_loss * soft`` where, over the rows whose
    label is not ``ignore_index`` (and divided by their number, at least 1):

    - ``hard`` is the cross-entropy of the unscaled student logits
      ``student_input @ student_weight.T + student_bias`` against ``true_labels``;
    - ``soft`` is the generalised Jensen-Shannon divergence of the temperature-scaled
      distributions, ``beta * KL(T||M) + (1-beta) * KL(S||M)`` with ``M = beta*T + (1-beta)*S``
      (``beta = 0``: ``KL(T||S)``, ``beta = 1``: ``KL(S||T)``). A teacher vocabulary larger
      than the student's is allowed: the scaled student logits are padded with zeros to the
      teacher's width, as Liger-Kernel does (meant for a teacher whose vocabulary is padded).

    Gradients flow to ``student_input``, ``student_weight`` and ``student_bias`` only.

    Args:
        student_input: ``(N, Hs)`` or ``(..., Hs)`` student hidden states.
        student_weight: ``(Vs, Hs)`` student LM-head weight.
        teacher_input: ``(N, Ht)`` or ``(..., Ht)`` teacher hidden states (same leading shape).
        teacher_weight: ``(Vt, Ht)`` teacher LM-head weight, ``Vt >= Vs``.
        true_labels: ``(N,)`` or ``(...)`` integer class indices in ``[0, Vs)`` or ``ignore_index``.
        student_bias: optional ``(Vs,)``.
        teacher_bias: optional ``(Vt,)``.
        weight_hard_loss: weight of the hard loss.
        weight_soft_loss: weight of the soft loss.
        beta: mixture coefficient of the generalised JSD, in ``[0, 1]``.
        ignore_index: label of rows left out of both losses.
        temperature: positive; divides the logits of the soft loss only.
        compiled: accepted for compatibility with Liger-Kernel, and has no effect: the
            Triton path is fused already, and the portable path is eager by design (it runs
            where inductor does not, and within 0.6x of Liger's eager time without it).
        chunk_size: rows per chunk; memory grows with ``chunk_size * V``, not with N.
        return_soft_hard_loss: also return the soft and hard losses (unweighted). They are
            detached, for logging: gradients flow through ``loss`` only.
        implementation: ``"auto"`` (Triton on CUDA when ``gradref_kernels._chunk_triton`` and
            triton import, else PyTorch), ``"torch"`` or ``"triton"`` (an error saying why
            when it cannot run). Keyword-only.

    All floating tensors must share one dtype (float16, bfloat16, float32 or float64) and one
    device. The computation runs in float32 (float64 for float64 inputs).

    Returns:
        ``loss``, a 0-dim float32 tensor (float64 for float64 inputs), or
        ``(loss, soft_loss, hard_loss)`` when ``return_soft_hard_loss``.

    Raises:
        TypeError: a tensor argument is missing, of a non-floating or mixed dtype, or
            ``true_labels`` is not an integer tensor.
        ValueError: inconsistent shapes, devices, out-of-range labels or options.
        RuntimeError: ``implementation="triton"`` cannot run here.
    """
    check_options(beta, temperature, ignore_index, chunk_size, implementation)
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
    labels = true_labels.reshape(-1).long().contiguous()
    weight_hard = float(weight_hard_loss)
    options = LossOptions(
        beta=float(beta),
        temperature=float(temperature),
        ignore_index=ignore_index,
        weight_hard=weight_hard,
        weight_soft=float(weight_soft_loss),
        compute_hard=weight_hard != 0.0 or bool(return_soft_hard_loss),
    )
    outputs: tuple[Tensor, Tensor, Tensor] = FusedLinearJSDFunction.apply(  # type: ignore[no-untyped-call]
        student_input.reshape(-1, student_input.shape[-1]),
        student_weight,
        teacher_input.reshape(-1, teacher_input.shape[-1]),
        teacher_weight,
        labels,
        student_bias,
        teacher_bias,
        options,
        chunk_size,
        implementation,
        torch.is_grad_enabled(),
        bool(return_soft_hard_loss),
    )
    return outputs if return_soft_hard_loss else outputs[0]


class LossOptionsModule(torch.nn.Module):
    """The options of a fused JSD loss module, fixed at construction and checked there; the
    subclasses' ``forward`` passes them with the tensors to their function."""

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
        implementation: str = "auto",
    ) -> None:
        super().__init__()
        check_options(beta, temperature, ignore_index, chunk_size, implementation)
        self.weight_hard_loss = weight_hard_loss
        self.weight_soft_loss = weight_soft_loss
        self.beta = beta
        self.ignore_index = ignore_index
        self.temperature = temperature
        self.compiled = compiled
        self.chunk_size = chunk_size
        self.return_soft_hard_loss = return_soft_hard_loss
        self.implementation = implementation

    def extra_repr(self) -> str:
        return (
            f"weight_hard_loss={self.weight_hard_loss}, weight_soft_loss={self.weight_soft_loss}, "
            f"beta={self.beta}, ignore_index={self.ignore_index}, "
            f"temperature={self.temperature}, chunk_size={self.chunk_size}, "
            f"implementation={self.implementation!r}"
        )


class FusedLinearJSDLoss(LossOptionsModule):
    """Module form of :func:`fused_linear_jsd` (drop-in for ``LigerFusedLinearJSDLoss``).

    The options are fixed at construction (and checked there); ``forward`` takes the tensors.
    See :func:`fused_linear_jsd` for the meaning of every argument.
    """

    def forward(
        self,
        student_input: Tensor,
        student_weight: Tensor,
        teacher_input: Tensor,
        teacher_weight: Tensor,
        true_labels: Tensor,
        student_bias: Tensor | None = None,
        teacher_bias: Tensor | None = None,
    ) -> LossOutput:
        """The loss (or ``(loss, soft_loss, hard_loss)``) of :func:`fused_linear_jsd`."""
        return fused_linear_jsd(
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
            implementation=self.implementation,
        )
