"""``torch.library.opcheck`` on every custom operator the kernel package registers (the chunk
loop and the scaled cast on both implementations; the vocab-parallel chunk loop and input
gradient in two ranks), with opcheck's default checks:

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

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from gradref_kernels import _ops
from gradref_kernels._ops import chunked_forward_op, scaled_cast_op
from gradref_kernels._options import LossOptions
from gradref_kernels._vocab_parallel_ops import (
    vocab_parallel_forward_op,
    vocab_parallel_input_grad_op,
)

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


@opcheck_xfail_npu
@pytest.mark.gradref_ranks(2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_vocab_parallel_operators(
    gradref_rank: Any, gradref_device: torch.device, dtype: torch.dtype
) -> None:
    # In two ranks, each with its slice of the heads, on the rank's device and collective
    # library: every real call opcheck makes runs the operator's collectives, in the same
    # order on both ranks.
    gen = torch.Generator().manual_seed(0)
    rows, hidden, teacher_hidden, vocab = 10, 8, 12, 24

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen).to(device=gradref_device, dtype=dtype)

    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[::4] = OPTIONS.ignore_index
    labels = labels.to(gradref_device)
    heads = [randn(vocab, hidden), randn(vocab, teacher_hidden), randn(vocab), randn(vocab)]
    weight, teacher_weight, bias, teacher_bias = (gradref_rank.shard(t) for t in heads)
    group = gradref_rank.group.group_name
    forward = (
        randn(rows, hidden),
        weight,
        randn(rows, teacher_hidden),
        teacher_weight,
        labels,
        bias,
        teacher_bias,
        *OPTIONS.as_op_args(),
        True,  # compute_soft
        4,  # chunk_size: three chunks, the last one short
        group,
        True,
        True,
        True,
    )
    torch.library.opcheck(vocab_parallel_forward_op, forward)
    share = torch.randn(rows, hidden, generator=gen).to(gradref_device)
    scale = torch.tensor(0.25, device=gradref_device)
    torch.library.opcheck(vocab_parallel_input_grad_op, (share, scale, dtype, group))


def _opchecked_operators() -> set[str]:
    """The operators this file's tests pass to torch.library.opcheck, by their names."""
    checked = set()
    for node in ast.walk(ast.parse(Path(__file__).read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "opcheck"
            and node.args
            and isinstance(node.args[0], ast.Name)
        ):
            checked.add(globals()[node.args[0].id]._qualname)
    return checked


@pytest.mark.gradref  # no device: the registry and this file only
def test_every_registered_operator_is_opchecked() -> None:
    # A new operator in the package cannot skip opcheck: every gradref_kernels:: operator the
    # dispatcher knows is passed to opcheck by a test above.
    registered = {
        name
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("gradref_kernels::")
    }
    assert len(registered) >= 4
    assert registered <= _opchecked_operators(), registered - _opchecked_operators()
