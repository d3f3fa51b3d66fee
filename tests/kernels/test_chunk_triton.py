"""The Triton chunk kernel against the float64 full-logits reference, differentiated by autograd.

The reference builds the loss from its definition (log-softmax, KL, cross-entropy), so it shares
no algebra with the kernel's closed-form gradient. Shapes stay small: on machines without CUDA
the kernel runs in Triton's CPU interpreter.
"""

from __future__ import annotations

import pytest
import torch
from gradref_kernels import _chunk_torch, _chunk_triton
from gradref_kernels._chunk_triton import jsd_chunk_, triton_unavailable_reason
from gradref_kernels.reference import jsd_distillation_reference
from torch import Tensor

IGNORE = -100
WEIGHT_HARD, WEIGHT_SOFT = 0.4, 0.7
# Small tiles so every row spans several tiles and ends in a partial one.
BLOCK_V = 64
RTOL = 1e-5
# Log-space fp32 values of magnitude ~20 carry ~1e-6 absolute error, so gradient entries are
# compared with an absolute slack relative to the largest one (fp32 torch does no better).
GRAD_ATOL_SCALE = 2e-5
LOSS_ATOL = 1e-6


@pytest.fixture
def device(gradref_device: torch.device) -> torch.device:
    reason = triton_unavailable_reason(gradref_device)
    if reason is not None:
        pytest.skip(reason)
    return gradref_device


def make_inputs(
    device: torch.device,
    n: int = 6,
    vs: int = 200,
    vt: int = 200,
    ignored: tuple[int, ...] = (1, 4),
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1234 + n + vs + vt)
    student = 2.0 * torch.randn(n, vs, generator=gen)
    teacher = 2.0 * torch.randn(n, vt, generator=gen)
    labels = torch.randint(0, vs, (n,), generator=gen)
    labels[list(ignored)] = IGNORE
    inv = torch.tensor(1.0 / max(1, int((labels != IGNORE).sum())))
    return student.to(device), teacher.to(device), labels.to(device), inv.to(device)


def reference(
    student: Tensor,
    teacher: Tensor,
    labels: Tensor,
    *,
    beta: float,
    temperature: float,
    compute_hard: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dLoss/dstudent, soft, hard) in float64 from the full-logits reference and autograd.

    The reference takes inputs and weights; an identity input with the transposed logits as
    the weight reproduces the logits, and the weight's gradient is the logits' one, transposed.
    """
    eye = torch.eye(student.shape[0], dtype=torch.float64, device=student.device)
    weight = student.double().T.contiguous().requires_grad_(True)

    def loss(weight_hard: float, weight_soft: float) -> Tensor:
        return jsd_distillation_reference(
            eye,
            weight,
            eye,
            teacher.double().T,
            labels,
            weight_hard_loss=weight_hard,
            weight_soft_loss=weight_soft,
            beta=beta,
            ignore_index=IGNORE,
            temperature=temperature,
        )

    soft = loss(0.0, 1.0)
    hard = loss(1.0, 0.0) if compute_hard else torch.zeros_like(soft)
    (WEIGHT_SOFT * soft + WEIGHT_HARD * hard).backward()
    assert weight.grad is not None
    return weight.grad.T, soft.detach(), hard.detach()


def run_kernel(
    student: Tensor,
    teacher: Tensor,
    labels: Tensor,
    inv: Tensor,
    *,
    beta: float,
    temperature: float,
    compute_hard: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(gradient, soft, hard) of the kernel with small tiles, on a copy of the logits."""
    grad = student.clone()
    soft, hard = _chunk_triton._launch(
        grad,
        teacher,
        labels,
        inv,
        beta=beta,
        temperature=temperature,
        ignore_index=IGNORE,
        weight_hard=WEIGHT_HARD,
        weight_soft=WEIGHT_SOFT,
        compute_hard=compute_hard,
        grad_out=None,
        block_v=BLOCK_V,
        num_warps=4,
    )
    return grad, soft, hard


