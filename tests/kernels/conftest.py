"""Shared inputs and runner for the fused-linear JSD kernel tests.

Tensors are drawn on the CPU from a local generator and then moved to the gradref device, so
every device sees the same numbers and no test seeds anything device-specific.
"""

from __future__ import annotations

import dataclasses
import math
import os
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


def _runs_triton(item: pytest.Item) -> bool:
    """Whether a test runs the Triton kernels: it asks for ``triton_device``, or takes the
    "triton" parameter of ``implementation`` or ``kernel``."""
    params = getattr(item, "callspec", None)
    chosen = params.params.values() if params is not None else ()
    return "triton_device" in getattr(item, "fixturenames", ()) or "triton" in chosen


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Where Triton runs in its CPU interpreter (no CUDA: the root conftest chose it), its tests
    # check Triton's code, not a path the device has, at about a second a test: they belong to
    # the exhaustive run (the test command and CI), not to the README's main job, which
    # deselects the exhaustive marker.
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    for item in items:
        if _runs_triton(item):
            item.add_marker(pytest.mark.exhaustive)


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


@pytest.fixture(params=["torch", "triton"])
def implementation(request: pytest.FixtureRequest) -> str:
    """Each path of the fused loss, by its ``implementation`` name; the Triton one skips,
    saying why, where its kernels cannot run."""
    if request.param == "triton":
        request.getfixturevalue("triton_device")
    return str(request.param)


class GapCheckingMatmuls(torch.overrides.TorchFunctionMode):
    """Fails every matmul handed an operand with nonzero bytes between its rows.

    Some matmul kernels read past the last column of a row: oneDNN's AMX bfloat16 kernel
    (oneDNN 3.12, as in torch 2.13's CPU build) loads whole 32-column tiles and relies on the
    other operand's zero padding to cancel the extra columns, so a NaN or inf between the rows
    of a strided operand turns whole rows of the result into NaN, on those CPUs only. This mode
    makes the hazard fail on every machine: for each matrix operand it reads the elements
    between its rows (the span from the end of one row to the start of the next, and the last
    row's own pitch within its storage) and raises if any is not zero. ``checked`` counts the
    operands inspected and ``strided`` those that had a pitch wider than their rows.
    """

    MATMULS = frozenset(
        {
            torch.mm,
            torch.addmm,
            torch.matmul,
            torch.bmm,
            torch.baddbmm,
            torch.nn.functional.linear,
            Tensor.mm,
            Tensor.addmm,
            Tensor.addmm_,
            Tensor.matmul,
            Tensor.__matmul__,
            Tensor.__rmatmul__,
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self.checked = 0
        self.strided = 0

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in self.MATMULS:
            # addmm's first argument is the addend, not a matrix operand of the product.
            operands = args[1:3] if func in (torch.addmm, Tensor.addmm, Tensor.addmm_) else args
            for position, operand in enumerate(operands):
                if isinstance(operand, Tensor) and operand.dim() == 2:
                    self._check(func, position, operand)
        if getattr(func, "namespace", None) == "gradref_kernels":
            # A mode is off while its handler runs, and calling the operator again would come
            # back here: the fused loss's custom operators run their Python functions with the
            # mode on, so that it sees the matmuls inside them.
            opdef = torch._library.custom_ops._maybe_get_opdef(func)
            with self:
                return opdef._init_fn(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))

    def _check(self, func: Any, position: int, matrix: Tensor) -> None:
        self.checked += 1
        between = bytes_between_rows(matrix)
        if between is None:
            return
        self.strided += 1
        nonzero = int(torch.count_nonzero(between))
        if nonzero:
            raise AssertionError(
                f"{getattr(func, '__name__', func)} operand {position} {tuple(matrix.shape)} "
                f"{matrix.dtype}, strides {matrix.stride()}: {nonzero} nonzero element(s) "
                f"({int((~between.isfinite()).sum())} not finite) lie between its rows, where "
                "a matmul kernel may read them; pack the operand or zero the gaps"
            )


def bytes_between_rows(matrix: Tensor) -> Tensor | None:
    """The elements between the lines of a 2-D tensor's unit-stride dimension, read in its
    dtype from its storage (None when it has no such gaps): from the end of each line to the
    start of the next, and from the end of the last to where a next line would start, as far
    as the storage reaches."""
    inner = [d for d in (1, 0) if matrix.stride(d) == 1 or matrix.shape[d] == 1]
    if not inner or matrix.numel() == 0:
        if matrix.numel() == 0:
            return None
        raise AssertionError(f"matmul operand with no unit stride: strides {matrix.stride()}")
    inner_dim = inner[0]
    outer_dim = 1 - inner_dim
    line, lines = matrix.shape[inner_dim], matrix.shape[outer_dim]
    pitch = matrix.stride(outer_dim) if lines > 1 else line
    if pitch <= line:
        return None
    storage = matrix.untyped_storage()
    flat = torch.empty(0, dtype=matrix.dtype, device=matrix.device)
    flat.set_(storage, 0, (storage.nbytes() // matrix.element_size(),))
    start = matrix.storage_offset()
    end = min(flat.numel(), start + lines * pitch)
    covered = torch.zeros(end - start, dtype=torch.bool, device=matrix.device)
    torch.as_strided(covered, (lines, line), (pitch, 1)).fill_(True)
    return flat[start:end][~covered]


@pytest.fixture
def gap_checking_matmuls() -> Any:
    """A :class:`GapCheckingMatmuls` mode, active for the test."""
    with GapCheckingMatmuls() as mode:
        yield mode
