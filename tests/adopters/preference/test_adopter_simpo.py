"""prefkit's chunked SimPO against its reference, written the way a kernel library writes its
preference-loss tests (Liger-Kernel's test_simpo_loss.py); as test_adopter_orpo.py, with no
device branches and no tolerances."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from preference_utils import run_heads
from prefkit import AUX_NAMES, fused_linear_simpo, simpo_reference
from test_adopter_orpo import DTYPES, SHAPES

from pytest_gradref import GradReference

# (ignore_index, beta, gamma, label_smoothing, compute_nll_loss, chunk_size): Liger's default
# SimPO, and a second with an ignore_index inside the vocabulary, SimPO's larger beta, label
# smoothing, the NLL term and chunks of two pairs.
SETTINGS = [(-100, 0.1, 0.5, 0.0, False, 1), (7, 2.0, 1.0, 0.1, True, 2)]


@pytest.mark.parametrize(
    ("ignore_index", "beta", "gamma", "label_smoothing", "compute_nll_loss", "chunk_size"),
    SETTINGS,
)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_simpo(
    grad_reference: GradReference,
    gradref_device: torch.device,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    bias: bool,
    ignore_index: int,
    beta: float,
    gamma: float,
    label_smoothing: float,
    compute_nll_loss: bool,
    chunk_size: int,
) -> None:
    kernel = partial(fused_linear_simpo, chunk_size=chunk_size)
    case = (simpo_reference, kernel, shape, dtype, bias, ignore_index)
    ref, loss, grad_x, head, aux = run_heads(
        grad_reference,
        gradref_device,
        *case,
        beta=beta,
        gamma=gamma,
        label_smoothing=label_smoothing,
        compute_nll_loss=compute_nll_loss,
    )
    assert sorted(aux) == sorted(AUX_NAMES)
    ref.assert_close(loss, grad_x, param_grads=head, aux=aux)


# One compiled case per dtype, as in test_adopter_orpo.py (which says why aot_eager).
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_simpo_compiled(
    grad_reference: GradReference, gradref_device: torch.device, dtype: torch.dtype
) -> None:
    kernel = partial(fused_linear_simpo, compiled="aot_eager")
    case = (simpo_reference, kernel, SHAPES[1], dtype, False, 7)
    ref, loss, grad_x, head, aux = run_heads(
        grad_reference, gradref_device, *case, compute_nll_loss=True
    )
    ref.assert_close(loss, grad_x, param_grads=head, aux=aux)


def test_a_one_percent_weight_gradient_error_is_caught(
    grad_reference: GradReference, gradref_device: torch.device
) -> None:
    case = (simpo_reference, fused_linear_simpo, SHAPES[1], torch.float32, False)
    ref, loss, grad_x, head, aux = run_heads(grad_reference, gradref_device, *case)
    assert head.lin.weight.grad is not None
    head.lin.weight.grad *= 1.01
    with pytest.raises(
        AssertionError, match=r"1 of 10 items differ\n- gradient of parameter 'lin.weight'"
    ):
        ref.assert_close(loss, grad_x, param_grads=head, aux=aux)