def assert_close_to_float64(
    grad: Tensor, soft: Tensor, hard: Tensor, ref_grad: Tensor, ref_soft: Tensor, ref_hard: Tensor
) -> None:
    atol = GRAD_ATOL_SCALE * ref_grad.abs().max().item()
    torch.testing.assert_close(grad.double(), ref_grad, rtol=RTOL, atol=atol)
    torch.testing.assert_close(soft.double(), ref_soft, rtol=RTOL, atol=LOSS_ATOL)
    torch.testing.assert_close(hard.double(), ref_hard, rtol=RTOL, atol=LOSS_ATOL)


def assert_matches_reference(
    student: Tensor,
    teacher: Tensor,
    labels: Tensor,
    inv: Tensor,
    *,
    beta: float,
    temperature: float,
    compute_hard: bool,
) -> None:
    kwargs = {"beta": beta, "temperature": temperature, "compute_hard": compute_hard}
    grad, soft, hard = run_kernel(student, teacher, labels, inv, **kwargs)
    ref_grad, ref_soft, ref_hard = reference(student, teacher, labels, **kwargs)
    assert_close_to_float64(grad, soft, hard, ref_grad, ref_soft, ref_hard)
    assert soft.dim() == hard.dim() == 0
    assert not grad[labels == IGNORE].any(), "ignored rows must get zero gradient"


@pytest.mark.parametrize("compute_hard", [True, False], ids=["hard", "soft-only"])
@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_matches_float64(
    device: torch.device, beta: float, temperature: float, compute_hard: bool
) -> None:
    student, teacher, labels, inv = make_inputs(device)
    assert_matches_reference(
        student, teacher, labels, inv, beta=beta, temperature=temperature, compute_hard=compute_hard
    )


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_teacher_vocabulary_larger_pads_student(
    device: torch.device, beta: float, temperature: float
) -> None:
    # At temperature 1 the hard loss's log-sum-exp must leave the padding columns out.
    student, teacher, labels, inv = make_inputs(device, vs=150, vt=195)
    assert_matches_reference(
        student, teacher, labels, inv, beta=beta, temperature=temperature, compute_hard=True
    )


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5])
def test_single_row(device: torch.device, beta: float) -> None:
    student, teacher, labels, inv = make_inputs(device, n=1, vs=70, vt=70, ignored=())
    assert_matches_reference(
        student, teacher, labels, inv, beta=beta, temperature=2.0, compute_hard=True
    )


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_all_rows_ignored(device: torch.device, beta: float) -> None:
    student, teacher, labels, inv = make_inputs(device, n=3, ignored=(0, 1, 2))
    grad, soft, hard = run_kernel(
        student, teacher, labels, inv, beta=beta, temperature=1.0, compute_hard=True
    )
    assert not grad.any()
    assert soft.item() == 0.0
    assert hard.item() == 0.0


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5])
def test_teacher_with_zero_probabilities(device: torch.device, beta: float) -> None:
    # beta == 1 is left out: KL(S || T) is infinite where T is exactly zero.
    student, teacher, labels, inv = make_inputs(device)
    teacher[:, ::3] = -1e30
    teacher[2, :BLOCK_V] = -1e30  # a whole tile of zeros
    assert_matches_reference(
        student, teacher, labels, inv, beta=beta, temperature=0.5, compute_hard=True
    )
    # -inf gives the same zeros; the kernel must not turn 0 * log 0 into NaN.
    kwargs = {"beta": beta, "temperature": 0.5, "compute_hard": True}
    finite = run_kernel(student, teacher, labels, inv, **kwargs)
    teacher_inf = teacher.masked_fill(teacher == -1e30, float("-inf"))
    infinite = run_kernel(student, teacher_inf, labels, inv, **kwargs)
    for a, b in zip(finite, infinite):
        assert torch.equal(a, b)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_bitwise_reproducible(device: torch.device, beta: float) -> None:
    student, teacher, labels, inv = make_inputs(device)
    kwargs = {"beta": beta, "temperature": 2.0, "compute_hard": True}
    first = run_kernel(student, teacher, labels, inv, **kwargs)
    second = run_kernel(student, teacher, labels, inv, **kwargs)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_matmul_dtype_gradient_output(device: torch.device, beta: float) -> None:
    # The configuration the fused loss runs on CUDA: bf16 teacher logits in, the gradient out
    # in bf16 instead of over the fp32 student logits, which stay as they were.
    student, teacher, labels, inv = make_inputs(device, vs=150, vt=170)
    teacher_bf16 = teacher.to(torch.bfloat16)
    kwargs = {
        "beta": beta,
        "temperature": 2.0,
        "ignore_index": IGNORE,
        "weight_hard": WEIGHT_HARD,
        "weight_soft": WEIGHT_SOFT,
        "compute_hard": True,
    }
    grad_fp32 = student.clone()
    soft_fp32, hard_fp32 = jsd_chunk_(grad_fp32, teacher_bf16, labels, inv, **kwargs)
    kept = student.clone()
    grad_bf16 = torch.empty_like(student, dtype=torch.bfloat16)
    soft, hard = jsd_chunk_(kept, teacher_bf16, labels, inv, grad_out=grad_bf16, **kwargs)
    assert torch.equal(kept, student)
    assert torch.equal(soft, soft_fp32)
    assert torch.equal(hard, hard_fp32)
    # The bf16 teacher is read as fp32: the result is the float64 answer for those logits.
    ref_grad, ref_soft, ref_hard = reference(
        student, teacher_bf16.float(), labels, beta=beta, temperature=2.0, compute_hard=True
    )
    assert_close_to_float64(grad_fp32, soft, hard, ref_grad, ref_soft, ref_hard)
    # Within one bf16 step of the fp32 gradient: compiled Triton rounds to nearest even like
    # torch, Triton's CPU interpreter truncates.
    torch.testing.assert_close(grad_bf16.float(), grad_fp32, rtol=2.0**-7, atol=0.0)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_matches_torch_chunk(device: torch.device, beta: float, temperature: float) -> None:
    student, teacher, labels, inv = make_inputs(device, vs=150, vt=170)
    kwargs = {
        "beta": beta,
        "temperature": temperature,
        "ignore_index": IGNORE,
        "weight_hard": WEIGHT_HARD,
        "weight_soft": WEIGHT_SOFT,
        "compute_hard": True,
    }
    grad_triton, grad_torch = student.clone(), student.clone()
    losses_triton = jsd_chunk_(grad_triton, teacher, labels, inv, **kwargs)
    losses_torch = _chunk_torch.jsd_chunk_(grad_torch, teacher, labels, inv, **kwargs)
    atol = GRAD_ATOL_SCALE * grad_torch.abs().max().item()
    torch.testing.assert_close(grad_triton, grad_torch, rtol=RTOL, atol=atol)
    torch.testing.assert_close(losses_triton, losses_torch, rtol=RTOL, atol=LOSS_ATOL)


