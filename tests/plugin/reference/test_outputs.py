"""Every output a kernel has: value-only references (argnums=()) and tensor outputs, whose
gradients are the vector-Jacobian product with a cotangent the reference draws (or the test
gives) and exposes for the kernel's own backward."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _verdict_calls import failure

from pytest_gradref import Reference, compute_reference
from pytest_gradref.config.strategies import Strategy
from pytest_gradref.config.tolerances import DEFAULT_BUDGET, CheckPolicy


def reference(fn: Any, *args: Any, strategy: Strategy = "autograd", **kwargs: Any) -> Reference:
    """fn's reference as grad_reference computes it under the default verdict."""
    return compute_reference(
        fn,
        args,
        {},
        strategy=strategy,
        default_strategy=strategy,
        policy=CheckPolicy(
            backend="cpu", default_golden=torch.float64, default_budget=DEFAULT_BUDGET
        ),
        has_aux=kwargs.pop("has_aux", False),
        argnums=kwargs.pop("argnums", (0, 1)),
        **kwargs,
    )


def per_token_loss(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """A per-token cross-entropy (reduction="none"): shape (N,)."""
    return F.cross_entropy(x @ w.T, labels, reduction="none")


def inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=gen).to(dtype)
    w = (torch.randn(128, 32, generator=gen) / 32**0.5).to(dtype)
    return x, w, torch.randint(0, 128, (64,), generator=gen)


def kernel(
    x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, cotangent: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token loss and the gradients its backward gives with the reference's
    cotangent, as a kernel's test computes them."""
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = per_token_loss(xs, ws, labels)
    out.backward(cotangent)
    assert xs.grad is not None
    assert ws.grad is not None
    return out.detach(), xs.grad, ws.grad


# --- tensor outputs --------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["autograd", "grad_and_value"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tensor_output_is_judged_with_its_cotangent(
    strategy: Strategy, dtype: torch.dtype
) -> None:
    x, w, labels = inputs(dtype)
    ref = reference(per_token_loss, x, w, labels, strategy=strategy)
    assert ref.cotangent is not None
    assert (ref.cotangent.shape, ref.cotangent.dtype) == ((64,), dtype)
    out, grad_x, grad_w = kernel(x, w, labels, ref.cotangent)
    ref.assert_close(out, (grad_x, grad_w))
    # One token off: 1% in float32, 5% in bf16 (1% of one bf16 element is about its own
    # rounding step); the output is an item like any other.
    off = out.clone()
    off[3] *= 1.01 if dtype == torch.float32 else 1.05
    message = failure(ref, off, (grad_x, grad_w))
    assert "1 of 3 items differ\n- value:" in message
    # A gradient that is not the vector-Jacobian product with that cotangent.
    _, grad_x, grad_w = kernel(x, w, labels, torch.ones_like(ref.cotangent))
    assert "- gradient of argument 0 (x):" in failure(ref, out, (grad_x, grad_w))


def test_the_functional_route_takes_a_vector_jacobian_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The npu's strategy (grad_and_value) must stay functional for a tensor output: torch.func
    # computes it, not autograd, and agrees with autograd.
    calls = []
    vjp = torch.func.vjp

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return vjp(*args, **kwargs)

    monkeypatch.setattr(torch.func, "vjp", counted)
    x, w, labels = inputs(torch.float32)
    functional = reference(per_token_loss, x, w, labels, strategy="grad_and_value")
    assert calls
    calls.clear()
    by_autograd = reference(per_token_loss, x, w, labels, strategy="autograd")
    assert not calls
    assert functional.cotangent is not None
    assert by_autograd.cotangent is not None
    assert torch.equal(functional.cotangent, by_autograd.cotangent)
    torch.testing.assert_close(functional.grads, by_autograd.grads)


def test_the_cotangent_is_seeded_and_leaves_the_test_rng_alone() -> None:
    x, w, labels = inputs(torch.float32)
    torch.manual_seed(7)
    before = torch.random.get_rng_state()
    first = reference(per_token_loss, x, w, labels)
    assert torch.equal(torch.random.get_rng_state(), before)
    second = reference(per_token_loss, x, w, labels)
    assert first.cotangent is not None
    assert second.cotangent is not None
    assert torch.equal(first.cotangent, second.cotangent)


def test_the_golden_takes_the_same_cotangent() -> None:
    x, w, labels = inputs(torch.bfloat16)
    ref = reference(per_token_loss, x, w, labels)
    assert ref.golden is not None
    assert ref.cotangent is not None
    xs, ws = x.double().requires_grad_(), w.double().requires_grad_()
    out = F.cross_entropy(xs @ ws.T, labels, reduction="none")
    out.backward(ref.cotangent.double())
    assert ref.golden.arg_grads[0].dtype == torch.float64
    torch.testing.assert_close(ref.golden.arg_grads[0], xs.grad)
    torch.testing.assert_close(ref.golden.arg_grads[1], ws.grad)


def test_a_test_may_give_its_own_cotangent() -> None:
    x = torch.randn(8, 4, dtype=torch.float64)
    cotangent = torch.randn(8, dtype=torch.float64)
    ref = reference(lambda t: t.exp().sum(1), x, argnums=0, cotangent=cotangent)
    assert ref.cotangent is cotangent
    torch.testing.assert_close(ref.grads, x.exp() * cotangent[:, None])
    # A scalar loss may take one too: its gradient is scaled by it.
    scaled = reference(lambda t: t.exp().sum(), x, argnums=0, cotangent=torch.tensor(3.0).double())
    torch.testing.assert_close(scaled.grads, 3 * x.exp())


