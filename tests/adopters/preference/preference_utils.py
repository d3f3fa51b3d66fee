"""The preference consumer's test utilities, kept as a kernel library keeps them (Liger-Kernel's
test/utils.py): the device, found when this module is imported; the seeding its conftest
applies to every test; the LM heads and the batches its tests build."""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:  # the conftest imports this module: it loads no more of the plugin than before
    from pytest_gradref import GradReference, Reference


def infer_device() -> str:
    """npu where torch_npu imports and sees a device, then cuda, then cpu."""
    try:
        # By name, as the plugin's probe does: torch_npu ships no type information, and
        # torch.npu exists only once torch_npu has registered it.
        importlib.import_module("torch_npu")
        npu = getattr(torch, "npu", None)
        if npu is not None and npu.is_available():
            return "npu"
    except Exception:  # not installed, or installed without the Ascend toolkit: no npu
        pass
    return "cuda" if torch.cuda.is_available() else "cpu"


# Probed as the conftest imports this module, before any test: under --gradref-simulate=npu
# the plugin has put the simulated npu in place by then, so the probe sees it.
DEVICE = infer_device()


def set_seed(seed: int = 42) -> None:
    """Every generator the suite draws from: Python's, torch's, the device's."""
    random.seed(seed)
    torch.manual_seed(seed)
    if DEVICE != "cpu":
        getattr(torch, DEVICE).manual_seed_all(seed)  # torch.cuda, torch.npu


class LMHead(nn.Module):
    """An lm_head ``lin`` with a preference loss on its logits: ``loss(x, lin.weight, target,
    lin.bias, **loss_kwargs) -> (loss, aux)``, a reference or a kernel."""

    def __init__(
        self,
        loss: Callable[..., tuple[Tensor, dict[str, Tensor]]],
        hidden: int,
        vocab: int,
        dtype: torch.dtype,
        bias: bool,
        **loss_kwargs: Any,
    ) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, vocab, bias=bias, dtype=dtype)
        self.loss, self.loss_kwargs = loss, loss_kwargs

    def forward(self, x: Tensor, target: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return self.loss(x, self.lin.weight, target, self.lin.bias, **self.loss_kwargs)


def heads(
    reference: Callable[..., Any],
    kernel: Callable[..., Any],
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    bias: bool,
    device: torch.device,
    **loss_kwargs: Any,
) -> tuple[LMHead, LMHead]:
    """The reference's head and the kernel's, built on the CPU as ``nn.Linear`` builds them and
    filled through ``.data`` with the same device tensors, as the library's tests fill theirs
    (logits of a standard deviation near 2)."""
    _, _, hidden, vocab = shape
    ref_head = LMHead(reference, hidden, vocab, dtype, bias, **loss_kwargs)
    kernel_head = LMHead(kernel, hidden, vocab, dtype, bias, **loss_kwargs)
    scale = 2 / hidden**0.5
    ref_head.lin.weight.data = torch.randn(vocab, hidden, device=device, dtype=dtype) * scale
    kernel_head.lin.weight.data = ref_head.lin.weight.data.clone()
    if bias:
        ref_head.lin.bias.data = torch.randn(vocab, device=device, dtype=dtype)
        kernel_head.lin.bias.data = ref_head.lin.bias.data.clone()
    return ref_head, kernel_head


def preference_batch(
    shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """(2B, T, H) hidden states and (2B, T) targets, chosen sequences first, rejected second,
    about a quarter of the targets ``ignore_index`` (prompt and padding tokens)."""
    pairs, tokens, hidden, vocab = shape
    x = torch.randn(2 * pairs, tokens, hidden, device=device, dtype=dtype)
    target = torch.randint(0, vocab, (2 * pairs, tokens), device=device)
    target[torch.rand(target.shape, device=device) < 0.25] = ignore_index
    return x, target


def run_heads(
    grad_reference: GradReference,
    device: torch.device,
    reference: Callable[..., Any],
    kernel: Callable[..., Any],
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    bias: bool = True,
    ignore_index: int = -100,
    **loss_kwargs: Any,
) -> tuple[Reference, Tensor, Tensor | None, LMHead, dict[str, Tensor]]:
    """The reference's values and gradients (input, weight, bias) by ``grad_reference``, and
    the kernel head's loss, input gradient, head (its parameters' gradients) and aux."""
    ref_head, kernel_head = heads(
        reference, kernel, shape, dtype, bias, device, ignore_index=ignore_index, **loss_kwargs
    )
    x, target = preference_batch(shape, dtype, device, ignore_index)
    ref = grad_reference(ref_head, x, target, has_aux=True)
    x_kernel = x.detach().clone().requires_grad_()
    loss, aux = kernel_head(x_kernel, target)
    loss.backward()
    return ref, loss, x_kernel.grad, kernel_head, aux
