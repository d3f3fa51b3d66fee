# torch/_tensor.py leaves Tensor.backward unannotated: calls to it are not flagged as untyped.
# mypy: untyped-calls-exclude=torch._tensor
"""prefkit's kernels computing in bf16 throughout (``upcast=False``: logits, softmax and the
weight gradient's accumulation in bf16, as Liger-Kernel's chunked losses do) against the same
float32-internal references, with no device branches and no tolerances.

Such a kernel is about as accurate as the reference's own computation carried out in bf16,
and far less accurate than the reference, which takes its softmax in float32: the budget counts
from the reference rounded to bf16 after every operation (``rounded=True``).
"""

from __future__ import annotations

import pytest
import torch
from prefkit import (
    AUX_NAMES,
    cosine_reference,
    dpo_reference,
    draw,
    fused_linear_cosine,
    fused_linear_dpo,
    fused_linear_jsd,
    jsd_reference,
)
from test_adopter_distillation import SHAPES as DISTILLATION_SHAPES
from test_adopter_distillation import distillation_inputs, run_kernel
from test_adopter_dpo import SHAPES as PREFERENCE_SHAPES
from test_adopter_dpo import PreferenceInputs, leaves, preference_inputs, with_fresh_leaves
from torch import Tensor

from pytest_gradref import GradReference, Reference

# The kernels return their aux in bf16 on purpose, as Liger's do (check_dtype=False): those
# items are judged at the float32 reference's precision, their own rounding aside.
ROUNDED = pytest.mark.gradref(golden=torch.float64, budget=2, rounded=True, check_dtype=False)


@ROUNDED
@pytest.mark.parametrize(("beta", "temperature"), [(0.5, 1.0), (0.1, 2.0)])
@pytest.mark.parametrize("shape", DISTILLATION_SHAPES, ids=str)
def test_fused_linear_jsd_in_bf16(
    grad_reference: GradReference,
    gradref_device: torch.device,
    shape: tuple[int, int, int, int],
    beta: float,
    temperature: float,
) -> None:
    args = distillation_inputs(gradref_device, torch.bfloat16, *shape)
    ref = grad_reference(jsd_reference, *args, argnums=(0, 1), beta=beta, temperature=temperature)
    loss, grads = run_kernel(
        fused_linear_jsd, *args, beta=beta, temperature=temperature, upcast=False
    )
    ref.assert_close(loss, grads)


@pytest.mark.gradref(golden=torch.float64, budget=2)
def test_the_bf16_jsd_fails_a_budget_against_the_reference_alone(
    grad_reference: GradReference, gradref_device: torch.device
) -> None:
    # What rounded=True is for: the float32 softmax makes the reference far more accurate.
    args = distillation_inputs(gradref_device, torch.bfloat16, *DISTILLATION_SHAPES[1])
    ref = grad_reference(jsd_reference, *args, argnums=(0, 1), beta=0.1, temperature=2.0)
    loss, grads = run_kernel(fused_linear_jsd, *args, beta=0.1, temperature=2.0, upcast=False)
    with pytest.raises(AssertionError, match="3 of 3 items differ"):
        ref.assert_close(loss, grads)


@ROUNDED
@pytest.mark.parametrize(("weight_hard_loss", "weight_soft_loss"), [(0.5, 0.5), (0.0, 1.0)])
@pytest.mark.parametrize("shape", DISTILLATION_SHAPES, ids=str)
def test_fused_linear_cosine_in_bf16(
    grad_reference: GradReference,
    gradref_device: torch.device,
    shape: tuple[int, int, int, int],
    weight_hard_loss: float,
    weight_soft_loss: float,
) -> None:
    x, w, tx, tw = distillation_inputs(gradref_device, torch.bfloat16, *shape)
    gen = torch.Generator().manual_seed(1)
    labels = torch.randint(0, shape[3], (x.shape[0],), generator=gen)
    labels[::3] = -100
    bias = draw(gen, shape[3], device=gradref_device, dtype=torch.bfloat16)
    args = (x, w, tx, tw, labels.to(gradref_device), bias)
    ref = grad_reference(
        cosine_reference,
        *args,
        argnums=(0, 1, 5),
        weight_hard_loss=weight_hard_loss,
        weight_soft_loss=weight_soft_loss,
    )
    trained = leaves(x, w, bias)
    loss = fused_linear_cosine(
        trained[0],
        trained[1],
        tx,
        tw,
        args[4],
        trained[2],
        weight_hard_loss=weight_hard_loss,
        weight_soft_loss=weight_soft_loss,
        upcast=False,
    )
    loss.backward()
    ref.assert_close(loss, tuple(leaf.grad for leaf in trained))