def test_rejects_bad_input(device: torch.device) -> None:
    student, teacher, labels, inv = make_inputs(device)
    kwargs = {
        "beta": 0.5,
        "temperature": 1.0,
        "ignore_index": IGNORE,
        "weight_hard": WEIGHT_HARD,
        "weight_soft": WEIGHT_SOFT,
        "compute_hard": True,
    }
    with pytest.raises(TypeError, match="fp32"):
        jsd_chunk_(student.double(), teacher, labels, inv, **kwargs)
    with pytest.raises(ValueError, match="at least its 200 columns"):
        jsd_chunk_(student, teacher[:, :100].contiguous(), labels, inv, **kwargs)
    with pytest.raises(ValueError, match="labels must be contiguous int64"):
        jsd_chunk_(student, teacher, labels.int(), inv, **kwargs)
    with pytest.raises(ValueError, match="beta"):
        jsd_chunk_(student, teacher, labels, inv, **{**kwargs, "beta": 1.5})


def test_out_of_range_label_poisons_the_hard_loss(device: torch.device) -> None:
    # Checking labels on the host would need a synchronisation; a NaN loss is the signal.
    student, teacher, labels, inv = make_inputs(device)
    labels[0] = student.shape[1]
    _, soft, hard = run_kernel(
        student, teacher, labels, inv, beta=0.5, temperature=1.0, compute_hard=True
    )
    assert hard.isnan()
    assert soft.isfinite()


def test_unavailable_reason_names_the_device() -> None:
    reason = triton_unavailable_reason(torch.device("meta"))
    assert reason is not None
    assert "meta" in reason or "triton" in reason
