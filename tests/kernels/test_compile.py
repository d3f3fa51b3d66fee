"""The fused loss inside ``torch.compile``: a compiled function and a compiled module, in every
floating dtype, with and without biases, on both implementations, in default mode, with
``fullgraph=True`` and with ``dynamic=True``; no graph break, at most one recompile when the
row count changes.

Each case resets Dynamo and compiles once, on small shapes: Inductor sees the loss as custom
operators, so a compile takes a second or two on the CPU. Dynamo's count of the graphs it
captured is checked, so a case that broke its graph or fell back to eager fails instead of
passing unnoticed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from gradref_kernels import FusedLinearJSDLoss, fused_linear_jsd
from gradref_kernels.reference import jsd_distillation_reference
from test_fused_linear_jsd import SMALL, check_against_reference
from torch import Tensor, nn

pytestmark = [
    # Measured on the simulated npu: its tensors are a wrapper subclass without
    # __tensor_flatten__, which Dynamo cannot trace (the graph breaks at the first method
    # call on one); on Ascend, torch-npu's Inductor support is a separate question.
    pytest.mark.gradref_xfail(
        "npu",
        reason="Dynamo cannot trace the simulated npu's tensor subclass; torch-npu's "
        "Inductor support is immature",
        strict=False,
    ),
]

OPTIONS = {"beta": 0.3, "temperature": 2.0}
CHUNK_SIZE = 16  # several chunks of SMALL's rows
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture
def graphs() -> Iterator[Callable[[], int]]:
    """The number of graphs Dynamo has captured so far (one per frame compiled, so a graph
    break or a recompile adds one), on a fresh Dynamo: one test's cache entries neither serve
    another nor count towards its recompile limit."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    yield lambda: int(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()


def loss_of(implementation: str) -> Callable[..., Tensor]:
    """The loss as a user compiles it: positional tensors, the options fixed in the function."""

    def loss(*args: Any) -> Any:
        return fused_linear_jsd(
            *args, **OPTIONS, chunk_size=CHUNK_SIZE, implementation=implementation
        )

    return loss


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_function(
    make_jsd_inputs: Any,
    grad_reference: Any,
    graphs: Callable[[], int],
    implementation: str,
    dtype: torch.dtype,
    fullgraph: bool,
    bias: bool,
) -> None:
    inputs = make_jsd_inputs(dtype, **SMALL, bias=bias)
    compiled = torch.compile(loss_of(implementation), fullgraph=fullgraph)
    loss, grads = inputs.run(compiled)
    assert graphs() == 1  # no break, and no fallback to eager
    check_against_reference(grad_reference, inputs, loss, grads, **OPTIONS)
    # And the eager loss's results (the same operators), within the dtype's tolerance.
    eager = grad_reference.kernel(
        loss_of(implementation), *inputs.args, argnums=inputs.grad_argnums
    )
    eager.assert_close(loss, grads)


def test_dynamic_row_counts_compile_once(
    make_jsd_inputs: Any,
    grad_reference: Any,
    graphs: Callable[[], int],
    implementation: str,
) -> None:
    compiled = torch.compile(loss_of(implementation), fullgraph=True, dynamic=True)
    for rows in (SMALL["rows"], 2 * SMALL["rows"] + 5):
        inputs = make_jsd_inputs(torch.bfloat16, **{**SMALL, "rows": rows}, seed=rows)
        loss, grads = inputs.run(compiled)
        check_against_reference(grad_reference, inputs, loss, grads, **OPTIONS)
    # The graph does not depend on the row count (the issue allows one recompile; none happens).
    assert graphs() == 1


def test_no_graph_break(make_jsd_inputs: Any, implementation: str) -> None:
    # Counted by Dynamo's own explanation, without fullgraph=True (which would raise instead).
    torch._dynamo.reset()
    inputs = make_jsd_inputs(torch.bfloat16, **SMALL)
    explanation = torch._dynamo.explain(loss_of(implementation))(*inputs.args)
    torch._dynamo.reset()
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


