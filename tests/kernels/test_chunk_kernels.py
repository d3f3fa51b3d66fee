"""The per-chunk kernels against the float64 full-logits reference, differentiated by autograd.

Every case runs on the portable PyTorch chunk function (in one slice, and in slices of a few
rows with a partial last one) and on the Triton kernel. The reference
(:func:`_chunk_reference.chunk_reference`, beside this file) builds the loss from its definition
(log-softmax, KL, cross-entropy), so it shares no algebra with the kernels' closed-form
gradients. Shapes stay small: on machines without CUDA the Triton kernel runs in Triton's CPU
interpreter.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _chunk_reference import IGNORE_INDEX, chunk_options, chunk_reference
from gradref_kernels import _chunk_torch, _chunk_triton
from gradref_kernels._chunk_triton import jsd_chunk_, scaled_cast, triton_unavailable_reason
from gradref_kernels._options import LossOptions
from torch import Tensor

# Small tiles so every row spans several tiles and ends in a partial one.
BLOCK_V = 64
RTOL = 1e-5
# Log-space fp32 values of magnitude ~20 carry ~1e-6 absolute error, so gradient entries are
# compared with an absolute slack relative to the largest one (fp32 torch does no better).
GRAD_ATOL_SCALE = 2e-5
LOSS_ATOL = 1e-6


# Rows per slice for the "torch-slices" kernel: several slices, the last one partial.
SLICE_ROWS = 4


@dataclasses.dataclass(frozen=True)
class ChunkKernel:
    """One per-chunk implementation."""

    name: str
    device: torch.device

    def __call__(
        self,
        student: Tensor,
        teacher: Tensor,
        labels: Tensor,
        *,
        grad_out: Tensor,
        options: LossOptions,
    ) -> tuple[Tensor, Tensor]:
        if self.name == "triton":
            return _chunk_triton._launch(
                student,
                teacher,
                labels,
                grad_out=grad_out,
                options=options,
                block_v=BLOCK_V,
                num_warps=4,
            )
        if self.name == "torch-slices":
            return _chunk_torch._chunk_(
                student, teacher, labels, grad_out, SLICE_ROWS, options=options
            )
        return _chunk_torch.jsd_chunk_(student, teacher, labels, grad_out=grad_out, options=options)


@pytest.fixture(params=["torch", "torch-slices", "triton"])
def kernel(request: pytest.FixtureRequest, gradref_device: torch.device) -> ChunkKernel:
    if request.param == "triton":
        request.getfixturevalue("triton_device")  # skips where the kernel cannot run
    return ChunkKernel(request.param, gradref_device)


def make_inputs(
    device: torch.device,
    n: int = 6,
    vs: int = 200,
    vt: int = 200,
    ignored: tuple[int, ...] = (1, 4),
) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1234 + n + vs + vt)
    student = 2.0 * torch.randn(n, vs, generator=gen)
    teacher = 2.0 * torch.randn(n, vt, generator=gen)
    labels = torch.randint(0, vs, (n,), generator=gen)
    labels[list(ignored)] = IGNORE_INDEX
    return student.to(device), teacher.to(device), labels.to(device)


def run_kernel(
    kernel: ChunkKernel, student: Tensor, teacher: Tensor, labels: Tensor, options: LossOptions
) -> tuple[Tensor, Tensor, Tensor]:
    """(gradient, soft, hard) of the kernel on copies of the logits; the gradient is written
    over the teacher logits, as the fused loss does. The gradient rows of ignored labels are
    unspecified: they are zeroed here, as the fused loss drops them."""
    out = teacher.clone()
    vocab_s = student.shape[1]
    grad = out[:, :vocab_s]
    soft, hard = kernel(student.clone(), out, labels, grad_out=grad, options=options)
    assert grad.isfinite().all(), "every gradient row, ignored ones included, must be finite"
    return grad.masked_fill((labels == IGNORE_INDEX).unsqueeze(1), 0.0), soft, hard


def assert_close_to_float64(
    grad: Tensor, soft: Tensor, hard: Tensor, ref_grad: Tensor, ref_soft: Tensor, ref_hard: Tensor
) -> None:
    atol = GRAD_ATOL_SCALE * ref_grad.abs().max().item()
    torch.testing.assert_close(grad.double(), ref_grad, rtol=RTOL, atol=atol)
    torch.testing.assert_close(soft.double(), ref_soft, rtol=RTOL, atol=LOSS_ATOL)
    torch.testing.assert_close(hard.double(), ref_hard, rtol=RTOL, atol=LOSS_ATOL)


def assert_matches_reference(
    kernel: ChunkKernel, student: Tensor, teacher: Tensor, labels: Tensor, options: LossOptions
) -> None:
    grad, soft, hard = run_kernel(kernel, student, teacher, labels, options)
    ref_grad, ref_soft, ref_hard = chunk_reference(student, teacher, labels, options)
    assert_close_to_float64(grad, soft, hard, ref_grad, ref_soft, ref_hard)
    assert soft.dim() == hard.dim() == 0


@pytest.mark.parametrize("compute_hard", [True, False], ids=["hard", "soft-only"])
@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_matches_float64(
    kernel: ChunkKernel, beta: float, temperature: float, compute_hard: bool
) -> None:
    student, teacher, labels = make_inputs(kernel.device)
    options = chunk_options(beta, temperature, compute_hard)
    assert_matches_reference(kernel, student, teacher, labels, options)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_teacher_vocabulary_larger_pads_student(
    kernel: ChunkKernel, beta: float, temperature: float
) -> None:
    # At temperature 1 the hard loss's log-sum-exp must leave the padding columns out.
    student, teacher, labels = make_inputs(kernel.device, vs=150, vt=195)
    assert_matches_reference(kernel, student, teacher, labels, chunk_options(beta, temperature))


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_single_row(kernel: ChunkKernel, beta: float) -> None:
    student, teacher, labels = make_inputs(kernel.device, n=1, vs=70, vt=70, ignored=())
    assert_matches_reference(kernel, student, teacher, labels, chunk_options(beta, 2.0))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_all_rows_ignored(kernel: ChunkKernel, beta: float) -> None:
    student, teacher, labels = make_inputs(kernel.device, n=3, ignored=(0, 1, 2))
    # run_kernel checks that the (unspecified) gradient rows are finite.
    _, soft, hard = run_kernel(kernel, student, teacher, labels, chunk_options(beta, 1.0))
    assert soft.item() == 0.0
    assert hard.item() == 0.0


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5])
def test_teacher_with_zero_probabilities(kernel: ChunkKernel, beta: float) -> None:
    # beta == 1 is left out: KL(S || T) is infinite where T is exactly zero.
    student, teacher, labels = make_inputs(kernel.device)
    teacher[:, ::3] = -1e30
    teacher[2, :BLOCK_V] = -1e30  # a whole tile of zeros
    options = chunk_options(beta, 0.5)
    assert_matches_reference(kernel, student, teacher, labels, options)
    # -inf gives the same zeros; the kernel must not turn 0 * log 0 into NaN.
    finite = run_kernel(kernel, student, teacher, labels, options)
    teacher_inf = teacher.masked_fill(teacher == -1e30, float("-inf"))
    infinite = run_kernel(kernel, student, teacher_inf, labels, options)
    for a, b in zip(finite, infinite):
        assert torch.equal(a, b)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_bitwise_reproducible(kernel: ChunkKernel, beta: float) -> None:
    student, teacher, labels = make_inputs(kernel.device)
    options = chunk_options(beta, 2.0)
    first = run_kernel(kernel, student, teacher, labels, options)
    second = run_kernel(kernel, student, teacher, labels, options)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_bf16_teacher_logits(kernel: ChunkKernel, beta: float) -> None:
    # The configuration the fused loss runs in bf16: bf16 teacher logits in, read as fp32, and
    # the gradient written over them in bf16, rounded once from the fp32 result.
    student, teacher, labels = make_inputs(kernel.device, vs=150, vt=170)
    teacher_bf16 = teacher.to(torch.bfloat16)
    options = chunk_options(beta, 2.0)
    grad_fp32, soft_fp32, hard_fp32 = run_kernel(
        kernel, student, teacher_bf16.float(), labels, options
    )
    grad_bf16, soft, hard = run_kernel(kernel, student, teacher_bf16, labels, options)
    assert grad_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(soft, soft_fp32, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(hard, hard_fp32, rtol=1e-6, atol=0.0)
    # The bf16 teacher is read exactly: the result is the float64 answer for those logits.
    ref_grad, ref_soft, ref_hard = chunk_reference(student, teacher_bf16.float(), labels, options)
    assert_close_to_float64(grad_fp32, soft, hard, ref_grad, ref_soft, ref_hard)
    # The fp32 gradient rounded once, to nearest even, on every backend.
    assert torch.equal(grad_bf16, grad_fp32.bfloat16())


@pytest.mark.parametrize("vocab_t", [200, 230], ids=["same-vocab", "wider-teacher"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_torch_bf16_gradient_over_float32_teacher(
    gradref_device: torch.device, beta: float, vocab_t: int
) -> None:
    # The layout the fused loss gives the PyTorch path: float32 teacher logits, and the bf16
    # gradient packed at the start of their storage (row i within rows 0..i, so slices after
    # the first land on rows already read), slice after slice.
    student, teacher, labels = make_inputs(gradref_device, vs=200, vt=vocab_t)
    options = chunk_options(beta, 1.0)
    grad_fp32 = torch.empty_like(student)
    expected = _chunk_torch._chunk_(
        student.clone(), teacher.clone(), labels, grad_fp32, SLICE_ROWS, options=options
    )
    shared = teacher.clone()
    grad_bf16 = shared.view(-1).view(torch.bfloat16)[: 200 * shared.shape[0]].view(-1, 200)
    losses = _chunk_torch._chunk_(
        student.clone(), shared, labels, grad_bf16, SLICE_ROWS, options=options
    )
    assert torch.equal(torch.stack(losses), torch.stack(expected))
    valid = labels != IGNORE_INDEX
    # Rounded once from the same float32 result.
    assert torch.equal(grad_bf16[valid], grad_fp32[valid].bfloat16())


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_matches_torch_chunk(triton_device: torch.device, beta: float, temperature: float) -> None:
    student, teacher, labels = make_inputs(triton_device, vs=150, vt=170)
    options = chunk_options(beta, temperature)
    out_triton, out_torch = teacher.clone(), teacher.clone()
    losses_triton = jsd_chunk_(
        student, out_triton, labels, grad_out=out_triton[:, :150], options=options
    )
    losses_torch = _chunk_torch.jsd_chunk_(
        student.clone(), out_torch, labels, grad_out=out_torch[:, :150], options=options
    )
    valid = labels != IGNORE_INDEX
    grad_triton, grad_torch = out_triton[valid, :150], out_torch[valid, :150]
    atol = GRAD_ATOL_SCALE * grad_torch.abs().max().item()
    torch.testing.assert_close(grad_triton, grad_torch, rtol=RTOL, atol=atol)
    torch.testing.assert_close(losses_triton, losses_torch, rtol=RTOL, atol=LOSS_ATOL)


def test_rejects_bad_input(triton_device: torch.device) -> None:
    student, teacher, labels = make_inputs(triton_device)
    options = chunk_options(0.5, 1.0)
    with pytest.raises(TypeError, match="fp32"):
        jsd_chunk_(student.double(), teacher, labels, grad_out=student, options=options)
    with pytest.raises(ValueError, match="at least its 200 columns"):
        jsd_chunk_(
            student, teacher[:, :100].contiguous(), labels, grad_out=student, options=options
        )
    with pytest.raises(ValueError, match="labels must be contiguous int64"):
        jsd_chunk_(student, teacher, labels.int(), grad_out=student, options=options)
    bad_beta = dataclasses.replace(options, beta=1.5)
    with pytest.raises(ValueError, match="beta"):
        jsd_chunk_(student, teacher, labels, grad_out=student, options=bad_beta)
    with pytest.raises(ValueError, match="grad_out must be a floating"):
        jsd_chunk_(student, teacher, labels, grad_out=student[:, :10], options=options)


def test_out_of_range_label_poisons_the_hard_loss(triton_device: torch.device) -> None:
    # Checking labels on the host would need a synchronisation; a NaN loss is the signal.
    student, teacher, labels = make_inputs(triton_device)
    labels[0] = student.shape[1]
    triton = ChunkKernel("triton", triton_device)
    _, soft, hard = run_kernel(triton, student, teacher, labels, chunk_options(0.5, 1.0))
    assert hard.isnan()
    assert soft.isfinite()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 4096, 3 * 4096 + 5])
def test_scaled_cast_rounds_once(
    triton_device: torch.device, dtype: torch.dtype, numel: int
) -> None:
    gen = torch.Generator().manual_seed(numel)
    source = (1e3 * torch.randn(numel, generator=gen)).to(triton_device)
    scale = torch.tensor(0.37, device=triton_device)
    result, expected = scaled_cast(source, scale, dtype), (source * scale).to(dtype)
    # float32 product, then one round-to-nearest-even: exactly what PyTorch gives (bfloat16
    # is rounded on the bits, since Triton's CPU interpreter truncates a plain cast).
    assert torch.equal(result, expected)
    out = torch.empty_like(expected)
    assert scaled_cast(source, scale, dtype, out) is out
    assert torch.equal(out, expected)
    matrix = source[: numel - numel % 3].view(3, -1)
    assert scaled_cast(matrix, scale, dtype).shape == matrix.shape


def test_scaled_cast_rejects_bad_input(triton_device: torch.device) -> None:
    source = torch.ones(4, 6, device=triton_device)
    scale = torch.tensor(2.0, device=triton_device)
    with pytest.raises(ValueError, match="contiguous float32"):
        scaled_cast(source.t(), scale, torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous float32"):
        scaled_cast(source.double(), scale, torch.bfloat16)
    with pytest.raises(ValueError, match="0-dim"):
        scaled_cast(source, scale.reshape(1), torch.bfloat16)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.bfloat16 tensor"):
        scaled_cast(source, scale, torch.bfloat16, torch.empty(6, 4, dtype=torch.bfloat16).t())


def test_unavailable_reason_names_the_device() -> None:
    reason = triton_unavailable_reason(torch.device("meta"))
    assert reason is not None
    assert "meta" in reason or "triton" in reason
