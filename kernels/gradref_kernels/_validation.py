"""Checks of the arguments of the fused loss: the scalar options, the tensors' types, devices,
dtypes and shapes, and the range of the labels."""

from __future__ import annotations

import math

import torch
from torch import Tensor

_IMPLEMENTATIONS = ("auto", "torch", "triton")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_options(
    beta: float, temperature: float, ignore_index: int, chunk_size: int, implementation: str
) -> None:
    """Checks of the scalar options, shared by the functional and the module constructor."""
    # Comparisons rather than math.isfinite: under torch.compile(dynamic=True) a float option
    # may arrive as a symbolic float, which comparisons guard on and math functions reject.
    if not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
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


def check_tensors(tensors: dict[str, Tensor | None]) -> None:
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


def check_label_range(labels: Tensor, vocab: int, ignore_index: int) -> None:
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
