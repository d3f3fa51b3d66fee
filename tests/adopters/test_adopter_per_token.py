# torch/_tensor.py leaves Tensor.backward unannotated: calls to it are not flagged as untyped.
# mypy: untyped-calls-exclude=torch._tensor
"""A per-token output of prefkit (the target tokens' log-probabilities of a fused linear head,
the core of GRPO-style losses) against its plain reference, as a tensor output: the plugin
draws the cotangent (``ref.cotangent``) that the kernel's backward takes, and judges the
output and the gradients by the default verdict, with no tolerance or budget argument."""

from __future__ import annotations

import pytest
import torch
from prefkit import draw, fused_linear_token_logps, token_logps_reference
from torch import Tensor

from pytest_gradref import GradReference

DTYPES = [torch.bfloat16, torch.float32]
SHAPES = [(2, 24, 32, 96), (3, 17, 48, 301)]  # batch, tokens, hidden, vocab


def token_inputs(
    device: torch.device, dtype: torch.dtype, batch: int, tokens: int, hidden: int, vocab: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Hidden states, a head with bias (logits of a standard deviation near 2) and targets,
    a fifth of them ignored."""
    gen = torch.Generator().manual_seed(batch * 1000 + vocab)
    x = draw(gen, batch, tokens, hidden, device=device, dtype=dtype)
    weight = draw(gen, vocab, hidden, device=device, dtype=dtype, scale=2 / hidden**0.5)
    bias = draw(gen, vocab, device=device, dtype=dtype, scale=0.5)
    target = torch.randint(0, vocab, (batch, tokens), generator=gen)
    target[torch.rand(target.shape, generator=gen) < 0.2] = -100
    return x, weight, bias, target.to(device)


def run_kernel(
    x: Tensor, weight: Tensor, bias: Tensor, target: Tensor, cotangent: Tensor
) -> tuple[Tensor, tuple[Tensor | None, ...]]:
    """The kernel's output and its gradients for ``cotangent``, on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    x_leaf, weight_leaf, bias_leaf = leaves
    out = fused_linear_token_logps(x_leaf, weight_leaf, bias_leaf, target, chunk_size=16)
    out.backward(cotangent)
    return out, tuple(leaf.grad for leaf in leaves)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_token_logps_and_their_gradients(
    grad_reference: GradReference,
    gradref_device: torch.device,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
) -> None:
    x, weight, bias, target = token_inputs(gradref_device, dtype, *shape)
    ref = grad_reference(token_logps_reference, x, weight, bias, target, argnums=(0, 1, 2))
    assert isinstance(ref.value, Tensor)
    assert ref.value.shape == target.shape
    assert isinstance(ref.cotangent, Tensor)
    out, grads = run_kernel(x, weight, bias, target, ref.cotangent)
    ref.assert_close(out, grads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_token_off_by_one_percent_fails(
    grad_reference: GradReference, gradref_device: torch.device, dtype: torch.dtype
) -> None:
    """The mistake the output item exists for: one token's log-probability 1% off, every other
    token and every gradient exact. In bf16 the reference's own greatest error is about 0.02
    here (its logits are rounded to bf16), so a token's 1% is caught where it is larger than
    about twice that: the token of the largest magnitude (|log p| about 13) is."""
    x, weight, bias, target = token_inputs(gradref_device, dtype, *SHAPES[1])
    ref = grad_reference(token_logps_reference, x, weight, bias, target, argnums=(0, 1, 2))
    assert isinstance(ref.cotangent, Tensor)
    out, grads = run_kernel(x, weight, bias, target, ref.cotangent)
    wrong = out.detach().clone()
    wrong.view(-1)[wrong.abs().argmax()] *= 1.01
    with pytest.raises(AssertionError, match=r"1 of 4 items differ\n- value:\n +greatest error"):
        ref.assert_close(wrong, grads)