def dpo_in_bf16(
    grad_reference: GradReference,
    args: PreferenceInputs,
    bias: bool,
    compute_nll_loss: bool,
    chunk_size: int,
) -> tuple[Reference, Tensor, tuple[Tensor | None, ...], dict[str, Tensor]]:
    """The reference, and the bf16 kernel's loss, gradients and aux."""
    trained = (0, 1, 3) if bias else (0, 1)
    ref = grad_reference(
        dpo_reference, *args, argnums=trained, has_aux=True, compute_nll_loss=compute_nll_loss
    )
    call, trained_leaves = with_fresh_leaves(args)
    loss, aux = fused_linear_dpo(
        *call, compute_nll_loss=compute_nll_loss, chunk_size=chunk_size, upcast=False
    )
    loss.backward()
    assert sorted(aux) == sorted(AUX_NAMES)
    return ref, loss, tuple(leaf.grad for leaf in trained_leaves), aux


@ROUNDED
@pytest.mark.parametrize(("bias", "compute_nll_loss"), [(True, False), (False, True)])
@pytest.mark.parametrize("shape", PREFERENCE_SHAPES, ids=str)
def test_fused_linear_dpo_in_bf16(
    grad_reference: GradReference,
    gradref_device: torch.device,
    shape: tuple[int, int, int, int],
    bias: bool,
    compute_nll_loss: bool,
) -> None:
    # All pairs in one chunk: see the next test for several.
    args = preference_inputs(gradref_device, torch.bfloat16, *shape, bias=bias)
    ref, loss, grads, aux = dpo_in_bf16(grad_reference, args, bias, compute_nll_loss, shape[0])
    ref.assert_close(loss, grads, aux=aux)


@ROUNDED
def test_per_chunk_means_in_bf16_stay_within_the_rounding_spread(
    grad_reference: GradReference, gradref_device: torch.device
) -> None:
    # A pair per chunk, as Liger's default: each chunk's mean of the logits is rounded to bf16
    # before the means are summed, and here they (0.070, -0.037, -0.005) are larger than their
    # sum (0.029), so a step of theirs is four of the result's. That error (4.7e-4) is of the
    # size of what the bf16 rounding of the logits themselves gives the mean: 16 randomly
    # rounded runs of the reference err by 1.1e-4 rms, and its own error (2.3e-6) was a lucky
    # draw, which the budget alone doubled into a false alarm. The verdict passes it.
    args = preference_inputs(gradref_device, torch.bfloat16, *PREFERENCE_SHAPES[1], bias=False)
    ref, loss, grads, aux = dpo_in_bf16(grad_reference, args, False, True, 1)
    ref.assert_close(loss, grads, aux=aux)
    assert ref.recording is not None
    checks = {check.label: check for check in ref.recording.checks}
    assert checks["aux['rejected_logits_mean']"].spread_runs == 16


@ROUNDED
def test_bf16_dpo_against_the_float32_kernel(
    grad_reference: GradReference, gradref_device: torch.device
) -> None:
    # Kernel against kernel: the float32-internal kernel as the reference, rounded to bf16
    # after every operation of its forward, its chunks' grad_and_value and its backward.
    args = preference_inputs(gradref_device, torch.bfloat16, *PREFERENCE_SHAPES[0])
    ref = grad_reference.kernel(fused_linear_dpo, *args, argnums=(0, 1, 3), has_aux=True)
    call, trained_leaves = with_fresh_leaves(args)
    loss, aux = fused_linear_dpo(*call, upcast=False)
    loss.backward()
    ref.assert_close(loss, tuple(leaf.grad for leaf in trained_leaves), aux=aux)