@pytest.mark.parametrize(
    ("cotangent", "says"),
    [
        (torch.ones(3), r"shape \(3,\) and dtype torch.float32, but .* returned shape \(8,\)"),
        (
            torch.ones(8, dtype=torch.float64),
            r"dtype torch.float64, but .* returned shape \(8,\) and dtype torch.float32",
        ),
    ],
    ids=["shape", "dtype"],
)
def test_a_wrong_cotangent_names_both_shapes_and_dtypes(cotangent: torch.Tensor, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        reference(lambda t: t.sum(1), torch.randn(8, 4), argnums=0, cotangent=cotangent)


def norm_with_stats(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An RMS norm that returns its output and the per-row reciprocal RMS, both
    differentiable, as a fused norm kernel returns them."""
    rstd = torch.rsqrt(x.float().square().mean(-1) + 1e-6)
    return (x.float() * rstd[:, None] * weight.float()).to(x.dtype), rstd


@pytest.mark.parametrize("strategy", ["autograd", "grad_and_value"])
def test_a_tuple_of_outputs_takes_a_cotangent_each(strategy: Strategy) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=gen)
    weight = torch.randn(64, generator=gen)
    ref = reference(norm_with_stats, x, weight, strategy=strategy)
    assert isinstance(ref.cotangent, tuple)
    assert [c.shape for c in ref.cotangent] == [(32, 64), (32,)]
    xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
    out, rstd = norm_with_stats(xs, ws)
    torch.autograd.backward([out, rstd], list(ref.cotangent))
    grads = (xs.grad, ws.grad)
    ref.assert_close((out.detach(), rstd.detach()), grads)
    off = rstd.detach().clone()
    off[5] *= 1.01
    assert "1 of 4 items differ\n- value[1]:" in failure(ref, (out.detach(), off), grads)
    # Both cotangents count: the output's alone gives other gradients.
    xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
    norm_with_stats(xs, ws)[0].backward(ref.cotangent[0])
    assert "- gradient of argument 0 (x):" in failure(
        ref, (out.detach(), rstd.detach()), (xs.grad, ws.grad)
    )
    with pytest.raises(TypeError, match=r"has 2 outputs \(value\[0\], value\[1\]\)"):
        ref.assert_close(out.detach(), grads)


def test_a_tuple_of_outputs_needs_a_tuple_of_cotangents() -> None:
    x, weight = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(TypeError, match="returned 2 outputs, so cotangent= must be a tuple of 2"):
        reference(norm_with_stats, x, weight, cotangent=torch.ones(4, 8))


# --- value-only references -------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["autograd", "grad_and_value"])
def test_a_value_only_reference_checks_value_and_aux(strategy: Strategy) -> None:
    x, w, labels = inputs(torch.bfloat16)

    def with_aux(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> Any:
        losses = per_token_loss(x, w, labels)
        return losses, {"mean": losses.float().mean()}

    ref = reference(with_aux, x, w, labels, strategy=strategy, argnums=(), has_aux=True)
    assert ref.grads == ()
    assert ref.cotangent is None
    out, aux = with_aux(x, w, labels)
    ref.assert_close(out, aux=aux)
    wrong = {"mean": aux["mean"] * 1.01}
    assert "- aux['mean']:" in failure(ref, out, aux=wrong)
    with pytest.raises(TypeError, match=r"holds no gradients \(argnums=\(\)"):
        ref.assert_close(out, (x,), aux=aux)


def test_a_cotangent_without_gradients_is_refused() -> None:
    with pytest.raises(ValueError, match="cotangent= is for gradients"):
        reference(lambda t: t * 2, torch.randn(4), argnums=(), cotangent=torch.ones(4))


# --- in a suite: the fixture, the report and the gate see the items ------------------------------

SUITE = """
import torch
import torch.nn.functional as F


def per_token(x, w, labels):
    return F.cross_entropy(x @ w.T, labels, reduction="none")


def test_per_token(grad_reference):
    x, w = torch.randn(16, 8), torch.randn(32, 8)
    labels = torch.randint(0, 32, (16,))
    ref = grad_reference(per_token, x, w, labels, argnums=(0, 1))
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = per_token(xs, ws, labels)
    out.backward(ref.cotangent)
    ref.assert_close(out.detach(), (xs.grad, ws.grad))


def test_value_only(grad_reference):
    x, w = torch.randn(16, 8), torch.randn(32, 8)
    labels = torch.randint(0, 32, (16,))
    ref = grad_reference(per_token, x, w, labels, argnums=())
    ref.assert_close(per_token(x, w, labels))
"""


def test_the_report_records_tensor_outputs_and_value_only_items(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_kernel_outputs=SUITE)
    result = pytester.runpytest("--gradref-device=cpu", "--gradref-report=report.json")
    result.assert_outcomes(passed=2)
    tests = {
        t["nodeid"].split("::")[1]: t
        for t in json.loads((pytester.path / "report.json").read_text())["tests"]
    }
    labels = [item["label"] for item in tests["test_per_token"]["items"]]
    assert labels == ["value", "gradient of argument 0 (x)", "gradient of argument 1 (w)"]
    assert [item["label"] for item in tests["test_value_only"]["items"]] == ["value"]
    # The gate judges them against that report.
    gated = pytester.runpytest(
        "--gradref-device=cpu", "--gradref-baseline=report.json", "--gradref-baseline-fail"
    )
    assert gated.ret == pytest.ExitCode.OK
    gated.stdout.fnmatch_lines(["against report.json: 4 items compared, 0 regressions*"])
