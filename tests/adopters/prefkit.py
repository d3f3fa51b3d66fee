"""prefkit: a small chunked-loss library, the plugin's second consumer (the project's own code).

It stands for a third-party library of fused-linear losses (distillation and preference
losses), written the way such libraries are: each loss runs over chunks of rows, takes the
gradient of each chunk's loss with ``torch.func.grad_and_value`` inside its forward, keeps the
gradients for backward, and wraps it all in an ``autograd.Function`` without
``setup_context`` (so ``torch.func`` cannot differentiate the kernels themselves). The plain
PyTorch references sit beside them, as a library's test utilities would.

The kernels compute in at least float32 from bf16 inputs (the matmuls too, as fused kernels
do) and return a float32 loss with gradients in the inputs' dtype. With ``upcast=False`` they
compute in the inputs' dtype throughout instead, as Liger-Kernel's chunked losses do in bf16:
the logits, the softmax and the rest of the loss, and the accumulation of the weight gradient
over chunks. The references compute the logits in the inputs' dtype and the rest in at least
float32, casting with ``promote_types`` rather than ``.float()``, so a float64 golden stays
float64.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    logits = x @ weight.T
    return logits if bias is None else logits + bias


def _logits(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The references' logits: the matmul in the inputs' dtype, the result in at least
    float32."""
    logits = _linear(x, weight, bias)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _kernel_logits(x: Tensor, weight: Tensor, bias: Tensor | None, upcast: bool) -> Tensor:
    """The kernels' logits: in at least float32, the matmul included (``upcast``), or in the
    inputs' dtype."""
    if upcast:
        dtype = torch.promote_types(x.dtype, torch.float32)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    return _linear(x, weight, bias)


# --- the chunk loop --------------------------------------------------------------------------


class _ChunkedLoss(torch.autograd.Function):
    """forward(chunk_loss, chunk_dim, chunk_size, x, weight, bias, chunked, frozen, upcast):
    ``chunk_loss(x_c, weight, bias, *chunked_c, *frozen) -> (loss_c, aux_c)`` per chunk of
    ``x`` and of each tensor in ``chunked`` along ``chunk_dim``; the chunk losses are summed,
    aux tensors with a leading dimension concatenated and scalars summed, in at least float32.
    The weight and bias gradients accumulate in float32 (``upcast``) or in their own dtype."""

    @staticmethod
    def forward(
        ctx: Any,
        chunk_loss: Callable[..., tuple[Tensor, tuple[Tensor, ...]]],
        chunk_dim: int,
        chunk_size: int,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        chunked: tuple[Tensor, ...],
        frozen: tuple[Any, ...],
        upcast: bool,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        argnums = (0, 1) if bias is None else (0, 1, 2)
        step = torch.func.grad_and_value(chunk_loss, argnums=argnums, has_aux=True)
        accumulate = torch.float32 if upcast else weight.dtype
        grad_weight = torch.zeros_like(weight, dtype=accumulate)
        grad_bias = None if bias is None else torch.zeros_like(bias, dtype=accumulate)
        grad_x, losses, auxes = [], [], []
        for start in range(0, x.shape[chunk_dim], chunk_size):
            pieces = [
                t.narrow(chunk_dim, start, min(chunk_size, t.shape[chunk_dim] - start))
                for t in (x, *chunked)
            ]
            grads, (loss, aux) = step(pieces[0], weight, bias, *pieces[1:], *frozen)
            grad_x.append(grads[0])
            grad_weight += grads[1]
            if grad_bias is not None:
                grad_bias += grads[2]
            losses.append(loss)
            auxes.append(aux)
        ctx.save_for_backward(
            torch.cat(grad_x, dim=chunk_dim),
            grad_weight.to(weight.dtype),
            None if grad_bias is None or bias is None else grad_bias.to(bias.dtype),
        )
        aux = tuple(torch.cat(parts) if parts[0].dim() else _total(parts) for parts in zip(*auxes))
        return _total(losses), aux

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, *_: Any) -> tuple[Any, ...]:
        grad_x, grad_weight, grad_bias = ctx.saved_tensors
        scaled = [
            None if g is None else g * grad_loss.to(g.dtype)
            for g in (grad_x, grad_weight, grad_bias)
        ]
        return (None, None, None, *scaled, None, None, None)


