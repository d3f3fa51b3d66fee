"""The fused loss and its reference where torch multiplies bfloat16 and float16 matrices in a
scalar loop: on a CPU without oneDNN kernels for them, 20 to 200 times slower than float32
(benchmarks/results/cpu/cpu_gemm.txt). Both then multiply float32 copies and round once
(``gradref_kernels._matmuls.products_via_float32``).

Every CPU runs the route here, with oneDNN switched off as such a CPU has it; the tensors are
on the CPU whatever the gradref device, since the route is the CPU's. CI also runs the kernel
suite with torch's kernels held to AVX2, where the route is taken without a switch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from gradref_kernels import fused_linear_jsd
from gradref_kernels._matmuls import products_via_float32
from gradref_kernels.reference import jsd_distillation_reference
from torch import Tensor

CPU = torch.device("cpu")
HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
# Several chunks of 16 rows, the last one short, and a teacher wider than the student.
SHAPE = {"rows": 37, "student_hidden": 16, "teacher_hidden": 24, "vocab": 50}
# The matrix products as the profiler names them, and its names of the half-precision dtypes.
PRODUCTS = frozenset({"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm"})
HALF_NAMES = frozenset({"c10::BFloat16", "c10::Half"})


@pytest.fixture
def without_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN switched off for the test, as a CPU without its low-precision kernels has it."""
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)


def products_run(fn: Callable[[], Any], trace: Path) -> tuple[int, list[tuple[str, list[str]]]]:
    """``fn()`` under torch's profiler: how many matrix products ran, and the name and
    operand types of those with a half-precision operand. The types are read from the trace
    the profiler exports (``trace``), which has them on every torch this project supports. A
    call before it makes the kernel probe the device (a 2x2 product in each dtype, once per
    process) outside the profile."""
    fn()
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True) as profile:
        fn()
    profile.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    products = [event for event in events if event.get("name") in PRODUCTS]
    half = [
        (event["name"], event["args"]["Input type"])
        for event in products
        if HALF_NAMES.intersection(event["args"]["Input type"])
    ]
    return len(products), half


def test_the_route_is_the_cpus_half_precision_products_without_onednn(
    without_onednn: None,
) -> None:
    for dtype in (torch.bfloat16, torch.float16):
        assert products_via_float32("cpu", dtype)
        for device_type in ("cuda", "npu", "meta"):
            assert not products_via_float32(device_type, dtype)
    for dtype in (torch.float32, torch.float64):
        assert not products_via_float32("cpu", dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_the_profiler_sees_a_half_precision_product(
    without_onednn: None, dtype: torch.dtype, tmp_path: Path
) -> None:
    # The check below can fail: torch's own linear layer, forward and backward, multiplies
    # in the inputs' dtype, which it sees.
    x = torch.randn(8, 4, dtype=dtype, requires_grad=True)
    weight = torch.randn(6, 4, dtype=dtype, requires_grad=True)
    count, half = products_run(
        lambda: F.linear(x, weight).sum().backward(), tmp_path / "trace.json"
    )
    assert count >= 3
    assert len(half) == count


def _kernel(implementation: str) -> Callable[..., Tensor]:
    if implementation == "triton":
        from gradref_kernels._chunk_triton import triton_unavailable_reason

        reason = triton_unavailable_reason(CPU)
        if reason is not None:
            pytest.skip(reason)
    return lambda *args, **options: fused_linear_jsd(
        *args, chunk_size=16, implementation=implementation, **options
    )


def _grad_and_value_reference(*args: Tensor) -> tuple[tuple[Tensor, ...], Tensor]:
    """The reference's input, weight and bias gradients and its value by
    ``torch.func.grad_and_value`` (the npu's strategy)."""

    def loss(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        return jsd_distillation_reference(x, weight, *args[2:5], bias, args[6])

    grads, value = torch.func.grad_and_value(loss, argnums=(0, 1, 2))(args[0], args[1], args[5])
    return grads, value


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    "computation", ["kernel-torch", "kernel-triton", "reference", "reference-grad_and_value"]
)
def test_no_product_runs_in_half_precision(
    make_jsd_inputs: Any,
    without_onednn: None,
    dtype: torch.dtype,
    computation: str,
    tmp_path: Path,
) -> None:
    inputs = make_jsd_inputs(dtype, device=CPU, **SHAPE)
    trace = tmp_path / "trace.json"
    if computation.startswith("kernel-"):
        kernel = _kernel(computation.removeprefix("kernel-"))
        count, half = products_run(lambda: inputs.run(kernel), trace)
    elif computation == "reference":
        count, half = products_run(lambda: inputs.run(jsd_distillation_reference), trace)
    else:
        count, half = products_run(lambda: _grad_and_value_reference(*inputs.args), trace)
    assert count >= 3  # the logits, and a product for each of two gradients at least
    assert half == []


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("implementation", ["torch", "triton"])
def test_the_kernel_passes_the_default_verdict_on_the_route(
    make_jsd_inputs: Any,
    grad_reference: Any,
    without_onednn: None,
    dtype: torch.dtype,
    bias: bool,
    implementation: str,
) -> None:
    inputs = make_jsd_inputs(dtype, device=CPU, bias=bias, **SHAPE)
    options = {"beta": 0.3, "temperature": 2.0, "weight_hard_loss": 0.4, "weight_soft_loss": 0.6}
    kernel = _kernel(implementation)
    loss, grads = inputs.run(lambda *args: kernel(*args, **options))
    ref = grad_reference(
        jsd_distillation_reference, *inputs.args, argnums=inputs.grad_argnums, **options
    )
    ref.assert_close(loss, grads)


@pytest.mark.parametrize("dtype", HALF)
def test_the_reference_rounds_as_onednns_kernels_do(
    make_jsd_inputs: Any, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    # The route's products are exact and summed in float32, as oneDNN's are, in another
    # order: the gradients must round to the same numbers but for a rare last bit.
    if products_via_float32("cpu", dtype):
        pytest.skip(f"this CPU has no oneDNN kernel for {dtype}: no route to compare with")
    inputs = make_jsd_inputs(
        dtype, device=CPU, rows=296, student_hidden=64, teacher_hidden=96, vocab=500
    )
    loss, grads = inputs.run(jsd_distillation_reference)
    # What the check must catch: a route more accurate than any half-precision kernel (its
    # logits, and their gradient before its products, never rounded) matches a third to two
    # thirds of the gradients' elements.
    _, unrounded_grads = inputs.run(_in_float32(jsd_distillation_reference))
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    route_loss, route_grads = inputs.run(jsd_distillation_reference)
    assert abs(route_loss.item() - loss.item()) <= 1e-5 * abs(loss.item())
    for grad, route_grad, unrounded in zip(grads, route_grads, unrounded_grads):
        assert route_grad.dtype == dtype
        assert _share_equal(route_grad, grad) >= 0.99
        assert _share_equal(unrounded, grad) < 0.9


def _in_float32(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn`` on float32 copies of its floating-point arguments."""
    return lambda *args: fn(*(t.float() if t.is_floating_point() else t for t in args))


def _share_equal(a: Tensor, b: Tensor) -> float:
    """The share of elements of ``a`` equal to ``b``'s, in ``b``'s dtype."""
    return (a.to(b.dtype) == b).float().mean().item()
