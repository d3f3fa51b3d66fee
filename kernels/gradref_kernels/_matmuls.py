"""The matmuls of the fused loss: the logits, the input gradient and the float32 sum of the
weight gradient, in the matmul dtype, with the operand layouts they need."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ._dispatch import ScaledCast


@functools.cache
def mixed_matmul(device_type: str, dtype: torch.dtype) -> bool:
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


@functools.cache
def _onednn_multiplies(dtype: torch.dtype) -> bool:
    """Whether torch's oneDNN has matrix-product kernels for ``dtype`` on this CPU."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]  # untyped in torch
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def products_via_float32(device_type: str, dtype: torch.dtype) -> bool:
    """Whether the products of ``dtype`` matrices run on float32 copies here: bfloat16 and
    float16 on a CPU where torch has no oneDNN kernel for them (x86 before AVX-512, or oneDNN
    switched off with ``torch.backends.mkldnn``).

    torch falls back to a scalar loop there, and a linear layer's input-gradient product
    (``g @ w``, both row-major) runs 200 times slower than the same product of float32 copies
    (benchmarks/results/cpu/cpu_gemm.txt). Products of low-precision numbers are exact in
    float32 and the oneDNN and CUDA kernels sum them in float32 too, so the copies change only
    the order of the sums; a result wanted in the low-precision dtype is rounded once.
    """
    if device_type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return False
    return not (torch.backends.mkldnn.enabled and _onednn_multiplies(dtype))


def float32_product(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """``a @ b`` of matmul-dtype operands as float32, never rounded to their dtype: straight
    into float32 where the device supports it (:func:`mixed_matmul`), else the product of
    float32 copies (:func:`products_via_float32`)."""
    if mixed_matmul(a.device.type, a.dtype):
        if out is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)


def products_in_float32(device_type: str, dtype: torch.dtype) -> bool:
    """Whether :func:`float32_product` of ``dtype`` operands costs no more than a product in
    ``dtype``: on CUDA, and where ``dtype``'s own products are a scalar loop."""
    return mixed_matmul(device_type, dtype) or products_via_float32(device_type, dtype)


def compute_logits(
    x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, out: Tensor | None = None
) -> Tensor:
    """``x @ weight.T + bias`` as a ``dtype`` tensor (the matmul dtype or float32/64): ``out``
    if given (in the matmul dtype only), else a new one.

    Low-precision inputs are multiplied in their dtype (every accelerator's fast path), into
    float32 directly where the device supports it, else rounded and then cast; the bias is
    added in ``dtype``. Where their products run on float32 copies (a CPU without oneDNN
    kernels for them), the bias is added to the float32 product, rounded once where ``dtype``
    is theirs."""
    if products_via_float32(x.device.type, x.dtype):
        logits = float32_product(x, weight.t())
        if bias is not None:
            logits.add_(bias)
        return logits.to(dtype) if out is None else out.copy_(logits)
    if x.dtype == dtype:
        if bias is None:
            return torch.mm(x, weight.t(), out=out)
        return torch.addmm(bias, x, weight.t(), out=out)
    assert out is None, "out= takes logits in the matmul dtype only"
    if mixed_matmul(x.device.type, x.dtype) and dtype == torch.float32:
        logits = float32_product(x, weight.t())
    else:
        logits = (x @ weight.t()).to(dtype)
    return logits if bias is None else logits.add_(bias)


def packed_over(logits: Tensor, dtype: torch.dtype, columns: int) -> Tensor:
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


def dense(matrix: Tensor) -> Tensor:
    """``matrix`` if its elements fill their span of memory (row- or column-major), else a
    contiguous copy: no matmul is handed an operand with bytes between its rows, whose
    contents nobody controls (see :func:`packed_over`)."""
    if matrix.is_contiguous() or matrix.t().is_contiguous():
        return matrix
    return matrix.contiguous()


def accumulate_product_(acc: Tensor, a: Tensor, b: Tensor, *, first: bool) -> None:
    """``acc += a @ b`` (``acc = a @ b`` when ``first``, whatever ``acc`` held) with ``acc``
    in float32 (or float64) and a, b in the matmul dtype: exact products summed in float32,
    rounded to the matmul dtype nowhere (backward rounds the scaled sum once)."""
    # beta=0 ignores acc's contents, NaN included: the buffer need not be zeroed first.
    beta = 0.0 if first else 1.0
    if acc.dtype == a.dtype:
        acc.addmm_(a, b, beta=beta)
    elif mixed_matmul(a.device.type, a.dtype) and acc.dtype == torch.float32:
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    else:
        # No low-precision matmul into float32 here (the CPU): multiply float32 copies, a
        # chunk of the logit gradient at a time (the size of the student logits just freed).
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)


@dataclass(frozen=True)
class MeanScale:
    """1/num_valid: as a 0-dim device tensor, and as a Python number where reading it costs
    nothing (on the CPU; elsewhere it would synchronise with the device)."""

    tensor: Tensor
    host: float | None


def input_gradient_(
    out: Tensor,
    grad_logits: Tensor,
    weight: Tensor,
    mean_scale: MeanScale | None,
    scaled_cast: ScaledCast,
) -> None:
    """``out = grad_logits @ weight``, times ``mean_scale`` when given, rounded once to out's
    dtype where the device allows it.

    With a mean scale the product is scaled in float32 before its one rounding: by the matmul
    itself (``alpha``) where the scale is a Python number and the device multiplies in the
    matmul dtype, else by a scaled cast of a float32 product where the device has one as cheap
    (:func:`products_in_float32`). Where neither holds (a device without that product, whose
    count cannot be read for free) the product is rounded, then scaled and rounded again.
    Without one, ``out`` is a float32 buffer that waits for backward (float16 inputs), and gets
    the float32 product where the device has it, else the product rounded to float16."""
    in_float32 = products_in_float32(grad_logits.device.type, grad_logits.dtype)
    if mean_scale is None:
        if in_float32:
            float32_product(grad_logits, weight, out=out)
        else:
            out.copy_(grad_logits @ weight)
    elif out.dtype in (torch.float32, torch.float64) or (
        mean_scale.host is None and not in_float32
    ):
        # In float32 the scaling's rounding is negligible; elsewhere the fallback above.
        torch.mm(grad_logits, weight, out=out)
        out.mul_(mean_scale.tensor)
    elif in_float32 or mean_scale.host is None:
        product = float32_product(grad_logits, weight)
        scaled_cast(product, mean_scale.tensor.float(), out.dtype, out)
    else:
        # beta=0 ignores out's contents, NaN included.
        torch.addmm(out, grad_logits, weight, beta=0.0, alpha=mean_scale.host, out=out)
