"""The choice of the per-chunk function: the Triton kernel where it is asked for or can run, else
the portable PyTorch math."""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from . import _chunk_torch

ChunkFn = Callable[..., tuple[Tensor, Tensor]]
ScaledCast = Callable[..., Tensor]


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
class ChunkKernel:
    """A per-chunk function and the teacher logits it takes: in the work dtype (float32;
    the PyTorch math would otherwise convert a bfloat16 teacher in a pass of its own) or in the
    matmul dtype (the Triton kernel reads them as float32 as it goes, from half the bytes).

    Either writes the logit gradient over the teacher logits' storage, without bytes between
    its rows (the matmuls read it next): the PyTorch math, which writes slice after slice,
    packed at the start of the storage (:func:`._matmuls.packed_over`); the Triton kernel, whose
    programs run rows concurrently, row for row, with the teacher's extra columns zeroed after
    it when the teacher's vocabulary is larger.

    ``scaled_cast(source, scale, dtype, out=None)`` scales a float32 gradient and rounds it
    to ``dtype`` in one pass (the Triton module's kernel, or one PyTorch op): float32 sums are
    rounded to a low-precision dtype once, after their scaling."""

    fn: ChunkFn
    float_teacher: bool
    scaled_cast: ScaledCast


def select_chunk_kernel(
    implementation: str, device: torch.device, dtype: torch.dtype
) -> ChunkKernel:
    """The per-chunk function: Triton where asked for or (for "auto") where it can run, else
    the portable PyTorch math."""
    # "auto" takes Triton on CUDA only; an explicit "triton" also runs wherever the module
    # says it can (e.g. CPU tensors under TRITON_INTERPRET=1, which tests the kernel anywhere).
    # Called by the custom operators of ``_ops`` as they run, never by traced code: under
    # torch.compile a compiled step takes the same path as eager.
    if implementation == "triton" or (implementation == "auto" and device.type == "cuda"):
        module, reason = _triton_module(device, dtype)
        if module is not None:
            return ChunkKernel(
                module.jsd_chunk_, float_teacher=False, scaled_cast=module.scaled_cast
            )
        if implementation == "triton":
            raise RuntimeError(
                f"implementation='triton' cannot run: {reason}. "
                "Use implementation='torch' (portable) or 'auto'."
            )
    return ChunkKernel(
        _chunk_torch.jsd_chunk_, float_teacher=True, scaled_cast=_chunk_torch.scaled_cast
    )
