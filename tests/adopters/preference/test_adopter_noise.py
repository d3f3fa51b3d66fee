# torch/_tensor.py leaves Tensor.backward unannotated: calls to it are not flagged as untyped.
# mypy: untyped-calls-exclude=torch._tensor
"""The checks real preference suites make that used to need hand allowances, with none.

Liger-Kernel's GRPO and CPO chunked-loss tests, moved onto the plugin, kept four: the logits
means in bf16 and in float32 (sums of large terms that cancel, summed chunk by chunk), float32
chunked sums at 5-24x the reference's own error, and a float32 KL metric from large
log-probabilities at 4-5.6x. Here prefkit's ORPO (whose aux holds both logits means) and a
GRPO-style policy loss with a KL metric, written beside it as such a library writes one, run
with no tolerance or budget argument, at shapes where the logits means cancel; and the planted
1% bugs of that trial (the per-token loss and the preference scale off by 1%) fail in bf16 as
in float32. The GRPO reference casts with ``.float()``, as Liger's ``test/utils.py`` reference
modules do: its golden is float64 all the same, with no warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from prefkit import ORPO_AUX_NAMES, draw, fused_linear_orpo, orpo_reference
from torch import Tensor

from pytest_gradref import GoldenPrecisionWarning, GradReference

DTYPES = [torch.bfloat16, torch.float32]
# pairs, tokens, hidden, vocab: 64 x 512 logits per side, whose means cancel.
SHAPE = (2, 32, 64, 512)


def orpo_inputs(device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    pairs, tokens, hidden, vocab = SHAPE
    gen = torch.Generator().manual_seed(5)
    x = draw(gen, 2 * pairs, tokens, hidden, device=device, dtype=dtype)
    weight = draw(gen, vocab, hidden, device=device, dtype=dtype, scale=2 / hidden**0.5)
    target = torch.randint(0, vocab, (2 * pairs, tokens), generator=gen)
    target[torch.rand(target.shape, generator=gen) < 0.25] = -100
    return x, weight, target.to(device)


def orpo_kernel(
    x: Tensor, weight: Tensor, target: Tensor, loss_scale: float = 1.0
) -> tuple[Tensor, tuple[Tensor, Tensor], dict[str, Tensor]]:
    """prefkit's chunked ORPO, a pair per chunk; ``loss_scale`` plants a preference-scale
    error (the loss and every gradient off by that factor)."""
    xs, ws = x.detach().requires_grad_(), weight.detach().requires_grad_()
    loss, aux = fused_linear_orpo(xs, ws, target, chunk_size=1)
    loss = loss * loss_scale
    loss.backward()
    assert xs.grad is not None
    assert ws.grad is not None
    return loss, (xs.grad, ws.grad), aux


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_orpo_logits_means_need_no_allowance(
    grad_reference: GradReference, gradref_device: torch.device, dtype: torch.dtype
) -> None:
    x, weight, target = orpo_inputs(gradref_device, dtype)
    ref = grad_reference(orpo_reference, x, weight, target, argnums=(0, 1), has_aux=True)
    loss, grads, aux = orpo_kernel(x, weight, target)
    assert sorted(aux) == sorted(ORPO_AUX_NAMES)
    ref.assert_close(loss, grads, aux=aux)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_one_percent_preference_scale_fails(
    grad_reference: GradReference, gradref_device: torch.device, dtype: torch.dtype
) -> None:
    x, weight, target = orpo_inputs(gradref_device, dtype)
    ref = grad_reference(orpo_reference, x, weight, target, argnums=(0, 1), has_aux=True)
    loss, grads, aux = orpo_kernel(x, weight, target, loss_scale=1.01)
    with pytest.raises(AssertionError) as raised:
        ref.assert_close(loss, grads, aux=aux)
    message = str(raised.value)
    assert "- gradient of argument 1 (weight):" in message
    assert "- value:" in message


# --- a GRPO-style policy loss with a KL metric ------------------------------------------------


def _token_logps(logits: Tensor, target: Tensor) -> Tensor:
    return logits.log_softmax(-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)


def grpo_reference(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    ref_logps: Tensor,
    advantages: Tensor,
    beta: float = 0.04,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain PyTorch GRPO, as Liger's test utilities write it: the logits cast with
    ``.float()``, a per-token loss of the advantage and a KL penalty to a reference policy,
    the KL metric and the logits mean as aux."""
    logits = (x @ weight.T).float()
    logps = _token_logps(logits, target)
    delta = ref_logps - logps
    kl = delta.exp() - delta - 1
    per_token = -(logps - logps.detach()).exp() * advantages[:, None] + beta * kl
    loss = per_token.mean()
    aux = {"kl": kl.detach().mean(), "logits_mean": logits.detach().mean()}
    return loss, aux