def _total(parts: tuple[Tensor, ...] | list[Tensor]) -> Tensor:
    """The sum of the chunks' scalars in at least float32 (as Liger's accumulators are)."""
    stacked = torch.stack(parts)
    return stacked.to(torch.promote_types(stacked.dtype, torch.float32)).sum()


def _run(
    chunk_loss: Callable[..., Any],
    chunk_dim: int,
    chunk_size: int,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    chunked: tuple[Tensor, ...],
    frozen: tuple[Any, ...],
    upcast: bool,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    result: tuple[Tensor, tuple[Tensor, ...]] = _ChunkedLoss.apply(  # type: ignore[no-untyped-call]
        chunk_loss, chunk_dim, chunk_size, x, weight, bias, chunked, frozen, upcast
    )
    return result


# --- distillation: JSD and cosine ------------------------------------------------------------


def _jsd_terms(student: Tensor, teacher: Tensor, beta: float) -> Tensor:
    """Generalized JSD per row, summed over the vocabulary, 0 < beta < 1."""
    log_s, log_t = student.log_softmax(-1), teacher.log_softmax(-1)
    log_m = torch.logsumexp(torch.stack([log_t + math.log(beta), log_s + math.log(1 - beta)]), 0)
    kl_t = (log_t.exp() * (log_t - log_m)).sum(-1)
    kl_s = (log_s.exp() * (log_s - log_m)).sum(-1)
    return beta * kl_t + (1 - beta) * kl_s


def jsd_reference(
    student_input: Tensor,
    student_weight: Tensor,
    teacher_input: Tensor,
    teacher_weight: Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> Tensor:
    """Plain PyTorch: the mean generalized JSD of the temperature-scaled logits."""
    student = _logits(student_input, student_weight, None) / temperature
    teacher = _logits(teacher_input, teacher_weight, None) / temperature
    return _jsd_terms(student, teacher, beta).mean()


def fused_linear_jsd(
    student_input: Tensor,
    student_weight: Tensor,
    teacher_input: Tensor,
    teacher_weight: Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int = 16,
    upcast: bool = True,
) -> Tensor:
    rows = student_input.shape[0]

    def chunk(x: Tensor, w: Tensor, b: Tensor | None, tx: Tensor, tw: Tensor) -> Any:
        with torch.no_grad():
            teacher = _kernel_logits(tx, tw, None, upcast) / temperature
        terms = _jsd_terms(_kernel_logits(x, w, b, upcast) / temperature, teacher, beta)
        return terms.sum() / rows, ()

    loss, _ = _run(
        chunk,
        0,
        chunk_size,
        student_input,
        student_weight,
        None,
        (teacher_input,),
        (teacher_weight,),
        upcast,
    )
    return loss


def _cosine_terms(
    student: Tensor,
    teacher: Tensor,
    labels: Tensor,
    ignore_index: int,
    weight_hard: float,
    weight_soft: float,
) -> Tensor:
    """Per row: weighted cross-entropy plus weighted (1 - cosine similarity), 0 where the
    label is ignored."""
    hard = F.cross_entropy(student, labels, ignore_index=ignore_index, reduction="none")
    soft = 1 - F.cosine_similarity(student, teacher, dim=-1)
    return torch.where(labels == ignore_index, 0.0, weight_hard * hard + weight_soft * soft)


def draw(
    generator: torch.Generator,
    *shape: int,
    device: torch.device,
    dtype: torch.dtype,
    scale: float = 1.0,
) -> Tensor:
    """Normal numbers drawn on the CPU, so every device sees the same ones."""
    return (torch.randn(shape, generator=generator) * scale).to(device=device, dtype=dtype)


def cosine_reference(
    student_input: Tensor,
    student_weight: Tensor,
    teacher_input: Tensor,
    teacher_weight: Tensor,
    true_labels: Tensor,
    student_bias: Tensor | None = None,
    ignore_index: int = -100,
    weight_hard_loss: float = 0.5,
    weight_soft_loss: float = 0.5,
) -> Tensor:
    student = _logits(student_input, student_weight, student_bias)
    teacher = _logits(teacher_input, teacher_weight, None)
    terms = _cosine_terms(
        student, teacher, true_labels, ignore_index, weight_hard_loss, weight_soft_loss
    )
    return terms.sum() / (true_labels != ignore_index).sum().clamp(min=1)


def fused_linear_cosine(
    student_input: Tensor,
    student_weight: Tensor,
    teacher_input: Tensor,
    teacher_weight: Tensor,
    true_labels: Tensor,
    student_bias: Tensor | None = None,
    ignore_index: int = -100,
    weight_hard_loss: float = 0.5,
    weight_soft_loss: float = 0.5,
    chunk_size: int = 16,
    upcast: bool = True,
) -> Tensor:
    valid = (true_labels != ignore_index).sum().clamp(min=1)

    def chunk(
        x: Tensor, w: Tensor, b: Tensor | None, tx: Tensor, labels: Tensor, tw: Tensor
    ) -> Any:
        with torch.no_grad():
            teacher = _kernel_logits(tx, tw, None, upcast)
        terms = _cosine_terms(
            _kernel_logits(x, w, b, upcast),
            teacher,
            labels,
            ignore_index,
            weight_hard_loss,
            weight_soft_loss,
        )
        return terms.sum() / valid, ()

    loss, _ = _run(
        chunk,
        0,
        chunk_size,
        student_input,
        student_weight,
        student_bias,
        (teacher_input, true_labels),
        (teacher_weight,),
        upcast,
    )
    return loss


# --- per-token log-probabilities ------------------------------------------------------------


def token_logps_reference(
    x: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, ignore_index: int = -100
) -> Tensor:
    """Plain PyTorch: each token's log-probability of its target, 0 where the target is
    ignored; the shape of ``target``, in at least float32."""
    mask = target != ignore_index
    logps = _logits(x, weight, bias).log_softmax(-1)
    picked = logps.gather(-1, torch.where(mask, target, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(mask, picked, 0.0)


class _ChunkedTokenLogps(torch.autograd.Function):
    """forward(x, weight, bias, target, ignore_index, chunk_size): the per-token output of a
    fused linear head, in float32 chunks of rows, with no logits kept: backward computes each
    chunk's logits again and takes their gradient in closed form from the cotangent ``g``
    (``g * (onehot(target) - softmax(z))`` on valid tokens), then ``grad_x = dz @ weight`` and
    ``grad_weight += dz.T @ x`` accumulated in float32, as GRPO-style kernels do."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        target: Tensor,
        ignore_index: int,
        chunk_size: int,
    ) -> Tensor:
        rows, tokens = x.reshape(-1, x.shape[-1]), target.reshape(-1)
        out = torch.empty(tokens.shape, dtype=torch.float32, device=x.device)
        logsumexp = torch.empty_like(out)
        for start in range(0, rows.shape[0], chunk_size):
            stop = min(start + chunk_size, rows.shape[0])
            z = _kernel_logits(rows[start:stop], weight, bias, upcast=True)
            labels = tokens[start:stop]
            mask = labels != ignore_index
            logsumexp[start:stop] = torch.logsumexp(z, -1)
            picked = z.gather(-1, torch.where(mask, labels, 0).unsqueeze(-1)).squeeze(-1)
            out[start:stop] = torch.where(mask, picked - logsumexp[start:stop], 0.0)
        ctx.save_for_backward(x, weight, bias, target, logsumexp)
        ctx.ignore_index, ctx.chunk_size = ignore_index, chunk_size
        return out.view(target.shape)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
        x, weight, bias, target, logsumexp = ctx.saved_tensors
        rows, tokens = x.reshape(-1, x.shape[-1]), target.reshape(-1)
        cotangent = grad_out.reshape(-1).float()
        grad_x = torch.empty_like(rows)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        grad_bias = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
        for start in range(0, rows.shape[0], ctx.chunk_size):
            stop = min(start + ctx.chunk_size, rows.shape[0])
            chunk = rows[start:stop].float()
            z = _kernel_logits(chunk, weight, bias, upcast=True)
            labels = tokens[start:stop]
            mask = labels != ctx.ignore_index
            g = torch.where(mask, cotangent[start:stop], 0.0)
            dz = (z - logsumexp[start:stop, None]).exp_().mul_(-g[:, None])
            dz.scatter_add_(-1, torch.where(mask, labels, 0)[:, None], g[:, None])
            grad_x[start:stop] = dz @ weight.float()
            grad_weight += dz.T @ chunk
            if grad_bias is not None:
                grad_bias += dz.sum(0)
        return (
            grad_x.view(x.shape),
            grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
        )


def fused_linear_token_logps(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int = -100,
    chunk_size: int = 16,
) -> Tensor:
    """Each token's log-probability of its target (0 where ignored), a float32 tensor of
    ``target``'s shape, from chunks of rows of ``x @ weight.T + bias`` in float32."""
    result: Tensor = _ChunkedTokenLogps.apply(  # type: ignore[no-untyped-call]
        x, weight, bias, target, ignore_index, chunk_size
    )
    return result


# --- preference: DPO -------------------------------------------------------------------------

AUX_NAMES = (
    "chosen_logps",
    "rejected_logps",
    "chosen_logits_mean",
    "rejected_logits_mean",
    "nll_loss",
    "chosen_rewards",
    "rejected_rewards",
)


def _sequence_logps(logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """Per sequence, the summed log-probability of the target tokens, ignored ones left out."""
    mask = target != ignore_index
    picked = logits.log_softmax(-1).gather(-1, torch.where(mask, target, 0).unsqueeze(-1))
    return (picked.squeeze(-1) * mask).sum(-1)


def _dpo_pairs(
    logits: Tensor,
    ref_logits: Tensor,
    target: Tensor,
    beta: float,
    ignore_index: int,
    pairs: int,
    tokens: int,
    compute_nll_loss: bool,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``logits`` and ``target`` hold chosen sequences first, rejected second (dim 0 of 2).
    Returns the sum over these pairs of the loss terms (each divided by ``pairs``) and the aux
    of these pairs (sums, for the means over all pairs, divided likewise)."""
    logps = _sequence_logps(logits, target, ignore_index)
    with torch.no_grad():
        ref_logps = _sequence_logps(ref_logits, target, ignore_index)
    chosen_rewards = beta * (logps[0] - ref_logps[0])
    rejected_rewards = beta * (logps[1] - ref_logps[1])
    loss = -F.logsigmoid(chosen_rewards - rejected_rewards).sum() / pairs
    nll = -logps[0].sum() / tokens
    if compute_nll_loss:
        loss = loss + nll
    vocab = logits.shape[-1]
    aux = {
        "chosen_logps": logps[0].detach(),
        "rejected_logps": logps[1].detach(),
        "chosen_logits_mean": logits[0].detach().sum() / (pairs * logits.shape[2] * vocab),
        "rejected_logits_mean": logits[1].detach().sum() / (pairs * logits.shape[2] * vocab),
        "nll_loss": nll.detach(),
        "chosen_rewards": chosen_rewards.detach(),
        "rejected_rewards": rejected_rewards.detach(),
    }
    return loss, aux


def dpo_reference(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ref_input: Tensor | None = None,
    ref_weight: Tensor | None = None,
    ref_bias: Tensor | None = None,
    beta: float = 0.1,
    ignore_index: int = -100,
    compute_nll_loss: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain PyTorch DPO over (2B, T, H) hidden states, chosen first: (loss, aux)."""
    pairs = input.shape[0] // 2
    shape = (2, pairs, *input.shape[1:])
    target2 = target.view(2, pairs, -1)
    tokens = int((target2[0] != ignore_index).sum().clamp(min=1))
    logits = _logits(input.view(shape), weight, bias)
    ref_logits = _logits(_or(ref_input, input).view(shape), _or(ref_weight, weight), ref_bias)
    return _dpo_pairs(
        logits, ref_logits, target2, beta, ignore_index, pairs, tokens, compute_nll_loss
    )


def fused_linear_dpo(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ref_input: Tensor | None = None,
    ref_weight: Tensor | None = None,
    ref_bias: Tensor | None = None,
    beta: float = 0.1,
    ignore_index: int = -100,
    compute_nll_loss: bool = False,
    chunk_size: int = 1,
    upcast: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The chunked kernel: chunks of ``chunk_size`` chosen/rejected pairs."""
    pairs = input.shape[0] // 2
    shape = (2, pairs, *input.shape[1:])
    target2 = target.view(2, pairs, -1)
    tokens = int((target2[0] != ignore_index).sum().clamp(min=1))
    ref_x = _or(ref_input, input).detach().view(shape)

    def chunk(
        x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, rx: Tensor, rw: Tensor, rb: Tensor | None
    ) -> Any:
        with torch.no_grad():
            ref_logits = _kernel_logits(rx, rw, rb, upcast)
        loss, aux = _dpo_pairs(
            _kernel_logits(x, w, b, upcast),
            ref_logits,
            t,
            beta,
            ignore_index,
            pairs,
            tokens,
            compute_nll_loss,
        )
        return loss, tuple(aux[name] for name in AUX_NAMES)

    rw = _or(ref_weight, weight).detach()
    rb = None if ref_bias is None else ref_bias.detach()
    loss, aux = _run(
        chunk, 1, chunk_size, input.view(shape), weight, bias, (target2, ref_x), (rw, rb), upcast
    )
    return loss, dict(zip(AUX_NAMES, aux))


def _or(value: Tensor | None, default: Tensor) -> Tensor:
    return default if value is None else value


class _LMHeadDPO(torch.nn.Module):
    """A policy head ``lin`` and a frozen reference model's head ``ref_lin``."""

    def __init__(
        self,
        hidden: int,
        vocab: int,
        dtype: torch.dtype,
        bias: bool = True,
        beta: float = 0.1,
        ignore_index: int = -100,
    ) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(hidden, vocab, bias=bias, dtype=dtype)
        self.ref_lin = torch.nn.Linear(hidden, vocab, bias=bias, dtype=dtype)
        self.beta, self.ignore_index = beta, ignore_index


class TorchLMHeadDPO(_LMHeadDPO):
    """The reference head: plain PyTorch. Its ``ref_lin`` requires grad, as an ``nn.Linear``
    does by default; nothing reaches it, since the reference model's log-probabilities are
    taken without gradient."""

    def forward(self, x: Tensor, ref_x: Tensor, target: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return dpo_reference(
            x,
            self.lin.weight,
            target,
            self.lin.bias,
            ref_x,
            self.ref_lin.weight,
            self.ref_lin.bias,
            self.beta,
            self.ignore_index,
        )


class FusedLMHeadDPO(_LMHeadDPO):
    """The kernel head: the chunked DPO."""

    def forward(self, x: Tensor, ref_x: Tensor, target: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return fused_linear_dpo(
            x,
            self.lin.weight,
            target,
            self.lin.bias,
            ref_x,
            self.ref_lin.weight,
            self.ref_lin.bias,
            self.beta,
            self.ignore_index,
        )


# --- preference without a reference model: ORPO and SimPO -----------------------------------
#
# Both judge a pair by the average log-probability of its sequences, as TRL and Liger do. The
# references are written the way TRL's trainers are (the whole batch, log_softmax and gather,
# cross_entropy's mean for the NLL); the kernels per chunk of pairs, from per-token
# cross-entropy, every sum divided by the whole batch's counts, so the two share no loss code.

ORPO_AUX_NAMES = (*AUX_NAMES, "log_odds_ratio", "log_odds_chosen")


def _average_logps(logits: Tensor, target: Tensor, ignore_index: int) -> Tensor:
    """TRL's ``get_batch_logps(average_log_prob=True)``: per sequence, the mean log-probability
    of its target tokens (a sequence with none counts as having one, so it gives 0, not NaN)."""
    mask = target != ignore_index
    picked = logits.log_softmax(-1).gather(-1, torch.where(mask, target, 0).unsqueeze(-1))
    return (picked.squeeze(-1) * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def _reference_terms(
    input: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int
) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor]]:
    """(chosen log-probabilities, rejected ones, the chosen NLL, the aux both losses report)
    over (2B, T, H) hidden states, chosen first."""
    pairs = input.shape[0] // 2
    logits = _logits(input, weight, bias)
    logps = _average_logps(logits, target, ignore_index)
    chosen, rejected = logps[:pairs], logps[pairs:]
    nll = F.cross_entropy(
        logits[:pairs].flatten(0, 1), target[:pairs].flatten(), ignore_index=ignore_index
    )
    aux = {
        "chosen_logps": chosen.detach(),
        "rejected_logps": rejected.detach(),
        "chosen_logits_mean": logits[:pairs].detach().mean(),
        "rejected_logits_mean": logits[pairs:].detach().mean(),
        "nll_loss": nll.detach(),
    }
    return chosen, rejected, nll, aux


def _log_odds(chosen: Tensor, rejected: Tensor) -> Tensor:
    """log(odds(chosen) / odds(rejected)), odds(p) = p / (1 - p), from log-probabilities."""
    return (chosen - rejected) - (torch.log1p(-chosen.exp()) - torch.log1p(-rejected.exp()))


def _simpo_terms(
    chosen: Tensor, rejected: Tensor, beta: float, gamma: float, label_smoothing: float
) -> Tensor:
    margin = beta * (chosen - rejected) - gamma
    return -F.logsigmoid(margin) * (1 - label_smoothing) - F.logsigmoid(-margin) * label_smoothing


def orpo_reference(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    beta: float = 0.1,
    ignore_index: int = -100,
    compute_nll_loss: bool = True,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain PyTorch ORPO (TRL's odds-ratio loss plus the chosen NLL): (loss, aux)."""
    chosen, rejected, nll, aux = _reference_terms(input, weight, target, bias, ignore_index)
    log_odds = _log_odds(chosen, rejected)
    ratio = F.logsigmoid(log_odds)
    loss = -beta * ratio.mean()
    if compute_nll_loss:
        loss = loss + nll
    aux |= {
        "chosen_rewards": beta * chosen.detach(),
        "rejected_rewards": beta * rejected.detach(),
        "log_odds_ratio": ratio.detach().mean(),
        "log_odds_chosen": log_odds.detach().mean(),
    }
    return loss, aux


def simpo_reference(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    beta: float = 0.1,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    alpha: float = 1.0,
    ignore_index: int = -100,
    compute_nll_loss: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain PyTorch SimPO (length-normalised rewards, margin ``gamma``, optional label
    smoothing; ``alpha`` times the chosen NLL where asked): (loss, aux)."""
    chosen, rejected, nll, aux = _reference_terms(input, weight, target, bias, ignore_index)
    loss = _simpo_terms(chosen, rejected, beta, gamma, label_smoothing).mean()
    if compute_nll_loss:
        loss = loss + alpha * nll
    aux |= {"chosen_rewards": beta * chosen.detach(), "rejected_rewards": beta * rejected.detach()}
    return loss, aux


def _fused_linear_preference(
    pair_loss: Callable[[Tensor, Tensor], tuple[Tensor, tuple[Tensor, ...]]],
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    beta: float,
    ignore_index: int,
    nll_weight: float,
    chunk_size: int,
    upcast: bool,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """The chunk loop shared by ORPO and SimPO: chunks of ``chunk_size`` pairs.
    ``pair_loss(chosen, rejected)`` gives the pairs' summed loss terms and their extra aux
    (sums); the loss adds ``nll_weight`` times the chosen NLL. The counts stay tensors: no
    host read, so the loop compiles to one graph."""
    pairs = input.shape[0] // 2
    target2 = target.view(2, pairs, -1)
    tokens = (target2[0] != ignore_index).sum().clamp(min=1)
    elements = pairs * target.shape[1] * weight.shape[0]

    def chunk(x: Tensor, w: Tensor, b: Tensor | None, t: Tensor, tokens: Tensor) -> Any:
        logits = _kernel_logits(x, w, b, upcast)
        mask = t != ignore_index
        token_logps = -F.cross_entropy(
            logits.flatten(0, -2), t.flatten(), ignore_index=ignore_index, reduction="none"
        ).view(t.shape)
        logps = token_logps.sum(-1) / mask.sum(-1).clamp(min=1)
        terms, extra = pair_loss(logps[0], logps[1])
        nll = -token_logps[0].sum() / tokens
        loss = terms / pairs + nll_weight * nll
        detached = logps.detach()
        aux = (
            detached[0],
            detached[1],
            logits[0].detach().sum() / elements,
            logits[1].detach().sum() / elements,
            nll.detach(),
            beta * detached[0],
            beta * detached[1],
            *(e.detach() / pairs for e in extra),
        )
        return loss, aux

    shape = (2, pairs, *input.shape[1:])
    return _run(
        chunk, 1, chunk_size, input.view(shape), weight, bias, (target2,), (tokens,), upcast
    )


def fused_linear_orpo(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    beta: float = 0.1,
    ignore_index: int = -100,
    compute_nll_loss: bool = True,
    chunk_size: int = 1,
    upcast: bool = True,
    compiled: bool | str = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The chunked ORPO kernel. ``compiled`` runs it under ``torch.compile``: True with its
    default backend (Inductor), or a backend's name."""
    if compiled:
        backend = "inductor" if compiled is True else compiled  # torch.compile's default
        return _compiled(fused_linear_orpo, backend)(
            input, weight, target, bias, beta, ignore_index, compute_nll_loss, chunk_size, upcast
        )

    def pair_loss(chosen: Tensor, rejected: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        log_odds = _log_odds(chosen, rejected)
        ratio = F.logsigmoid(log_odds)
        return -beta * ratio.sum(), (ratio.sum(), log_odds.sum())

    nll_weight = 1.0 if compute_nll_loss else 0.0
    loss, aux = _fused_linear_preference(
        pair_loss, input, weight, target, bias, beta, ignore_index, nll_weight, chunk_size, upcast
    )
    return loss, dict(zip(ORPO_AUX_NAMES, aux))


def fused_linear_simpo(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    beta: float = 0.1,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
    alpha: float = 1.0,
    ignore_index: int = -100,
    compute_nll_loss: bool = False,
    chunk_size: int = 1,
    upcast: bool = True,
    compiled: bool | str = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The chunked SimPO kernel; ``compiled`` as for ``fused_linear_orpo``."""
    if compiled:
        backend = "inductor" if compiled is True else compiled  # torch.compile's default
        return _compiled(fused_linear_simpo, backend)(
            input,
            weight,
            target,
            bias,
            beta,
            gamma,
            label_smoothing,
            alpha,
            ignore_index,
            compute_nll_loss,
            chunk_size,
            upcast,
        )

    def pair_loss(chosen: Tensor, rejected: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        return _simpo_terms(chosen, rejected, beta, gamma, label_smoothing).sum(), ()

    nll_weight = alpha if compute_nll_loss else 0.0
    loss, aux = _fused_linear_preference(
        pair_loss, input, weight, target, bias, beta, ignore_index, nll_weight, chunk_size, upcast
    )
    return loss, dict(zip(AUX_NAMES, aux))


PreferenceKernel = Callable[..., tuple[Tensor, dict[str, Tensor]]]


@functools.cache
def _compiled(fn: PreferenceKernel, backend: str) -> PreferenceKernel:
    """One compiled wrapper per kernel and backend, so its graphs are reused across calls.
    The whole kernel is traced: the autograd.Function with the chunk loop and grad_and_value
    inside it (``grad_and_value`` of a compiled chunk would run eagerly: Dynamo does not trace
    a compiled frame that an eager functorch transform calls)."""
    return torch.compile(fn, backend=backend)