class Student(nn.Module):
    """A linear layer on the student's hidden states, an ``lm_head`` and the loss at the end."""

    def __init__(self, loss: nn.Module, proj: nn.Linear, lm_head: Tensor) -> None:
        super().__init__()
        self.proj = proj
        self.lm_head = nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(lm_head.detach().clone())
        self.loss = loss

    def forward(self, x: Tensor, teacher_x: Tensor, teacher_weight: Tensor, labels: Tensor) -> Any:
        return self.loss(self.proj(x), self.lm_head.weight, teacher_x, teacher_weight, labels)


class ReferenceLoss(nn.Module):
    """The plain-PyTorch loss in module form, with the options of the compiled one."""

    def forward(self, *args: Tensor) -> Tensor:
        return jsd_distillation_reference(*args, **OPTIONS)


def proj_layer(hidden: int, dtype: torch.dtype, device: torch.device, seed: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(hidden, hidden)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(hidden, hidden, generator=gen) / math.sqrt(hidden))
        layer.bias.copy_(torch.randn(hidden, generator=gen) * 0.1)
    return layer.to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_compiled_module_dynamic(
    make_jsd_inputs: Any,
    grad_reference: Any,
    gradref_device: torch.device,
    graphs: Callable[[], int],
    implementation: str,
    dtype: torch.dtype,
) -> None:
    hidden = SMALL["student_hidden"]
    proj = proj_layer(hidden, dtype, gradref_device, seed=1)
    first = make_jsd_inputs(dtype, **SMALL, bias=False)
    loss_module = FusedLinearJSDLoss(
        **OPTIONS, chunk_size=CHUNK_SIZE, implementation=implementation
    )
    model = Student(loss_module, proj, first.student_weight)
    reference = Student(
        ReferenceLoss(), proj_layer(hidden, dtype, gradref_device, seed=1), model.lm_head.weight
    )
    compiled = torch.compile(model, dynamic=True)
    for rows in (SMALL["rows"], 2 * SMALL["rows"] + 5):
        inputs = make_jsd_inputs(dtype, **{**SMALL, "rows": rows}, bias=False, seed=rows)
        args = (
            inputs.student_input,
            inputs.teacher_input,
            inputs.teacher_weight,
            inputs.true_labels,
        )
        x = args[0].detach().clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        loss = compiled(x, *args[1:])
        loss.backward()
        ref = grad_reference(reference, *args, argnums=0)  # the default verdict's golden
        ref.assert_close(loss.detach(), (x.grad,), param_grads=model)
    assert 1 <= graphs() <= 2  # compiled, and recompiled at most once


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_compiled_gradients_stay_inside_the_operators(
    make_jsd_inputs: Any, graphs: Callable[[], int], implementation: str, dtype: torch.dtype
) -> None:
    """Backward hands every saved gradient to the scaled-cast operator and to no code that
    Inductor generates: an in-place multiply that Inductor wrote for them corrupted the heap
    of a float32 step, and under ATEN_CPU_CAPABILITY=avx2 scaled only every other 8 elements.
    Checked on the generated code, so it fails on every machine, not only where that code
    misbehaves."""
    from torch._inductor.utils import run_and_get_code

    inputs = make_jsd_inputs(dtype, **SMALL, bias=True)
    compiled = torch.compile(loss_of(implementation), fullgraph=True)
    _, (forward_code, backward_code) = run_and_get_code(lambda: inputs.run(compiled))
    assert "gradref_kernels.chunked_forward.default(" in forward_code
    casts = re.findall(r"gradref_kernels\.scaled_cast\.default\((\w+),", backward_code)
    assert len(casts) == 3  # grad_input, grad_weight, grad_bias
    generated_calls = re.findall(r"^\s*(\w+(?:\.run)?)\((.*)\)\s*$", backward_code, re.M)
    for name, arguments in generated_calls:
        if name.startswith(("cpp_fused", "triton_")):
            handed = set(re.findall(r"\w+", arguments)) & set(casts)
            assert not handed, f"{name} reads or writes the saved gradients {sorted(handed)}"