def grpo_kernel(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    ref_logps: Tensor,
    advantages: Tensor,
    beta: float = 0.04,
    token_scale: float = 1.0,
    chunk: int = 2,
) -> tuple[Tensor, tuple[Tensor, Tensor], dict[str, Tensor]]:
    """The same loss chunk by chunk of sequences, each chunk's gradient by autograd, sums in
    float32; ``token_scale`` plants a per-token loss error."""
    xs, ws = x.detach().requires_grad_(), weight.detach().requires_grad_()
    count = target.numel()
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    kl_sum = torch.zeros((), dtype=torch.float32, device=x.device)
    logits_sum = torch.zeros((), dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[0], chunk):
        rows = slice(start, start + chunk)
        logits = xs[rows] @ ws.T
        logps = _token_logps(logits.float(), target[rows])
        delta = ref_logps[rows] - logps
        kl = delta.exp() - delta - 1
        per_token = -(logps - logps.detach()).exp() * advantages[rows, None] + beta * kl
        loss = loss + per_token.sum() * token_scale / count
        kl_sum = kl_sum + kl.detach().sum()
        logits_sum = logits_sum + logits.detach().float().sum()
    loss.backward()
    assert xs.grad is not None
    assert ws.grad is not None
    aux = {"kl": kl_sum / count, "logits_mean": (logits_sum / (count * weight.shape[0]))}
    return loss, (xs.grad, ws.grad), aux


def grpo_inputs(
    device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(x, weight, target, ref_logps, advantages), grpo_kernel's tensors."""
    gen = torch.Generator().manual_seed(11)
    sequences, tokens, hidden, vocab = 8, 16, 64, 1024
    x = draw(gen, sequences, tokens, hidden, device=device, dtype=dtype)
    weight = draw(gen, vocab, hidden, device=device, dtype=dtype, scale=3 / hidden**0.5)
    target = torch.randint(0, vocab, (sequences, tokens), generator=gen).to(device)
    # A reference policy a little off the policy: log-probabilities near -8, a KL near 0.
    # Computed in float64 and rounded: in the inputs' dtype the product's bytes would follow
    # the host's matmul (AVX2 and AVX-512 BF16 round it differently), and the inputs would not
    # match the precision baseline's on another host.
    with torch.no_grad():
        logps = _token_logps(x.double() @ weight.double().T, target).float()
    ref_logps = logps + 0.05 * torch.randn(logps.shape, generator=gen).to(device)
    advantages = torch.randn(sequences, generator=gen).to(device)
    return x, weight, target, ref_logps, advantages


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grpo_kl_and_logits_mean_need_no_allowance(
    grad_reference: GradReference, gradref_device: torch.device, dtype: torch.dtype
) -> None:
    args = grpo_inputs(gradref_device, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GoldenPrecisionWarning)  # .float() inside, promoted
        ref = grad_reference(grpo_reference, *args, argnums=(0, 1), has_aux=True)
    assert ref.golden is not None
    assert ref.golden.obtained == torch.float64
    loss, grads, aux = grpo_kernel(*args)
    ref.assert_close(loss, grads, aux=aux)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_one_percent_per_token_loss_error_fails(
    grad_reference: GradReference, gradref_device: torch.device, dtype: torch.dtype
) -> None:
    args = grpo_inputs(gradref_device, dtype)
    ref = grad_reference(grpo_reference, *args, argnums=(0, 1), has_aux=True)
    loss, grads, aux = grpo_kernel(*args, token_scale=1.01)
    with pytest.raises(AssertionError) as raised:
        ref.assert_close(loss, grads, aux=aux)
    message = str(raised.value)
    assert "- gradient of argument 1 (weight):" in message
    assert "- gradient of argument 0 (x):" in message
