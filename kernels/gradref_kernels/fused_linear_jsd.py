"""Chunked fused-linear JSD distillation loss: the functional, the module and the autograd Function.

A drop-in for Liger-Kernel's ``liger_fused_linear_jsd`` / ``LigerFusedLinearJSDLoss`` (same
argument names, order, defaults and semantics) that never materialises the full ``(N, V)``
logits: rows are processed ``chunk_size`` at a time, and the gradients with respect to the
student's input, weight and bias are computed during the forward pass from the closed-form
gradient with respect to the logits (see :mod:`gradref_kernels._chunk_torch`).

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
matmul that rounds ``grad_input``).

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
  portable path is fast enough eager (and runs where inductor does not).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
from torch import Tensor

from . import _chunk_torch

__all__ = ["FusedLinearJSDLoss", "fused_linear_jsd"]

ChunkFn = Callable[..., tuple[Tensor, Tensor]]
ScaledCast = Callable[..., Tensor]
LossOutput = Union[Tensor, tuple[Tensor, Tensor, Tensor]]

_IMPLEMENTATIONS = ("auto", "torch", "triton")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------- validation


def _check_options(
    beta: float, temperature: float, ignore_index: int, chunk_size: int, implementation: str
) -> None:
    """Checks of the scalar options, shared by the functional and the module constructor."""
    if not isinstance(temperature, (int, float)) or not (
        temperature > 0 and math.isfinite(temperature)
    ):
        raise ValueError(
            f"temperature must be a positive finite number, got {temperature!r}; "
            "use 1.0 for unscaled logits"
        )
    if not isinstance(beta, (int, float)) or not 0 <= beta <= 1:
        raise ValueError(
            f"beta must be in [0, 1], got {beta!r}; 0 is KL(teacher||student), "
            "1 is KL(student||teacher), 0.5 the symmetric JSD"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {', '.join(map(repr, _IMPLEMENTATIONS))}, "
            f"got {implementation!r}"
        )


def _check_tensors(tensors: dict[str, Tensor | None]) -> None:
    """Types, devices, dtypes and shapes; no tensor value is read."""
    for name, tensor in tensors.items():
        optional = name.endswith("_bias")
        if not isinstance(tensor, Tensor) and not (optional and tensor is None):
            kind = "a torch.Tensor or None" if optional else "a torch.Tensor"
            raise TypeError(f"{name} must be {kind}, got {type(tensor).__name__}")
    given = {name: t for name, t in tensors.items() if t is not None}

    devices = {t.device for t in given.values()}
    if len(devices) > 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in given.items())
        raise ValueError(f"all tensors must be on one device, got {where}; move them with .to()")

    labels = given.pop("true_labels")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(
            f"true_labels must be an integer tensor of class indices (torch.long), "
            f"got {labels.dtype}"
        )
    for name, t in given.items():
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if len({t.dtype for t in given.values()}) > 1:
        dtypes = ", ".join(f"{name} {t.dtype}" for name, t in given.items())
        raise TypeError(
            f"mixed floating dtypes: {dtypes}; cast the inputs, weights and biases to one dtype"
        )

    x, w = tensors["student_input"], tensors["student_weight"]
    xt, wt = tensors["teacher_input"], tensors["teacher_weight"]
    assert x is not None
    assert w is not None
    assert xt is not None
    assert wt is not None
    for name, t in (("student_weight", w), ("teacher_weight", wt)):
        if t.dim() != 2 or t.shape[0] == 0:
            raise ValueError(
                f"{name} must be 2-D (vocab, hidden) with vocab >= 1, got shape {tuple(t.shape)}"
            )
    for name, t in (("student_input", x), ("teacher_input", xt)):
        if t.dim() < 2:
            raise ValueError(
                f"{name} must be (rows, hidden) or (..., hidden), got shape {tuple(t.shape)}"
            )
    for prefix, inp, weight in (("student", x, w), ("teacher", xt, wt)):
        if inp.shape[-1] != weight.shape[1]:
            raise ValueError(
                f"{prefix}_input has hidden size {inp.shape[-1]} (shape {tuple(inp.shape)}) but "
                f"{prefix}_weight has shape {tuple(weight.shape)} (vocab, hidden): "
                f"the last dimension of {prefix}_input must be {weight.shape[1]}"
            )
    rows = x.shape[:-1]
    if xt.shape[:-1] != rows or labels.shape != rows:
        raise ValueError(
            "row counts differ: student_input rows "
            f"{tuple(rows)}, teacher_input rows {tuple(xt.shape[:-1])}, true_labels "
            f"{tuple(labels.shape)}; they must match (one label per student/teacher row)"
        )
    if w.shape[0] > wt.shape[0]:
        raise ValueError(
            f"student vocabulary ({w.shape[0]}, student_weight rows) is larger than the "
            f"teacher's ({wt.shape[0]}, teacher_weight rows); a larger teacher vocabulary is "
            "supported (the student's logits are zero-padded), a larger student one is not"
        )
    for prefix, weight in (("student", w), ("teacher", wt)):
        bias = tensors[f"{prefix}_bias"]
        if bias is not None and bias.shape != weight.shape[:1]:
            raise ValueError(
                f"{prefix}_bias must have shape ({weight.shape[0]},) to match "
                f"{prefix}_weight {tuple(weight.shape)}, got {tuple(bias.shape)}"
            )


def _check_label_range(labels: Tensor, vocab: int, ignore_index: int) -> None:
    """Labels must be class indices in [0, vocab) or ``ignore_index``.

    This needs a reduction over the labels, done once per call, before any chunk. On CPU the
    result is read on the host (no cost: there is nothing to synchronise with) and a bad label
    raises ValueError. Elsewhere ``torch._assert_async`` checks it on the device without a host
    sync; a failure surfaces at a later synchronisation (on CUDA as a device-side assert, the
    failure an out-of-range gather would give anyway, only named). Backends without
    ``_assert_async`` fall back to the host check, which costs one sync per call.
    """
    in_range = ((labels >= 0) & (labels < vocab)) | (labels == ignore_index)
    all_in_range = in_range.all()
    if labels.device.type != "cpu":
        try:
            torch._assert_async(
                all_in_range, f"true_labels must be in [0, {vocab}) or equal ignore_index"
            )
            return
        except NotImplementedError:
            pass
    if not bool(all_in_range):
        bad = labels[~in_range]
        raise ValueError(
            f"true_labels must be class indices in [0, {vocab}) (the student vocabulary) or "
            f"equal ignore_index={ignore_index}; found {bad.numel()} other value(s), e.g. "
            f"{bad[:5].tolist()}"
        )


# --------------------------------------------------------------------------- dispatch


@functools.cache
def _import_triton_chunk() -> tuple[Any, str]:
    """The ``_chunk_triton`` module, or None and why it cannot be imported."""
    if importlib.util.find_spec("triton") is None:
        return None, "triton is not installed (pip install 'pytest-gradref[triton]')"
    try:
        module = importlib.import_module(f"{__package__}._chunk_triton")
    except Exception as exc:  # any import failure (no module, no driver, ...) means: not usable
        return None, f"{__package__}._chunk_triton failed to import: {exc!r}"
    return module, ""


def _triton_module(device: torch.device, dtype: torch.dtype) -> tuple[Any, str]:
    """The ``_chunk_triton`` module if its kernels can run on these tensors, else None and why."""
    if dtype == torch.float64:
        return None, "the Triton kernel computes in float32; float64 inputs need 'torch'"
    module, reason = _import_triton_chunk()
    if module is None:
        return None, reason
    reason = module.triton_unavailable_reason(device)
    if reason is not None:
        return None, reason
    return module, ""


@dataclass(frozen=True)
class _ChunkKernel:
    """A per-chunk function and the teacher logits it takes: in the work dtype (float32;
    the PyTorch math would otherwise convert a bfloat16 teacher in a pass of its own) or in the
    matmul dtype (the Triton kernel reads them as float32 as it goes, from half the bytes).

    Either writes the logit gradient over the teacher logits' storage, without bytes between
    its rows (the matmuls read it next): the PyTorch math, which writes slice after slice,
    packed at the start of the storage (:func:`_packed_over`); the Triton kernel, whose
    programs run rows concurrently, row for row, with the teacher's extra columns zeroed after
    it when the teacher's vocabulary is larger.

    ``scaled_cast(source, scale, dtype, out=None)`` scales a float32 gradient and rounds it
    to ``dtype`` in one pass (the Triton module's kernel, or one PyTorch op): float32 sums are
    rounded to a low-precision dtype once, after their scaling."""

    fn: ChunkFn
    float_teacher: bool
    scaled_cast: ScaledCast


def _select_chunk_kernel(
    implementation: str, device: torch.device, dtype: torch.dtype
) -> _ChunkKernel:
    """The per-chunk function: Triton where asked for or (for "auto") where it can run, else
    the portable PyTorch math."""
    # "auto" takes Triton on CUDA only; an explicit "triton" also runs wherever the module
    # says it can (e.g. CPU tensors under TRITON_INTERPRET=1, which tests the kernel anywhere).
    # Under an outer torch.compile the portable math is traced into the caller's graph: dynamo
    # does not trace through the Triton kernel's launch reliably.
    tracing = torch.compiler.is_compiling()
    if implementation == "triton" or (
        implementation == "auto" and device.type == "cuda" and not tracing
    ):
        module, reason = _triton_module(device, dtype)
        if module is not None:
            return _ChunkKernel(
                module.jsd_chunk_, float_teacher=False, scaled_cast=module.scaled_cast
            )
        if implementation == "triton":
            raise RuntimeError(
                f"implementation='triton' cannot run: {reason}. "
                "Use implementation='torch' (portable) or 'auto'."
            )
    return _ChunkKernel(
        _chunk_torch.jsd_chunk_, float_teacher=True, scaled_cast=_chunk_torch.scaled_cast
    )


# --------------------------------------------------------------------------- forward


@functools.cache
def _mixed_matmul(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch multiplies ``dtype`` matrices straight into float32 on this device.

    cuBLAS does (``out_dtype=``, also accumulating into a float32 ``out``): the logits then
    are never rounded to the input dtype, and the weight gradient accumulates in float32
    without a separate product and addition. Probed once with a tiny product whose result is
    checked, since support varies by torch version and backend.
    """
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        acc = torch.ones(2, 2, dtype=torch.float32, device=device_type)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        product = torch.mm(a, a, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return bool((acc == 3).all()) and product.dtype == torch.float32


def _logits(
    x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, out: Tensor | None = None
) -> Tensor:
    """``x @ weight.T + bias`` as a ``dtype`` tensor (the matmul dtype or float32/64): ``out``
    if given (in the matmul dtype only), else a new one.

    Low-precision inputs are multiplied in their dtype (every accelerator's fast path), into
    float32 directly where the device supports it, else rounded and then cast; the bias is
    added in ``dtype``."""
    if x.dtype == dtype:
        if bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(bias, x, weight.t(), out=out)
    assert out is None, "out= takes logits in the matmul dtype only"
    if _mixed_matmul(x.device.type, x.dtype) and dtype == torch.float32:
        logits = torch.mm(x, weight.t(), out_dtype=torch.float32)
    else:
        logits = (x @ weight.t()).to(dtype)
    return logits if bias is None else logits.add_(bias)


def _packed_over(logits: Tensor, dtype: torch.dtype, columns: int) -> Tensor:
    """A contiguous ``(n, columns)`` tensor of ``dtype`` at the start of the storage of the
    contiguous ``(n, V)`` tensor ``logits``, ``columns <= V`` and ``dtype`` no wider than
    theirs: row i of the result lies within rows 0..i of ``logits``.

    The PyTorch chunk math writes its gradient slice after slice, each row after the logits
    rows up to it are read, so it may write it here. Packed, the gradient has no bytes between
    its rows: a row-for-row view (row stride V in float32 units) would leave the other half of
    each float32 row between bfloat16 rows, bits that read as bfloat16 can be NaN or inf, and
    some matmul kernels read past the last column of a row (oneDNN's AMX bfloat16 kernel reads
    the whole tile of 32 columns and relies on the other operand's zero padding: NaN * 0 is
    NaN)."""
    flat = logits.view(-1)
    if flat.dtype != dtype:
        flat = flat.view(dtype)
    return flat[: logits.shape[0] * columns].view(logits.shape[0], columns)


def _dense(matrix: Tensor) -> Tensor:
    """``matrix`` if its elements fill their span of memory (row- or column-major), else a
    contiguous copy: no matmul is handed an operand with bytes between its rows, whose
    contents nobody controls (see :func:`_packed_over`)."""
    if matrix.is_contiguous() or matrix.t().is_contiguous():
        return matrix
    return matrix.contiguous()


def _accumulate_product_(acc: Tensor, a: Tensor, b: Tensor, *, first: bool) -> None:
    """``acc += a @ b`` (``acc = a @ b`` when ``first``, whatever ``acc`` held) with ``acc``
    in float32 (or float64) and a, b in the matmul dtype: exact products summed in float32,
    rounded to the matmul dtype nowhere (backward rounds the scaled sum once)."""
    # beta=0 ignores acc's contents, NaN included: the buffer need not be zeroed first.
    beta = 0.0 if first else 1.0
    if acc.dtype == a.dtype:
        acc.addmm_(a, b, beta=beta)
    elif _mixed_matmul(a.device.type, a.dtype) and acc.dtype == torch.float32:
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    else:
        # No low-precision matmul into float32 here (the CPU): multiply float32 copies, a
        # chunk of the logit gradient at a time (the size of the student logits just freed).
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)


@dataclass(frozen=True)
class _MeanScale:
    """1/num_valid: as a 0-dim device tensor, and as a Python number where reading it costs
    nothing (on the CPU; elsewhere it would synchronise with the device)."""

    tensor: Tensor
    host: float | None


def _input_gradient_(
    out: Tensor,
    grad_logits: Tensor,
    weight: Tensor,
    mean_scale: _MeanScale | None,
    scaled_cast: ScaledCast,
) -> None:
    """``out = grad_logits @ weight``, times ``mean_scale`` when given, rounded once to out's
    dtype where the device allows it.

    With a mean scale the product is scaled in float32 before its one rounding: by the matmul
    itself (``alpha``) where the scale is a Python number, else by a scaled cast of a float32
    product where the device multiplies low-precision matrices into float32 (CUDA). Where
    neither holds (a device without that product, whose count cannot be read for free) the
    product is rounded, then scaled and rounded again. Without one, ``out`` is a float32
    buffer that waits for backward (float16 inputs), and gets the float32 product where the
    device has it, else the product rounded to float16."""
    if mean_scale is None:
        if _mixed_matmul(grad_logits.device.type, grad_logits.dtype):
            torch.mm(grad_logits, weight, out_dtype=torch.float32, out=out)
        else:
            out.copy_(grad_logits @ weight)
    elif out.dtype in (torch.float32, torch.float64) or (
        mean_scale.host is None and not _mixed_matmul(grad_logits.device.type, out.dtype)
    ):
        # In float32 the scaling's rounding is negligible; elsewhere the fallback above.
        torch.mm(grad_logits, weight, out=out)
        out.mul_(mean_scale.tensor)
    elif mean_scale.host is not None:
        # beta=0 ignores out's contents, NaN included.
        torch.addmm(out, grad_logits, weight, beta=0.0, alpha=mean_scale.host, out=out)
    else:
        product = torch.mm(grad_logits, weight, out_dtype=torch.float32)
        scaled_cast(product, mean_scale.tensor.float(), out.dtype, out)


@dataclass
class _Result:
    """What the forward pass produces: the losses, and the gradients. The weight and bias
    gradients are those of the summed loss (grad_output = num_valid), which backward scales by
    ``inv_num_valid * grad_output``; so is the input gradient where ``input_grad_is_mean`` is
    false (float16 inputs, in a float32 buffer), else it is that of the mean loss already."""

    loss: Tensor
    soft: Tensor
    hard: Tensor
    inv_num_valid: Tensor
    grad_x: Tensor | None
    input_grad_is_mean: bool
    grad_weight: Tensor | None
    grad_bias: Tensor | None


def _chunked_forward(
    x: Tensor,
    weight: Tensor,
    teacher_x: Tensor,
    teacher_weight: Tensor,
    labels: Tensor,
    bias: Tensor | None,
    teacher_bias: Tensor | None,
    *,
    weight_hard: float,
    weight_soft: float,
    beta: float,
    ignore_index: int,
    temperature: float,
    chunk_size: int,
    chunk_kernel: _ChunkKernel,
    compute_hard: bool,
    compute_soft: bool,
    need_grad_x: bool,
    need_grad_weight: bool,
    need_grad_bias: bool,
) -> _Result:
    """Losses and gradients of 2-D inputs, ``chunk_size`` rows at a time."""
    device = x.device
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    valid = labels != ignore_index
    # The chunk functions work on the summed loss, so that their elementwise ops scale by
    # Python numbers only, and 1/num_valid (a device tensor: reading the count on the host
    # would synchronise) is applied to the float32 results before their one rounding: to the
    # losses here, to the input gradient chunk by chunk as it leaves its matmul, and to the
    # float32 weight-gradient sum in backward together with grad_output. float16 keeps its
    # input gradient in float32 too, at the summed scale, until backward: the per-row
    # gradients of a mean over many rows underflow in float16 before a loss scaler's factor
    # arrives.
    inv_num_valid = valid.sum().clamp_min(1).to(acc_dtype).reciprocal()
    input_grad_is_mean = x.dtype != torch.float16
    mean_scale = None
    if input_grad_is_mean:
        # Read on the host where that is free and the product rounds to a low precision
        # (under torch.compile the read would break the caller's graph).
        readable = device.type == "cpu" and x.dtype == torch.bfloat16
        host = float(inv_num_valid) if readable and not torch.compiler.is_compiling() else None
        mean_scale = _MeanScale(inv_num_valid, host)
    # The chunk functions leave the logit gradients of ignored rows unspecified; they are
    # dropped on the small side of the matmuls: zero input rows in the weight gradient's
    # product, zeroed rows of grad_input.
    kept_rows = valid.unsqueeze(1).to(x.dtype)
    soft_parts: list[Tensor] = []
    hard_parts: list[Tensor] = []

    grad_x_dtype = x.dtype if input_grad_is_mean else torch.float32
    grad_x = torch.empty(x.shape, dtype=grad_x_dtype, device=device) if need_grad_x else None
    # The weight gradient is summed over chunks in float32. The first chunk overwrites the
    # buffer, so it needs no zeroing pass, unless there are no rows at all.
    new_sum = torch.empty if x.shape[0] > 0 else torch.zeros
    grad_weight_acc = (
        new_sum(weight.shape, dtype=acc_dtype, device=device) if need_grad_weight else None
    )
    grad_bias_acc = (
        torch.zeros(weight.shape[0], dtype=acc_dtype, device=device) if need_grad_bias else None
    )
    # Where the logit gradients are written over teacher logits in the matmul dtype (the
    # Triton path), two chunks' worth wait for one weight-gradient matmul with twice the inner
    # dimension: the float32 sum is read and written half as often (H200, S1 at N = 8192:
    # 0.8 ms less per step). The PyTorch path's float32 teacher logits would cost twice the
    # memory for it.
    pair_chunks = compute_soft and need_grad_weight and not chunk_kernel.float_teacher
    block_rows = 2 * chunk_size if pair_chunks else chunk_size
    teacher_block = (
        torch.empty(
            min(block_rows, x.shape[0]), teacher_weight.shape[0], dtype=x.dtype, device=device
        )
        if pair_chunks
        else None
    )
    block_start = 0  # first row whose logit gradient waits for the weight-gradient matmul

    for start in range(0, x.shape[0], chunk_size):
        end = min(start + chunk_size, x.shape[0])
        x_chunk = x[start:end]
        student_logits = _logits(x_chunk, weight, bias, acc_dtype)
        if compute_soft:
            teacher_dtype = acc_dtype if chunk_kernel.float_teacher else x.dtype
            rows_in_block = None
            if teacher_block is not None:
                rows_in_block = teacher_block[start - block_start : end - block_start]
            teacher_logits = _logits(
                teacher_x[start:end], teacher_weight, teacher_bias, teacher_dtype, rows_in_block
            )
            # The gradient goes over the teacher logits, in the matmul dtype (_ChunkKernel).
            if chunk_kernel.float_teacher:
                grad_logits = _packed_over(teacher_logits, weight.dtype, weight.shape[0])
            else:
                grad_logits = teacher_logits[:, : weight.shape[0]]
            soft_chunk, hard_chunk = chunk_kernel.fn(
                student_logits,
                teacher_logits,
                labels[start:end],
                grad_out=grad_logits,
                beta=beta,
                temperature=temperature,
                ignore_index=ignore_index,
                weight_hard=weight_hard,
                weight_soft=weight_soft,
                compute_hard=compute_hard,
            )
            if not grad_logits.is_contiguous():
                teacher_logits[:, weight.shape[0] :].zero_()  # the bytes between its rows
            del teacher_logits  # grad_logits keeps its storage
            soft_parts.append(soft_chunk)
        else:
            hard_chunk = _chunk_torch.cross_entropy_chunk_(
                student_logits,
                labels[start:end],
                ignore_index=ignore_index,
                weight_hard=weight_hard,
            )
            grad_logits = student_logits.to(weight.dtype)
        del student_logits  # free it before the gradient matmuls
        hard_parts.append(hard_chunk)

        if grad_bias_acc is not None:
            # The bias gradient sums the logit gradients themselves: mask them (rarely needed).
            grad_logits.mul_(kept_rows[start:end])
            grad_bias_acc.add_(grad_logits.sum(dim=0, dtype=acc_dtype))
        if grad_x is not None:
            _input_gradient_(
                grad_x[start:end], grad_logits, weight, mean_scale, chunk_kernel.scaled_cast
            )
        if end - block_start == block_rows or end == x.shape[0]:
            if grad_weight_acc is not None:
                x_kept = x[block_start:end] * kept_rows[block_start:end]
                block_grad = (
                    grad_logits
                    if teacher_block is None
                    else teacher_block[: end - block_start, : weight.shape[0]]
                )
                _accumulate_product_(
                    grad_weight_acc, block_grad.t(), x_kept, first=block_start == 0
                )
                del block_grad
            block_start = end
        del grad_logits  # before the next chunk allocates its own (block_grad may be it too)

    if grad_x is not None:
        grad_x.masked_fill_(~valid.unsqueeze(1), 0.0)

    def total(parts: list[Tensor]) -> Tensor:
        # Summed at the end, not in a running float32 scalar.
        if not parts:
            return torch.zeros((), dtype=acc_dtype, device=device)
        return _chunk_torch.accurate_sum(torch.stack(parts)) * inv_num_valid

    soft, hard = total(soft_parts), total(hard_parts)
    # The float32 weight-gradient sum waits for backward, which scales it by
    # grad_output / num_valid and rounds it once.
    return _Result(
        loss=weight_hard * hard + weight_soft * soft,
        soft=soft,
        hard=hard,
        inv_num_valid=inv_num_valid,
        grad_x=grad_x,
        input_grad_is_mean=input_grad_is_mean,
        grad_weight=grad_weight_acc,
        grad_bias=grad_bias_acc,
    )


class _FusedLinearJSDFunction(torch.autograd.Function):
    """Forward computes the loss and the student gradients for grad_output = 1 (one pass of
    matmuls, as Liger-Kernel does); backward only scales them by grad_output."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        teacher_x: Tensor,
        teacher_weight: Tensor,
        labels: Tensor,
        bias: Tensor | None,
        teacher_bias: Tensor | None,
        weight_hard: float,
        weight_soft: float,
        beta: float,
        ignore_index: int,
        temperature: float,
        chunk_size: int,
        chunk_kernel: _ChunkKernel,
        grad_enabled: bool,
        return_soft_hard_loss: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        # needs_input_grad ignores torch.no_grad(), hence grad_enabled from the caller.
        need = [grad_enabled and flag for flag in ctx.needs_input_grad]
        compute_hard = weight_hard != 0.0 or return_soft_hard_loss
        result = _chunked_forward(
            x,
            weight,
            teacher_x,
            teacher_weight,
            labels,
            bias,
            teacher_bias,
            weight_hard=weight_hard,
            weight_soft=weight_soft,
            beta=beta,
            ignore_index=ignore_index,
            temperature=temperature,
            chunk_size=chunk_size,
            chunk_kernel=chunk_kernel,
            compute_hard=compute_hard,
            compute_soft=weight_soft != 0.0 or return_soft_hard_loss or not compute_hard,
            need_grad_x=need[0],
            need_grad_weight=need[1],
            need_grad_bias=bias is not None and need[5],
        )
        ctx.save_for_backward(
            result.inv_num_valid, result.grad_x, result.grad_weight, result.grad_bias
        )
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.input_grad_is_mean = result.input_grad_is_mean
        ctx.scaled_cast = chunk_kernel.scaled_cast
        ctx.mark_non_differentiable(result.soft, result.hard)
        return result.loss, result.soft, result.hard

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        inv_num_valid, *saved = ctx.saved_tensors
        # A 0-dim product on the device: no host sync, whatever grad_loss is (1, a loss
        # scale, the gradient flowing from a larger graph).
        scale = grad_loss * inv_num_valid
        # The input gradient of a mean loss needs grad_output alone (exact for 1 and for
        # power-of-two loss scales, in any dtype).
        scales = (grad_loss if ctx.input_grad_is_mean else scale, scale, scale)
        grads = [
            None if g is None else _scale_to(g, s, dtype, ctx.scaled_cast)
            for g, s, dtype in zip(saved, scales, ctx.dtypes)
        ]
        return (grads[0], grads[1], None, None, None, grads[2]) + (None,) * 10


def _scale_to(grad: Tensor, scale: Tensor, dtype: torch.dtype, scaled_cast: ScaledCast) -> Tensor:
    """``grad * scale`` as ``dtype``: a float32 sum is scaled and rounded in one pass."""
    if grad.dtype != dtype:
        return scaled_cast(grad, scale.to(grad.dtype), dtype)
    # A multi-tensor kernel reads the 0-dim scale on the device once; ``grad * scale`` would
    # broadcast it through the generic mixed-dtype elementwise path, several times slower on
    # a bfloat16 gradient.
    return torch._foreach_mul([grad], scale)[0]


# --------------------------------------------------------------------------- public API


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
    _check_options(beta, temperature, ignore_index, chunk_size, implementation)
    _check_tensors(
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
    chunk_kernel = _select_chunk_kernel(implementation, student_input.device, student_input.dtype)
    labels = true_labels.reshape(-1).long().contiguous()
    _check_label_range(labels, student_weight.shape[0], ignore_index)
    outputs: tuple[Tensor, Tensor, Tensor] = _FusedLinearJSDFunction.apply(  # type: ignore[no-untyped-call]
        _dense(student_input.reshape(-1, student_input.shape[-1])),
        _dense(student_weight),
        _dense(teacher_input.reshape(-1, teacher_input.shape[-1])),
        _dense(teacher_weight),
        labels,
        student_bias,
        teacher_bias,
        float(weight_hard_loss),
        float(weight_soft_loss),
        float(beta),
        ignore_index,
        float(temperature),
        chunk_size,
        chunk_kernel,
        torch.is_grad_enabled(),
        bool(return_soft_hard_loss),
    )
    return outputs if return_soft_hard_loss else outputs[0]


class FusedLinearJSDLoss(torch.nn.Module):
    """Module form of :func:`fused_linear_jsd` (drop-in for ``LigerFusedLinearJSDLoss``).

    The options are fixed at construction (and checked there); ``forward`` takes the tensors.
    See :func:`fused_linear_jsd` for the meaning of every argument.
    """

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
        _check_options(beta, temperature, ignore_index, chunk_size, implementation)
        self.weight_hard_loss = weight_hard_loss
        self.weight_soft_loss = weight_soft_loss
        self.beta = beta
        self.ignore_index = ignore_index
        self.temperature = temperature
        self.compiled = compiled
        self.chunk_size = chunk_size
        self.return_soft_hard_loss = return_soft_hard_loss
        self.implementation = implementation

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

    def extra_repr(self) -> str:
        return (
            f"weight_hard_loss={self.weight_hard_loss}, weight_soft_loss={self.weight_soft_loss}, "
            f"beta={self.beta}, ignore_index={self.ignore_index}, "
            f"temperature={self.temperature}, chunk_size={self.chunk_size}, "
            f"implementation={self.implementation!r}"
        )
