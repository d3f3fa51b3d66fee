# torch/_tensor.py leaves Tensor.backward unannotated: calls to it are not flagged as untyped.
# mypy: untyped-calls-exclude=torch._tensor
"""prefkit's chunked DPO loss: the functional, the LM head with a frozen reference model, and
kernel against kernel; loss, gradients and the seven aux outputs, with no device branches and
no tolerances (bf16 cases against a float64 golden, as in test_adopter_distillation)."""

from __future__ import annotations

import pytest
import torch
from prefkit import (
    AUX_NAMES,
    FusedLMHeadDPO,
    TorchLMHeadDPO,
    dpo_reference,
    draw,
    fused_linear_dpo,
)
from test_adopter_distillation import DTYPES
from torch import Tensor

from pytest_gradref import GradReference

SHAPES = [(2, 6, 32, 48), (3, 5, 31, 61)]  # pairs, tokens, hidden, vocab
IGNORE_INDEX = -100

# fused_linear_dpo's positional arguments: input, weight, target, bias, ref_input, ref_weight,
# ref_bias.
PreferenceInputs = tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor, Tensor, Tensor | None]


def preference_inputs(
    device: torch.device,
    dtype: torch.dtype,
    pairs: int,
    tokens: int,
    hidden: int,
    vocab: int,
    bias: bool = True,
) -> PreferenceInputs:
    """(input, weight, target, bias, ref_input, ref_weight, ref_bias): chosen sequences
    first, rejected second, a quarter of the target tokens ignored."""
    gen = torch.Generator().manual_seed(pairs * 100 + vocab)
    scale = 2 / hidden**0.5
    target = torch.randint(0, vocab, (2 * pairs, tokens), generator=gen)
    target[torch.rand(target.shape, generator=gen) < 0.25] = IGNORE_INDEX

    def head() -> tuple[Tensor, Tensor | None]:
        weight = draw(gen, vocab, hidden, device=device, dtype=dtype, scale=scale)
        return weight, draw(gen, vocab, device=device, dtype=dtype) if bias else None

    x = draw(gen, 2 * pairs, tokens, hidden, device=device, dtype=dtype)
    (weight, b), ref_x, (ref_weight, ref_b) = head(), x + 0.1 * x.sign(), head()
    return x, weight, target.to(device), b, ref_x, ref_weight, ref_b


def leaves(*tensors: Tensor) -> list[Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def with_fresh_leaves(args: PreferenceInputs) -> tuple[PreferenceInputs, tuple[Tensor, ...]]:
    """``args`` with fresh leaves for the trained input, weight and bias (where there is one),
    and those leaves."""
    x, weight, target, bias, ref_x, ref_weight, ref_bias = args
    x, weight = leaves(x, weight)
    if bias is None:
        return (x, weight, target, None, ref_x, ref_weight, ref_bias), (x, weight)
    (bias,) = leaves(bias)
    return (x, weight, target, bias, ref_x, ref_weight, ref_bias), (x, weight, bias)


@pytest.mark.parametrize(("bias", "compute_nll_loss"), [(True, False), (False, True)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_linear_dpo(
    grad_reference: GradReference,
    gradref_device: torch.device,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    bias: bool,
    compute_nll_loss: bool,
) -> None:
    args = preference_inputs(gradref_device, dtype, *shape, bias=bias)
    trained = (0, 1, 3) if bias else (0, 1)
    ref = grad_reference(
        dpo_reference, *args, argnums=trained, has_aux=True, compute_nll_loss=compute_nll_loss
    )
    call, trained_leaves = with_fresh_leaves(args)
    loss, aux = fused_linear_dpo(*call, compute_nll_loss=compute_nll_loss)
    loss.backward()
    assert sorted(aux) == sorted(AUX_NAMES)
    ref.assert_close(loss, tuple(leaf.grad for leaf in trained_leaves), aux=aux)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_with_a_frozen_reference_model(
    grad_reference: GradReference, gradref_device: torch.device, dtype: torch.dtype
) -> None:
    x, *_, ref_x, _, _ = preference_inputs(gradref_device, dtype, *SHAPES[1])
    target = preference_inputs(gradref_device, dtype, *SHAPES[1])[2]
    torch_head = TorchLMHeadDPO(SHAPES[1][2], SHAPES[1][3], dtype).to(gradref_device)
    fused_head = FusedLMHeadDPO(SHAPES[1][2], SHAPES[1][3], dtype).to(gradref_device)
    fused_head.load_state_dict(torch_head.state_dict())
    # Only the policy head trains; the reference model's head gets no gradient.
    ref = grad_reference(
        torch_head, x, ref_x, target, has_aux=True, params=["lin.weight", "lin.bias"]
    )
    (x_leaf,) = leaves(x)
    loss, aux = fused_head(x_leaf, ref_x, target)
    loss.backward()
    ref.assert_close(loss, x_leaf.grad, param_grads=fused_head, aux=aux)


def test_the_rewards_are_checked(
    grad_reference: GradReference, gradref_device: torch.device
) -> None:
    args = preference_inputs(gradref_device, torch.float32, *SHAPES[0])
    ref = grad_reference(dpo_reference, *args, argnums=(0, 1, 3), has_aux=True)
    call, trained_leaves = with_fresh_leaves(args)
    loss, aux = fused_linear_dpo(*call)
    loss.backward()
    aux["chosen_rewards"] = aux["chosen_rewards"] * 1.01
    with pytest.raises(AssertionError, match=r"1 of 11 items differ\n- aux\['chosen_rewards'\]"):
        ref.assert_close(loss, tuple(leaf.grad for leaf in trained_leaves), aux=aux)


@pytest.mark.parametrize("dtype", DTYPES)
def test_head_against_functional_kernel(
    grad_reference: GradReference, gradref_device: torch.device, dtype: torch.dtype
) -> None:
    # Kernel against kernel: the functional is the reference. Its autograd.Function has no
    # setup_context, so grad_reference.kernel computes it by autograd on every backend.
    x, w, target, b, ref_x, ref_w, ref_b = preference_inputs(gradref_device, dtype, *SHAPES[0])
    ref = grad_reference.kernel(
        fused_linear_dpo, x, w, target, b, ref_x, ref_w, ref_b, argnums=(0, 1, 3), has_aux=True
    )
    head = FusedLMHeadDPO(SHAPES[0][2], SHAPES[0][3], dtype).to(gradref_device)
    head.load_state_dict(
        {"lin.weight": w, "lin.bias": b, "ref_lin.weight": ref_w, "ref_lin.bias": ref_b}
    )
    (x_leaf,) = leaves(x)
    loss, aux = head(x_leaf, ref_x, target)
    loss.backward()
    ref.assert_close(loss, (x_leaf.grad, head.lin.weight.grad, head.lin.bias.grad), aux=aux)
