"""``torch.library.opcheck`` on the kernel's two custom operators, on both implementations,
with opcheck's default checks:

- ``test_schema``: the operator neither mutates nor returns its inputs, as its schema says
  (``mutates_args=()``); the chunk loop reuses buffers of its own only;
- ``test_faketensor``: the fake implementation gives every output the shape, dtype, strides
  and device that the real operator gives it, so a fake that drifts from the real operator
  fails here, before a compiled graph is built on it;
- ``test_aot_dispatch_dynamic``: AOTAutograd with dynamic shapes (fake tensors of symbolic
  sizes through the fake implementation) runs the operator to the same outputs as eager;
- ``test_autograd_registration`` runs and checks nothing here: it needs an input that requires
  grad, and the operators have no autograd formula of their own. They are called as the kernel
  calls them: the chunk loop's by ``FusedLinearJSDFunction.forward``, with grad mode off,
  asking for the gradients that the Function's backward scales; the scaled cast by that
  backward, on saved gradients. For the same reason ``test_aot_dispatch_dynamic`` compares
  outputs, not gradients; the Function's gradients under AOTAutograd are ``test_compile.py``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from gradref_kernels import _ops
from gradref_kernels._ops import chunked_forward_op, scaled_cast_op
from gradref_kernels._options import LossOptions

# opcheck's fake-tensor check cannot make fake tensors of the simulated npu's tensor subclass
# (a wrapper without __tensor_flatten__); whether it passes on torch-npu's tensors is untested.
opcheck_xfail_npu = pytest.mark.gradref_xfail(
    "npu", reason="opcheck does not run on the simulated npu's tensors", strict=False
)

OPTIONS = LossOptions(
    beta=0.3,
    temperature=2.0,
    ignore_index=-100,
    weight_hard=0.4,
    weight_soft=0.7,
    compute_hard=True,
)
# Three chunks, the last one short (on the Triton path a pair of chunks, then one): small, as
# opcheck runs the operator several times and Triton's interpreter is slow on the CPU.
SHAPE = {"rows": 21, "student_hidden": 8, "teacher_hidden": 12, "vocab": 40}
CHUNK_SIZE = 8
DTYPES = [torch.float32, torch.bfloat16, torch.float16]  # float16 keeps a float32 grad_x


def forward_args(
    inputs: Any,
    implementation: str,
    *,
    compute_soft: bool = True,
    grads: tuple[bool, bool, bool] = (True, True, True),
) -> tuple[Any, ...]:
    """The operator's arguments as ``FusedLinearJSDFunction.forward`` passes them, asking for
    the input, weight and bias gradients where ``grads`` says so."""
    x, weight, teacher_x, teacher_weight, labels, bias, teacher_bias = inputs.args
    return (
        x,
        weight,
        teacher_x,
        teacher_weight,
        labels,
        bias,
        teacher_bias,
        *OPTIONS.as_op_args(),
        compute_soft,
        CHUNK_SIZE,
        implementation,
        grads[0],
        grads[1],
        grads[2] and bias is not None,
    )


@opcheck_xfail_npu
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_forward(
    make_jsd_inputs: Any, implementation: str, dtype: torch.dtype, bias: bool
) -> None:
    # A quarter of the rows carry ignore_index, so both losses and gradients drop rows.
    inputs = make_jsd_inputs(dtype, **SHAPE, bias=bias)
    torch.library.opcheck(chunked_forward_op, forward_args(inputs, implementation))


@opcheck_xfail_npu
@pytest.mark.parametrize(
    ("compute_soft", "grads"),
    [(True, (True, False, True)), (False, (False, True, False)), (True, (False, False, False))],
    ids=["frozen-weight", "hard-loss-only", "no-grad"],
)
def test_chunked_forward_partial(
    make_jsd_inputs: Any,
    implementation: str,
    compute_soft: bool,
    grads: tuple[bool, bool, bool],
) -> None:
    # Gradients not asked for are empty outputs; without the soft loss the teacher's matmul
    # and the per-chunk function are skipped. The teacher's vocabulary is wider here.
    inputs = make_jsd_inputs(torch.bfloat16, **SHAPE, teacher_vocab=SHAPE["vocab"] + 7)
    args = forward_args(inputs, implementation, compute_soft=compute_soft, grads=grads)
    torch.library.opcheck(chunked_forward_op, args)


@opcheck_xfail_npu
@pytest.mark.parametrize(
    ("source_dtype", "dtype"),
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ],
    ids=str,
)
def test_scaled_cast(
    gradref_device: torch.device,
    implementation: str,
    source_dtype: torch.dtype,
    dtype: torch.dtype,
) -> None:
    # As backward calls it: a float32 sum scaled and rounded to a lower precision, or a scaling
    # alone (compiled steps route that here too).
    gen = torch.Generator().manual_seed(0)
    source = torch.randn(50, 16, generator=gen).to(device=gradref_device, dtype=source_dtype)
    scale = torch.tensor(1 / 3, device=gradref_device, dtype=source_dtype)
    torch.library.opcheck(scaled_cast_op, (source, scale, dtype, implementation))


def test_fake_drift_fails(make_jsd_inputs: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The checks have teeth: a fake implementation whose losses are float64 for float32 inputs
    # (the chunk loop's own rule left as it is) fails test_faketensor. On the CPU everywhere,
    # where opcheck runs.
    monkeypatch.setattr(_ops, "work_dtype", lambda dtype: torch.float64)
    inputs = make_jsd_inputs(torch.float32, device=torch.device("cpu"), **SHAPE)
    results = torch.library.opcheck(
        chunked_forward_op, forward_args(inputs, "torch"), raise_exception=False
    )
    assert results["test_schema"] == "SUCCESS"
    assert isinstance(results["test_faketensor"], Exception)


@pytest.mark.gradref  # no device: the options and the schema only
def test_loss_options_convert_themselves() -> None:
    # The operator's schema spells the options out in LossOptions' field order.
    assert LossOptions.from_op_args(OPTIONS.as_op_args()) == OPTIONS
    fields = [field.name for field in dataclasses.fields(LossOptions)]
    assert [getattr(OPTIONS, name) for name in fields] == list(OPTIONS.as_op_args())
    schema = torch.ops.gradref_kernels.chunked_forward.default._schema
    names = [argument.name for argument in schema.arguments]
    start = names.index(fields[0])
    assert names[start : start + len(fields)] == fields
