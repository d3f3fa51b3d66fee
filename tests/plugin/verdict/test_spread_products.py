"""The rounding spread's runs round a half-precision matrix product from its float32 product
alone: the product in half precision, which torch computes in a scalar loop on CPUs without
oneDNN kernels for it, never runs there, and every run is bit for bit what it was when it did.
The runs compute on the gradref device.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from _forked_runs import runpytest_forked
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


# A DTensor's products, on a one-rank gloo mesh in a child process (the process group is
# process-wide): the rows of x sharded, w and b replicated, as a sharded reference has them.
# The logits and the input gradient are rounded from float32 alone. The weight gradient sums
# over the sharded rows into a Partial placement, where a DTensor cannot draw noise: as before,
# it is computed in bfloat16 and kept (RandomRounding.transform's fallback). A mutation that
# rounds a DTensor product the general way fails the products' count.
DTENSOR_RUN = """
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from pytest_gradref.reference.spread import RandomRounding


class Products(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bfloat16 = 0
        self.float32 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            dtypes = {a.dtype for a in args if isinstance(a, DTensor)}
            self.bfloat16 += torch.bfloat16 in dtypes
            self.float32 += torch.float32 in dtypes
        return func(*args, **(kwargs or {}))


MESH = []


# Whether a run rounds a product sharded by rows on this torch's DTensor (torch 2.6's lacks a
# sharding strategy for the casts the rounding takes).
def rounds_sharded(mesh):
    a = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])
    exact = torch.mm(a, b)
    try:
        rounding = RandomRounding(0)
        rounding._rounded(torch.ops.aten.mm.default, (a, b), {}, exact.bfloat16(), 0, exact)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def run():
    mesh = MESH[0]
    gen = torch.Generator().manual_seed(5)
    shapes = ((8, 32), (48, 32), (48,))
    x, w, b = (torch.randn(*shape, generator=gen).bfloat16() for shape in shapes)
    x = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    w = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
    b = distribute_tensor(b, mesh, [Replicate()]).requires_grad_()
    products = Products()
    with products, RandomRounding(0):
        loss = torch.nn.functional.linear(x, w, b).float().sin().sum()
        loss.backward()
    assert isinstance(x.grad, DTensor)
    return [loss, x.grad, w.grad, b.grad], products


def test_dtensor_products(tmp_path, monkeypatch):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    MESH.append(init_device_mesh("cpu", (1,)))
    try:
        kept = 1 if rounds_sharded(MESH[0]) else 3
        shortcut, products = run()
        monkeypatch.setattr(RandomRounding, "_product_of_half", lambda *args: None)
        general, general_products = run()
    finally:
        dist.destroy_process_group()
    # the general way: the three products in bfloat16, then again in float32
    assert (general_products.bfloat16, general_products.float32) == (3, 3)
    # the shortcut: the three in float32 once; in bfloat16 only those whose result is kept, as
    # a DTensor that cannot be rounded in their layout has them: the weight gradient's (Partial),
    # and on a torch whose DTensor cannot round a sharded product (2.6), all three
    assert (products.bfloat16, products.float32) == (kept, 3)
    # A DTensor draws its noise from its own random state, not the run's seeded generator (the
    # general way too), so the two runs are two draws, not comparable bit for bit; each keeps
    # the DTensor's dtypes and layout.
    for new, old in zip(shortcut, general):
        assert (new.dtype, new.placements) == (old.dtype, old.placements)
        assert bool(new.to_local().isfinite().all())
"""


@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="this torch build has no gloo process groups",
)
def test_a_dtensors_products_are_rounded_from_float32_alone(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_dtensor_products=DTENSOR_RUN)
    result = runpytest_forked(pytester, "--gradref-device=cpu", "-p", "no:randomly")
    result.assert_outcomes(passed=1)
