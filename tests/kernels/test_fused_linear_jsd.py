"""The chunked fused-linear JSD loss against the full-logits reference, on the gradref device.

Every comparison with the reference takes pytest-gradref's default verdict, with no tolerance
or budget of its own: the reference (matmuls in the inputs' dtype, the rest in at least
float32) also runs in float64 (the golden), and each item of the kernel, its greatest and its
normwise error against the golden, must be at most twice the same-dtype reference's, plus a
floor of a rounding step or so of the reference's dtype at the item's scale.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from gradref_kernels import FusedLinearJSDLoss, _chunk_torch, fused_linear_jsd
from gradref_kernels.reference import jsd_distillation_reference
from torch import Tensor

LOSS_CONFIGS = [  # temperature, weight_hard_loss, weight_soft_loss, beta
    (1.0, 0.5, 0.5, 0.5),
    (2.0, 0.0, 1.0, 0.8),
    (0.5, 1.0, 0.0, 0.2),
]
SHAPES_AND_DTYPES = [  # (B, T, H, V), dtype
    # The large cases are most of the kernel suite's CPU time, the more so on a CPU without
    # native bfloat16 matmuls (benchmarks/results/cpu/readme_commands.txt): the exhaustive run
    # (the test command and CI) covers all of them, the README's main job the smaller shapes.
    pytest.param(
        (8, 128, 1024, 4096),
        torch.bfloat16,
        id="8x128x1024x4096-bf16",
        marks=pytest.mark.exhaustive,
    ),
    pytest.param(
        (8, 128, 1024, 4096),
        torch.float32,
        id="8x128x1024x4096-fp32",
        marks=pytest.mark.exhaustive,
    ),
    pytest.param((3, 47, 31, 123), torch.bfloat16, id="3x47x31x123-bf16"),
    # 64 rows, a 128-wide student (256-wide teacher) and 256 classes in bf16: where a 1% scale
    # of the weight gradient hides under the normwise budget (the bf16 reference's own
    # normwise error is as large) and only the systematic criteria see it
    # (benchmarks/_mutations.py's grad_weight_scale_1pct is caught here).
    pytest.param((1, 64, 256, 256), torch.bfloat16, id="1x64x256x256-bf16"),
    pytest.param((3, 47, 31, 123), torch.float32, id="3x47x31x123-fp32"),
]
# The small problem of the tests beyond the reference suite: several chunks, odd sizes.
SMALL = {"rows": 37, "student_hidden": 16, "teacher_hidden": 24, "vocab": 50}


def check_against_reference(
    grad_reference: Any,
    inputs: Any,
    loss: Tensor,
    grads: tuple[Tensor, ...],
    reference: Callable[..., Tensor] = jsd_distillation_reference,
    budget: float | None = None,
    **options: Any,
) -> None:
    """The kernel's loss and gradients against ``reference`` on the same inputs, by the
    default verdict (a float64 golden, a budget of 2) unless ``budget`` says otherwise."""
    ref = grad_reference(reference, *inputs.args, argnums=inputs.grad_argnums, **options)
    ref.assert_close(loss, grads, budget=budget)


# --------------------------------------------------------------------------- reference suite


@pytest.mark.parametrize("ignore_index", [-100, 42])
@pytest.mark.parametrize(
    ("temperature", "weight_hard_loss", "weight_soft_loss", "beta"), LOSS_CONFIGS
)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize(("shape", "dtype"), SHAPES_AND_DTYPES)
def test_correctness(
    make_jsd_inputs: Any,
    grad_reference: Any,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    bias: bool,
    temperature: float,
    weight_hard_loss: float,
    weight_soft_loss: float,
    beta: float,
    ignore_index: int,
) -> None:
    batch, seq, hidden, vocab = shape
    inputs = make_jsd_inputs(
        dtype,
        rows=batch * seq,
        student_hidden=hidden // 2,
        teacher_hidden=hidden,
        vocab=vocab,
        bias=bias,
        ignore_index=ignore_index,
    )
    options = {
        "weight_hard_loss": weight_hard_loss,
        "weight_soft_loss": weight_soft_loss,
        "beta": beta,
        "ignore_index": ignore_index,
        "temperature": temperature,
    }
    loss, grads = inputs.run(FusedLinearJSDLoss(**options))
    check_against_reference(grad_reference, inputs, loss, grads, **options)


@pytest.mark.parametrize(
    ("temperature", "weight_hard_loss", "weight_soft_loss", "beta", "ignore_index"),
    [(1.0, 0.5, 0.5, 0.5, -100), (2.0, 0.1, 0.9, 0.5, 42)],
)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("batch", "seq", "hidden", "vocab"), [(2, 2, 8, 8), (9, 7, 41, 41)])
def test_correctness_functional(
    make_jsd_inputs: Any,
    grad_reference: Any,
    batch: int,
    seq: int,
    hidden: int,
    vocab: int,
    dtype: torch.dtype,
    bias: bool,
    temperature: float,
    weight_hard_loss: float,
    weight_soft_loss: float,
    beta: float,
    ignore_index: int,
) -> None:
    inputs = make_jsd_inputs(
        dtype,
        rows=batch * seq,
        student_hidden=hidden // 2,
        teacher_hidden=hidden,
        vocab=vocab,
        bias=bias,
        ignore_index=ignore_index,
    )
    positional = (weight_hard_loss, weight_soft_loss, beta, ignore_index, temperature)
    # Liger-Kernel's call style: everything positional after the tensors.
    loss, grads = inputs.run(lambda *tensors: fused_linear_jsd(*tensors, *positional))
    module_loss, module_grads = inputs.run(FusedLinearJSDLoss(*positional))
    assert torch.equal(loss, module_loss)
    for grad, module_grad in zip(grads, module_grads):
        assert torch.equal(grad, module_grad)
    options = dict(
        zip(
            ["weight_hard_loss", "weight_soft_loss", "beta", "ignore_index", "temperature"],
            positional,
        )
    )
    check_against_reference(grad_reference, inputs, loss, grads, **options)


# --------------------------------------------------------------------------- beyond it


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("beta", [0.0, 1.0], ids=["KL(T||S)", "KL(S||T)"])
def test_beta_endpoints(
    make_jsd_inputs: Any, grad_reference: Any, beta: float, dtype: torch.dtype, temperature: float
) -> None:
    inputs = make_jsd_inputs(dtype, **SMALL)
    options = {"beta": beta, "temperature": temperature}
    loss, grads = inputs.run(fused_linear_jsd, chunk_size=16, **options)
    check_against_reference(grad_reference, inputs, loss, grads, **options)


@pytest.mark.parametrize(
    ("temperature", "weight_hard_loss", "weight_soft_loss", "beta"), LOSS_CONFIGS
)
def test_float16_with_loss_scaling(
    make_jsd_inputs: Any,
    grad_reference: Any,
    temperature: float,
    weight_hard_loss: float,
    weight_soft_loss: float,
    beta: float,
) -> None:
    # As under torch.amp.GradScaler: grad_output is a large loss scale (2**12 keeps the
    # float16 reference's scaled loss finite), and the per-row gradients of a mean over 1024
    # rows of 2048-way distributions sit far below float16's smallest normal number unless
    # the kernel keeps them at a larger scale until backward.
    inputs = make_jsd_inputs(
        torch.float16, rows=1024, student_hidden=32, teacher_hidden=64, vocab=2048
    )
    options = {
        "weight_hard_loss": weight_hard_loss,
        "weight_soft_loss": weight_soft_loss,
        "beta": beta,
        "temperature": temperature,
    }

    def scaled(loss_fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        return lambda *args, **kwargs: 2.0**12 * loss_fn(*args, **kwargs)

    loss, grads = inputs.run(scaled(fused_linear_jsd), chunk_size=300, **options)
    check_against_reference(
        grad_reference, inputs, loss, grads, reference=scaled(jsd_distillation_reference), **options
    )


@pytest.mark.parametrize("rows", [37, 0], ids=["37-rows", "no-rows"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_all_labels_ignored(make_jsd_inputs: Any, beta: float, rows: int) -> None:
    inputs = make_jsd_inputs(torch.float32, **{**SMALL, "rows": rows}, ignored_share=1.0)
    loss_fn = FusedLinearJSDLoss(beta=beta, chunk_size=16, return_soft_hard_loss=True)
    (loss, soft, hard), grads = _run_with_outputs(loss_fn, inputs)
    for value in (loss, soft, hard):
        assert value.item() == 0.0
    for grad in grads:
        assert grad.isfinite().all()
        assert torch.count_nonzero(grad) == 0


def _run_with_outputs(
    loss_fn: Callable[..., tuple[Tensor, ...]], inputs: Any
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """Like JSDInputs.run for a loss function that returns (loss, soft, hard)."""
    outputs: list[Tensor] = []

    def first(*args: Any) -> Tensor:
        outputs.extend(loss_fn(*args))
        return outputs[0]

    _, grads = inputs.run(first)
    return tuple(t.detach() for t in outputs), grads


@pytest.mark.parametrize("chunk_size", [1, 5, 37, 100], ids=["1", "odd", "rows", "more"])
def test_chunk_size(
    make_jsd_inputs: Any,
    grad_reference: Any,
    chunk_size: int,
    implementation: str,
) -> None:
    # The Triton path sums the weight gradient over pairs of chunks: here 37 rows make pairs,
    # a partial last pair and a pair of one chunk.
    inputs = make_jsd_inputs(torch.float32, **SMALL)
    options = {"beta": 0.3, "temperature": 2.0}
    loss, grads = inputs.run(
        fused_linear_jsd, chunk_size=chunk_size, implementation=implementation, **options
    )
    check_against_reference(grad_reference, inputs, loss, grads, **options)


GRAPHS: dict[str, Callable[[Tensor, tuple[Tensor, ...]], Tensor]] = {
    "loss-times-3.5": lambda loss, args: 3.5 * loss,
    # grad_output = exp(loss), a tensor, and a second path into student_input
    "inside-a-graph": lambda loss, args: loss.exp() + args[0].square().mean(),
}


@pytest.mark.parametrize("graph", GRAPHS.values(), ids=GRAPHS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grad_output(
    make_jsd_inputs: Any,
    grad_reference: Any,
    dtype: torch.dtype,
    graph: Callable[[Tensor, tuple[Tensor, ...]], Tensor],
) -> None:
    inputs = make_jsd_inputs(dtype, **SMALL)

    def in_graph(loss_fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        return lambda *args, **kwargs: graph(loss_fn(*args, **kwargs), args)

    loss, grads = inputs.run(in_graph(fused_linear_jsd), chunk_size=16)
    check_against_reference(
        grad_reference, inputs, loss, grads, reference=in_graph(jsd_distillation_reference)
    )


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_teacher_vocabulary_larger(
    make_jsd_inputs: Any, grad_reference: Any, beta: float, temperature: float
) -> None:
    # The student's scaled logits are zero-padded to the teacher's 63 columns.
    inputs = make_jsd_inputs(torch.float32, **SMALL, teacher_vocab=SMALL["vocab"] + 13)
    options = {"beta": beta, "temperature": temperature}
    loss, grads = inputs.run(fused_linear_jsd, chunk_size=16, **options)
    check_against_reference(grad_reference, inputs, loss, grads, **options)


@pytest.mark.parametrize(
    ("weight_hard_loss", "weight_soft_loss"), [(0.5, 0.5), (0.0, 1.0), (1.0, 0.0)]
)
def test_return_soft_hard_loss(
    make_jsd_inputs: Any, weight_hard_loss: float, weight_soft_loss: float
) -> None:
    inputs = make_jsd_inputs(torch.float32, **SMALL)
    options = {"beta": 0.3, "temperature": 1.5, "chunk_size": 16}
    loss_fn = FusedLinearJSDLoss(
        weight_hard_loss, weight_soft_loss, return_soft_hard_loss=True, **options
    )
    (loss, soft, hard), grads = _run_with_outputs(loss_fn, inputs)
    _, plain_grads = inputs.run(FusedLinearJSDLoss(weight_hard_loss, weight_soft_loss, **options))

    assert loss.dtype == soft.dtype == hard.dtype == torch.float32
    assert torch.equal(loss, weight_hard_loss * hard + weight_soft_loss * soft)
    # Both losses are computed even at weight 0, since they are asked for.
    golden = [a.double() if a is not None and a.is_floating_point() else a for a in inputs.args]
    for value, weights in ((soft, (0.0, 1.0)), (hard, (1.0, 0.0))):
        expected = jsd_distillation_reference(*golden, *weights, beta=0.3, temperature=1.5)
        torch.testing.assert_close(value.double(), expected, rtol=1e-6, atol=0.0)
    # Returning them leaves the gradients alone, up to rounding: with weight_soft_loss = 0 the
    # plain call skips the soft loss and computes the hard one on its own code path.
    for grad, plain in zip(grads, plain_grads):
        torch.testing.assert_close(grad, plain, rtol=1e-6, atol=1e-6 * plain.abs().max().item())


def test_soft_and_hard_losses_are_detached(make_jsd_inputs: Any) -> None:
    inputs = make_jsd_inputs(torch.float32, **SMALL)
    student_input = inputs.student_input.requires_grad_(True)
    loss, soft, hard = fused_linear_jsd(*inputs.args, return_soft_hard_loss=True)
    assert loss.requires_grad
    assert not soft.requires_grad
    assert not hard.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.autograd.grad(soft, student_input)


def test_non_contiguous_inputs(make_jsd_inputs: Any, grad_reference: Any) -> None:
    base = make_jsd_inputs(torch.float32, **SMALL)

    def transposed(t: Tensor) -> Tensor:  # same values, column-major (dense, so clone keeps it)
        return t.t().contiguous().t()

    def strided(t: Tensor) -> Tensor:  # same values, every other element of a larger tensor
        wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
        wide[..., ::2] = t
        return wide[..., ::2]

    inputs = base.replace(
        student_input=transposed(base.student_input),
        student_weight=transposed(base.student_weight),
        teacher_input=strided(base.teacher_input),
        teacher_weight=transposed(base.teacher_weight),
        true_labels=strided(base.true_labels),
        teacher_bias=strided(base.teacher_bias),
    )
    assert not any(t.is_contiguous() for t in inputs.args if t is not None and t.dim() == 2)
    assert not inputs.true_labels.is_contiguous()
    loss, grads = inputs.run(fused_linear_jsd, chunk_size=16)
    check_against_reference(grad_reference, inputs, loss, grads)


def test_leading_batch_dimensions(make_jsd_inputs: Any) -> None:
    inputs = make_jsd_inputs(torch.float32, **{**SMALL, "rows": (3, 11)})
    flat = inputs.replace(
        student_input=inputs.student_input.flatten(0, 1),
        teacher_input=inputs.teacher_input.flatten(0, 1),
        true_labels=inputs.true_labels.flatten(),
    )
    loss, grads = inputs.run(fused_linear_jsd, chunk_size=16)
    flat_loss, flat_grads = flat.run(fused_linear_jsd, chunk_size=16)
    assert grads[0].shape == inputs.student_input.shape
    assert torch.equal(loss, flat_loss)
    for grad, flat_grad in zip(grads, flat_grads):
        assert torch.equal(grad.reshape(flat_grad.shape), flat_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_bitwise_deterministic(make_jsd_inputs: Any, beta: float, dtype: torch.dtype) -> None:
    inputs = make_jsd_inputs(dtype, **SMALL)
    first = inputs.run(fused_linear_jsd, beta=beta, chunk_size=16)
    second = inputs.run(fused_linear_jsd, beta=beta, chunk_size=16)
    assert torch.equal(first[0], second[0])
    for a, b in zip(first[1], second[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_gradcheck(make_jsd_inputs: Any, beta: float) -> None:
    # The kernel's own gradient against finite differences of its own loss, independent of
    # the reference: float64, so on the CPU whatever the gradref device (a property of the
    # math; float64 support varies between accelerators).
    inputs = make_jsd_inputs(
        torch.float64,
        device=torch.device("cpu"),
        rows=6,
        student_hidden=3,
        teacher_hidden=4,
        vocab=5,
        teacher_vocab=7,
        ignored_share=0.3,
        seed=1,
    )
    leaves = [inputs.args[i].clone().requires_grad_(True) for i in inputs.grad_argnums]

    def loss(student_input: Tensor, student_weight: Tensor, student_bias: Tensor) -> Tensor:
        return fused_linear_jsd(
            *inputs.replace(
                student_input=student_input,
                student_weight=student_weight,
                student_bias=student_bias,
            ).args,
            weight_hard_loss=0.3,
            weight_soft_loss=0.7,
            beta=beta,
            temperature=0.8,
            chunk_size=4,
        )

    assert torch.autograd.gradcheck(loss, tuple(leaves))


def test_no_grad_and_frozen_weight(make_jsd_inputs: Any) -> None:
    inputs = make_jsd_inputs(torch.float32, **SMALL)
    loss, (grad_input, _, _) = inputs.run(fused_linear_jsd, chunk_size=16)
    with torch.no_grad():
        no_grad_loss = fused_linear_jsd(*inputs.args, chunk_size=16)
    assert not no_grad_loss.requires_grad
    assert torch.equal(no_grad_loss, loss)
    # A frozen LM head (e.g. under LoRA): only the input gets a gradient, the same one.
    student_input = inputs.student_input.clone().requires_grad_(True)
    frozen_loss = fused_linear_jsd(*inputs.replace(student_input=student_input).args, chunk_size=16)
    frozen_loss.backward()
    assert torch.equal(frozen_loss.detach(), loss)
    assert torch.equal(student_input.grad, grad_input)
    assert inputs.student_weight.grad is None


@pytest.mark.parametrize("beta", [0.0, 0.5], ids=["KL(T||S)", "JSD"])
def test_teacher_with_zero_probabilities(
    make_jsd_inputs: Any, grad_reference: Any, beta: float
) -> None:
    # A teacher bias of -inf masks vocabulary entries (T = 0 exactly): 0 * log 0 must not
    # become NaN. The reference, which would produce NaN there, gets -1e4 instead: the same
    # distribution, since exp(-1e4) is 0 even in float64. (beta = 1 is left out: KL(S||T) is
    # infinite where T = 0.)
    inputs = make_jsd_inputs(torch.float32, **SMALL)
    masked = torch.zeros_like(inputs.teacher_bias, dtype=torch.bool)
    masked[::3] = True
    with_inf = inputs.replace(teacher_bias=inputs.teacher_bias.masked_fill(masked, -math.inf))
    options = {"beta": beta, "temperature": 0.7}
    loss, grads = with_inf.run(fused_linear_jsd, chunk_size=16, **options)
    assert loss.isfinite()
    assert all(grad.isfinite().all() for grad in grads)
    finite = inputs.replace(teacher_bias=inputs.teacher_bias.masked_fill(masked, -1e4))
    check_against_reference(grad_reference, finite, loss, grads, **options)


def test_integer_label_dtypes(make_jsd_inputs: Any) -> None:
    inputs = make_jsd_inputs(torch.float32, **SMALL)
    loss, grads = inputs.run(fused_linear_jsd, chunk_size=16)
    int32 = inputs.replace(true_labels=inputs.true_labels.int())
    loss32, grads32 = int32.run(fused_linear_jsd, chunk_size=16)
    assert torch.equal(loss, loss32)
    for a, b in zip(grads, grads32):
        assert torch.equal(a, b)


_LABELS_ON_DEVICE = (
    "off the CPU the label range is checked on the device without a host sync "
    "(torch._assert_async), which reports a failure asynchronously"
)
BAD_TENSORS = [
    pytest.param(
        lambda t: {"teacher_input": t.teacher_input[:-1]},
        ValueError,
        "row counts differ",
        id="teacher-rows",
    ),
    pytest.param(
        lambda t: {"true_labels": t.true_labels[:-1]},
        ValueError,
        "row counts differ",
        id="label-rows",
    ),
    pytest.param(
        lambda t: {"student_input": t.student_input[:, :-1]},
        ValueError,
        "student_input has hidden size",
        id="student-hidden",
    ),
    pytest.param(
        lambda t: {"teacher_input": t.teacher_input[:, :-1]},
        ValueError,
        "teacher_input has hidden size",
        id="teacher-hidden",
    ),
    pytest.param(
        lambda t: {"teacher_weight": t.teacher_weight[:-1], "teacher_bias": t.teacher_bias[:-1]},
        ValueError,
        "student vocabulary",
        id="student-vocab-larger",
    ),
    pytest.param(
        lambda t: {"student_bias": t.student_bias[:-1]},
        ValueError,
        "student_bias must have",
        id="student-bias-shape",
    ),
    pytest.param(
        lambda t: {"teacher_bias": t.teacher_bias[:, None]},
        ValueError,
        "teacher_bias must have",
        id="teacher-bias-shape",
    ),
    pytest.param(
        lambda t: {"true_labels": t.true_labels.float()},
        TypeError,
        "true_labels must be an integer",
        id="float-labels",
    ),
    pytest.param(
        lambda t: {"true_labels": torch.full_like(t.true_labels, 50)},
        ValueError,
        r"true_labels must be class indices in \[0, 50\)",
        id="label-too-large",
        marks=pytest.mark.gradref_only("cpu", reason=_LABELS_ON_DEVICE),
    ),
    pytest.param(
        lambda t: {"true_labels": torch.full_like(t.true_labels, -1)},
        ValueError,
        "or equal ignore_index=-100",
        id="label-negative",
        marks=pytest.mark.gradref_only("cpu", reason=_LABELS_ON_DEVICE),
    ),
    pytest.param(
        lambda t: {"teacher_weight": t.teacher_weight.double()},
        TypeError,
        "mixed floating dtypes",
        id="mixed-dtypes",
    ),
    pytest.param(
        lambda t: {"student_input": t.student_input.long()},
        TypeError,
        "student_input must be float16, bfloat16, float32 or float64",
        id="integer-input",
    ),
    pytest.param(
        lambda t: {"student_input": t.student_input[0]},
        ValueError,
        r"student_input must be \(rows, hidden\)",
        id="one-dimensional-input",
    ),
    pytest.param(
        lambda t: {"student_weight": t.student_weight[None]},
        ValueError,
        "student_weight must be 2-D",
        id="three-dimensional-weight",
    ),
    pytest.param(
        lambda t: {"true_labels": t.true_labels.to("meta")},
        ValueError,
        "must be on one device",
        id="devices",
    ),
    pytest.param(
        lambda t: {"student_input": t.student_input.tolist()},
        TypeError,
        "student_input must be a torch.Tensor",
        id="not-a-tensor",
    ),
]


@pytest.mark.parametrize(("change", "error", "match"), BAD_TENSORS)
def test_rejects_bad_tensors(
    make_jsd_inputs: Any, change: Callable[[Any], dict[str, Any]], error: type, match: str
) -> None:
    inputs = make_jsd_inputs(torch.float32, **SMALL)
    with pytest.raises(error, match=match):
        fused_linear_jsd(*inputs.replace(**change(inputs)).args)


BAD_OPTIONS = [
    pytest.param({"temperature": 0.0}, ValueError, "temperature must be a positive", id="temp-0"),
    pytest.param({"temperature": -1.0}, ValueError, "temperature", id="temp-negative"),
    pytest.param({"beta": -0.1}, ValueError, r"beta must be in \[0, 1\]", id="beta-negative"),
    pytest.param({"beta": 1.5}, ValueError, r"beta must be in \[0, 1\]", id="beta-above-1"),
    pytest.param({"chunk_size": 0}, ValueError, "chunk_size must be >= 1", id="chunk-size-0"),
    pytest.param({"chunk_size": 2.5}, TypeError, "chunk_size must be an int", id="chunk-float"),
    pytest.param({"ignore_index": -100.0}, TypeError, "ignore_index must be an int", id="index"),
    pytest.param(
        {"implementation": "cuda"}, ValueError, "implementation must be one of", id="impl"
    ),
]


@pytest.mark.parametrize(("options", "error", "match"), BAD_OPTIONS)
def test_rejects_bad_options(
    make_jsd_inputs: Any, options: dict[str, Any], error: type, match: str
) -> None:
    inputs = make_jsd_inputs(torch.float32, **SMALL)
    with pytest.raises(error, match=match):
        fused_linear_jsd(*inputs.args, **options)
    with pytest.raises(error, match=match):  # the module checks them when it is built
        FusedLinearJSDLoss(**options)


def test_unavailable_triton_says_why(make_jsd_inputs: Any) -> None:
    inputs = make_jsd_inputs(torch.float32, **SMALL)
    on_meta = inputs.replace(**{f: t.to("meta") for f, t in vars(inputs).items()})
    # The reason depends on the machine (no triton, or no meta support): that there is one.
    with pytest.raises(RuntimeError, match=r"implementation='triton' cannot run: \S"):
        fused_linear_jsd(*on_meta.args, implementation="triton")
    as_float64 = inputs.replace(
        **{f: t.double() for f, t in vars(inputs).items() if t.is_floating_point()}
    )
    with pytest.raises(RuntimeError, match="float64"):
        fused_linear_jsd(*as_float64.args, implementation="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_triton_implementation(
    make_jsd_inputs: Any, grad_reference: Any, triton_device: torch.device, dtype: torch.dtype
) -> None:
    inputs = make_jsd_inputs(dtype, **SMALL, teacher_vocab=SMALL["vocab"] + 5)
    options = {"beta": 0.3, "temperature": 2.0}
    # grad_output 3.5 reaches backward's scaled cast of the float32 weight-gradient sum.
    scaled = GRAPHS["loss-times-3.5"]

    def scaled_loss(loss_fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        return lambda *args, **kwargs: scaled(loss_fn(*args, **kwargs), args)

    loss, grads = inputs.run(
        scaled_loss(fused_linear_jsd), implementation="triton", chunk_size=16, **options
    )
    check_against_reference(
        grad_reference,
        inputs,
        loss,
        grads,
        reference=scaled_loss(jsd_distillation_reference),
        **options,
    )


@pytest.mark.parametrize(
    ("temperature", "extra_teacher_vocab"), [(1.0, 0), (2.0, 5)], ids=["shared", "padded"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_torch_implementation(
    make_jsd_inputs: Any,
    grad_reference: Any,
    dtype: torch.dtype,
    temperature: float,
    extra_teacher_vocab: int,
) -> None:
    # The portable path on every device: where "auto" picks Triton (CUDA) this is its only
    # fused-loss coverage.
    teacher_vocab = SMALL["vocab"] + extra_teacher_vocab
    inputs = make_jsd_inputs(dtype, **SMALL, teacher_vocab=teacher_vocab)
    options = {"beta": 0.3, "temperature": temperature}
    loss, grads = inputs.run(fused_linear_jsd, implementation="torch", chunk_size=16, **options)
    check_against_reference(grad_reference, inputs, loss, grads, **options)


def test_peak_memory_is_the_documented_buffers(
    make_jsd_inputs: Any,
    gradref_backend: Any,
    gradref_device: torch.device,
    implementation: str,
) -> None:
    # Nothing grows with N, and no chunk's buffer outlives its chunk: the peak is the buffers
    # the module docstring lists, whatever the number of chunks (here 8).
    if not gradref_backend.memory_stats(gradref_device):
        pytest.skip(f"torch tracks no allocations on {gradref_device.type}")
    rows, hidden, vocab, chunk = 2048, 64, 4096, 256
    inputs = make_jsd_inputs(
        torch.bfloat16, rows=rows, student_hidden=hidden, teacher_hidden=96, vocab=vocab, bias=False
    )
    float_logits = chunk * vocab * 4
    if implementation == "torch":
        # float32 student and teacher logits, and one slice buffer (bf16 at temperature 1)
        chunk_buffers = 3 * float_logits
    else:
        # float32 student logits, bf16 teacher logits of two chunks
        chunk_buffers = float_logits + 2 * chunk * vocab * 2
    weight_grad_sum = vocab * hidden * 4
    input_grad = rows * hidden * 2
    leaf_copies = (rows + vocab) * hidden * 2  # inputs.run's fresh student input and weight
    # A first call allocates what lives on between calls (the matmul library's workspace).
    inputs.run(fused_linear_jsd, chunk_size=chunk, implementation=implementation)
    gradref_backend.synchronize(gradref_device)
    gradref_backend.reset_peak_memory(gradref_device)
    base = gradref_backend.memory_stats(gradref_device)["memory_allocated"]
    inputs.run(fused_linear_jsd, chunk_size=chunk, implementation=implementation)
    gradref_backend.synchronize(gradref_device)
    peak = gradref_backend.memory_stats(gradref_device)["max_memory_allocated"] - base
    # Slack for the (rows,)-sized tensors and allocator rounding: a quarter of one buffer,
    # so a chunk buffer kept one chunk too long fails.
    assert peak <= chunk_buffers + weight_grad_sum + input_grad + leaf_copies + float_logits // 4


def test_skips_the_loss_nobody_needs(make_jsd_inputs: Any, monkeypatch: Any) -> None:
    # As Liger does for the hard loss; the soft loss (and the teacher's matmul) likewise.
    calls: list[str] = []
    jsd_chunk, ce_chunk = _chunk_torch.jsd_chunk_, _chunk_torch.cross_entropy_chunk_

    def spy_jsd(*args: Any, **kwargs: Any) -> Any:
        calls.append("jsd+ce" if kwargs["options"].compute_hard else "jsd")
        return jsd_chunk(*args, **kwargs)

    def spy_ce(*args: Any, **kwargs: Any) -> Any:
        calls.append("ce")
        return ce_chunk(*args, **kwargs)

    monkeypatch.setattr(_chunk_torch, "jsd_chunk_", spy_jsd)
    monkeypatch.setattr(_chunk_torch, "cross_entropy_chunk_", spy_ce)
    inputs = make_jsd_inputs(torch.float32, **SMALL)
    expected = {
        (0.0, 1.0, False): "jsd",
        (0.0, 1.0, True): "jsd+ce",
        (0.5, 0.5, False): "jsd+ce",
        (1.0, 0.0, False): "ce",
        (1.0, 0.0, True): "jsd+ce",
    }
    for (weight_hard, weight_soft, both), call in expected.items():
        calls.clear()
        fused_linear_jsd(
            *inputs.args,
            weight_hard_loss=weight_hard,
            weight_soft_loss=weight_soft,
            return_soft_hard_loss=both,
            compiled=False,
            implementation="torch",
        )
        assert calls == [call], (weight_hard, weight_soft, both)


# --------------------------------------------------------------------------- matmul operands


def test_gap_check_catches_rows_laid_over_wider_storage(gap_checking_matmuls: Any) -> None:
    # The layout behind NaN gradients on AMX CPUs: bfloat16 rows over float32 storage, the
    # float32 bits between them. The check must see it on every machine.
    storage = torch.full((6, 10), math.nan)
    rows = storage.view(torch.bfloat16)[:, :10]
    rows.copy_(torch.ones(6, 10))
    other = torch.ones(10, 3, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match=r"30 nonzero element\(s\) \(30 not finite\)"):
        torch.mm(rows, other)
    with pytest.raises(AssertionError, match="operand 0"):
        rows.t() @ torch.ones(6, 3, dtype=torch.bfloat16)
    # Dense operands, row- or column-major, and rows whose gaps hold zeros pass.
    torch.mm(rows.contiguous(), other)
    torch.addmm(torch.zeros(3, 6), other.t().float(), rows.t().float())
    zero_gaps = torch.zeros(6, 20, dtype=torch.bfloat16)
    zero_gaps[:, :10] = 1.0
    torch.mm(zero_gaps[:, :10], other)
    assert gap_checking_matmuls.checked == 8
    assert gap_checking_matmuls.strided == 3


@pytest.mark.parametrize(
    ("weight_hard_loss", "weight_soft_loss"), [(0.5, 0.5), (1.0, 0.0)], ids=["jsd", "hard-only"]
)
@pytest.mark.parametrize("teacher_vocab", [50, 63], ids=["same-vocab", "wider-teacher"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_matmul_operands_have_nothing_between_rows(
    make_jsd_inputs: Any,
    gap_checking_matmuls: Any,
    implementation: str,
    dtype: torch.dtype,
    teacher_vocab: int,
    weight_hard_loss: float,
    weight_soft_loss: float,
) -> None:
    # Every matmul of the fused loss, on every path and layout, gets operands whose bytes
    # between rows are zero: the logit gradient written over the teacher logits, the teacher's
    # extra columns (-inf logits here, so anything left there is not finite) and inputs that
    # come strided (NaN between their elements).
    inputs = make_jsd_inputs(dtype, **{**SMALL, "teacher_vocab": teacher_vocab})
    assert inputs.teacher_bias is not None
    teacher_bias = inputs.teacher_bias.clone()
    teacher_bias[SMALL["vocab"] :] = -math.inf

    def strided(t: Tensor) -> Tensor:
        wide = torch.full((t.shape[0], 2 * t.shape[1]), math.nan, dtype=t.dtype, device=t.device)
        wide[:, ::2] = t
        return wide[:, ::2]

    inputs = inputs.replace(
        teacher_bias=teacher_bias,
        student_input=strided(inputs.student_input),
        teacher_weight=strided(inputs.teacher_weight),
    )
    loss, grads = inputs.run(
        fused_linear_jsd,
        weight_hard_loss=weight_hard_loss,
        weight_soft_loss=weight_soft_loss,
        chunk_size=16,
        implementation=implementation,
    )
    assert gap_checking_matmuls.checked > 0
    assert loss.isfinite()
    assert all(grad.isfinite().all() for grad in grads)


# --------------------------------------------------------------------------- rounding


@pytest.mark.gradref_xfail(
    "npu",
    reason="without a bfloat16 matmul into float32 (aten::mm.dtype) and a free read of "
    "1/num_valid, grad_input is rounded, then scaled and rounded again (input_gradient_)",
    strict=False,
)
@pytest.mark.parametrize("grad_output", [1.0, 4.0])
def test_bfloat16_gradients_are_rounded_once(
    make_jsd_inputs: Any,
    monkeypatch: Any,
    implementation: str,
    grad_output: float,
) -> None:
    # Each gradient is the bfloat16 rounding of an exact product of the kernel's own bfloat16
    # logit gradient, scaled by grad_output / num_valid: the float64 product of the recorded
    # logit gradient, scaled and rounded once, gives the same bits (but for the rare entry
    # where float32 accumulation lands across a rounding boundary). Rounding the product,
    # then the scaled product, leaves a fifth of grad_input and two fifths of grad_weight one
    # step off. grad_output 4 is a loss scale: exact in any dtype.
    module = importlib.import_module(f"gradref_kernels._chunk_{implementation}")
    recorded: list[Tensor] = []
    chunk_fn = module.jsd_chunk_

    def recording(*args: Any, **kwargs: Any) -> Any:
        losses = chunk_fn(*args, **kwargs)
        recorded.append(kwargs["grad_out"].clone())
        return losses

    monkeypatch.setattr(module, "jsd_chunk_", recording)
    # 150 rows, about 112 of them valid: 1/num_valid is not a power of two.
    inputs = make_jsd_inputs(
        torch.bfloat16, rows=150, student_hidden=48, teacher_hidden=64, vocab=301
    )
    _, (grad_input, grad_weight, grad_bias) = inputs.run(
        lambda *args, **kwargs: grad_output * fused_linear_jsd(*args, **kwargs),
        chunk_size=64,
        implementation=implementation,
    )
    valid = inputs.true_labels != -100
    logit_grad = torch.cat(recorded).double() * valid.unsqueeze(1)
    scale = grad_output / int(valid.sum())
    expected = {
        "grad_input": logit_grad @ inputs.student_weight.double() * scale,
        "grad_weight": logit_grad.T @ inputs.student_input.double() * scale,
        "grad_bias": logit_grad.sum(dim=0) * scale,
    }
    for (name, exact), actual in zip(expected.items(), (grad_input, grad_weight, grad_bias)):
        assert actual.dtype == torch.bfloat16
        share_equal = (actual == exact.bfloat16()).double().mean().item()
        assert share_equal >= 0.999, f"{name}: {share_equal:.4f} of the entries rounded once"


# --------------------------------------------------------------------------- close distributions


@pytest.mark.parametrize(
    ("least_jsd", "bound"), [(1e-4, 2e-5), (1e-6, 1e-3)], ids=["jsd>=1e-4", "jsd>=1e-6"]
)
@pytest.mark.parametrize(
    ("beta", "temperature"), [(0.0, 1.0), (0.2, 2.0), (0.5, 1.0), (0.8, 2.0), (1.0, 1.0)]
)
def test_soft_loss_keeps_its_digits_when_student_is_close(
    make_jsd_inputs: Any,
    grad_reference: Any,
    implementation: str,
    beta: float,
    temperature: float,
    least_jsd: float,
    bound: float,
) -> None:
    # Late in distillation the per-row divergence is tiny next to the entropies (up to log V):
    # a loss computed as a difference of entropies keeps few of its float32 digits there
    # (2e-2 off at a per-row JSD of 2e-6). Relative error against float64 at most 2e-5 where
    # the per-row divergence is at least 1e-4, and 1e-3 where it is at least 1e-6.
    inputs = make_jsd_inputs(
        torch.float32, rows=96, student_hidden=32, teacher_hidden=32, vocab=2048, bias=False
    )
    # The teacher's weight is the student's, perturbed: the divergence grows with the square
    # of the perturbation, about 4 * spread * perturbation**2 per row with these logits.
    spread = (0.5 if beta in (0.0, 1.0) else beta * (1 - beta) / 2) / temperature**2
    perturbation = math.sqrt(3 * least_jsd / (4 * spread))
    gen = torch.Generator().manual_seed(7)
    noise = torch.randn(inputs.student_weight.shape, generator=gen).to(inputs.student_weight)
    scale = inputs.student_weight.std()
    close = inputs.replace(
        teacher_input=inputs.student_input,
        teacher_weight=inputs.student_weight + perturbation * scale * noise,
    )
    options = {"weight_hard_loss": 0.0, "weight_soft_loss": 1.0, "beta": beta}
    golden = jsd_distillation_reference(
        *(t.double() if t is not None and t.is_floating_point() else t for t in close.args),
        temperature=temperature,
        **options,
    )
    assert least_jsd <= golden.item() < 100 * least_jsd, "the case is in its regime"
    loss = fused_linear_jsd(
        *close.args, temperature=temperature, implementation=implementation, **options
    )
    relative_error = abs(loss.double().item() - golden.item()) / golden.item()
    assert relative_error <= bound
    # The same case by the default verdict, gradients included: its items are in the report,
    # so the precision gate sees the loss's digits in this regime too. The Triton kernel's
    # student_input gradient cancels more than autograd's here: its normwise error measured
    # 2.6x the float32 reference's at beta 0.2, temperature 2 in the Triton interpreter on the
    # CPU, 3.2x on the H200 (2.6e-5 relative; benchmarks/results/h200/suites_cuda_verdict.txt),
    # so that path gets a budget of 4.
    loss, grads = close.run(
        fused_linear_jsd, temperature=temperature, implementation=implementation, **options
    )
    budget = 4.0 if implementation == "triton" else None
    check_against_reference(
        grad_reference, close, loss, grads, budget=budget, temperature=temperature, **options
    )
