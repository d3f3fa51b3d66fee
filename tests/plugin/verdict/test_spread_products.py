"""The rounding spread's runs round a half-precision matrix product from its float32 product
alone: the product in half precision, which torch computes in a scalar loop on CPUs without
oneDNN kernels for it, never runs there, and every run is bit for bit what it was when it did.
The runs compute on the gradref device.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pytest_gradref.reference.spread import RandomRounding

_aten = torch.ops.aten
_PRODUCTS = {
    _aten.mm,
    _aten.bmm,
    _aten.mv,
    _aten.dot,
    _aten.addmm,
    _aten.addmv,
    _aten.baddbmm,
    _aten.addbmm,
}


class ProductDtypes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the operand dtypes of each matrix product that reaches it."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in _PRODUCTS:
            dtypes = {a.dtype for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)}
            self.seen.extend((func.overloadpacket.__name__, dtype) for dtype in dtypes)
        return func(*args, **kwargs)


def every_product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each product the runs round, forward and (through autograd) backward."""
    logits = torch.nn.functional.linear(x, w, b)  # addmm
    batched = torch.bmm(x.view(2, -1, x.shape[-1]), w.t().expand(2, -1, -1))
    terms = [
        logits.float().logsumexp(-1).sum(),
        batched.float().square().mean(),
        torch.mv(w, x[0]).float().sum(),
        torch.dot(x[0], x[1]).float(),
        torch.addmv(b, w, x[1]).float().sum(),
        torch.baddbmm(
            b.expand(2, 1, -1), x.view(2, -1, x.shape[-1])[:, :1], w.t().expand(2, -1, -1)
        )
        .float()
        .sum(),
        torch.addbmm(logits[:2, :], x.view(2, -1, x.shape[-1])[:, :2], w.t().expand(2, -1, -1))
        .float()
        .sum(),
    ]
    return torch.stack(terms).sum()


def inputs(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 32, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(48, 32, generator=gen) / 4).to(device, dtype).requires_grad_()
    b = torch.randn(48, generator=gen).to(device, dtype).requires_grad_()
    return x, w, b


def run(
    device: torch.device, dtype: torch.dtype, seed: int, rounded_to: torch.dtype | None = None
) -> tuple[list[torch.Tensor], list[tuple[str, torch.dtype]]]:
    """A randomly rounded run's loss and gradients on ``device``, and the products below the
    run's mode."""
    x, w, b = inputs(dtype, device)
    recorder = ProductDtypes()
    with recorder, RandomRounding(seed, rounded_to):
        loss = every_product(x, w, b)
        loss.backward()
    assert x.grad is not None
    assert w.grad is not None
    assert b.grad is not None
    return [loss.detach(), x.grad, w.grad, b.grad], recorder.seen


def general_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every product computed in its dtype, then again in float32, as before the shortcut."""
    no_shortcut: Callable[..., None] = lambda *args: None  # noqa: E731
    monkeypatch.setattr(RandomRounding, "_product_of_half", no_shortcut)


HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_the_runs_multiply_no_half_precision_matrices(
    gradref_device: torch.device, dtype: torch.dtype
) -> None:
    _, seen = run(gradref_device, dtype, seed=0)
    assert {name for name, _ in seen} == {p.__name__ for p in _PRODUCTS}, seen
    assert {d for _, d in seen} == {torch.float32}, seen


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_the_general_way_multiplies_in_half_precision(
    gradref_device: torch.device, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The check above can fail: without the shortcut the run multiplies in the inputs' dtype.
    general_way(monkeypatch)
    _, seen = run(gradref_device, dtype, seed=0)
    assert {name for name, d in seen if d == dtype} == {p.__name__ for p in _PRODUCTS}, seen


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_runs_are_what_they_were_bit_for_bit(
    gradref_device: torch.device, dtype: torch.dtype, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    shortcut, _ = run(gradref_device, dtype, seed)
    general_way(monkeypatch)
    general, _ = run(gradref_device, dtype, seed)
    for name, new, old in zip(("loss", "x", "w", "b"), shortcut, general):
        assert new.dtype == old.dtype, name
        assert torch.equal(new, old), (name, float((new.double() - old.double()).abs().max()))
    # and the runs are random draws: another seed rounds differently
    other, _ = run(gradref_device, dtype, seed + 10)
    assert not torch.equal(shortcut[2], other[2])


def test_a_rounded_reference_in_a_coarser_dtype_takes_the_general_way(
    gradref_device: torch.device,
) -> None:
    # float16 products of a reference rounded to bfloat16 are rounded from their float16
    # result, which the run must then compute.
    _, seen = run(gradref_device, torch.float16, seed=0, rounded_to=torch.bfloat16)
    assert ("mm", torch.float16) in seen or ("addmm", torch.float16) in seen, seen


def test_a_mixed_dtype_product_takes_the_general_way(gradref_device: torch.device) -> None:
    x = torch.randn(4, 8, device=gradref_device).bfloat16()
    w = torch.randn(8, 8, device=gradref_device)
    recorder = ProductDtypes()
    with pytest.raises(RuntimeError), recorder, RandomRounding(0):
        torch.mm(x, w)  # torch refuses it, as without the mode
