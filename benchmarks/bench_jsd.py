"""Speed, memory and precision of the fused-linear JSD distillation loss.

Compares gradref_kernels.fused_linear_jsd (each implementation path) with the eager
full-logits PyTorch reference and Liger-Kernel's chunked loss (when importable), against the
GEMM floor: the four matmuls every implementation must do (student logits, teacher logits,
grad_input, grad_weight).

    python benchmarks/bench_jsd.py                 # the full GPU set (S1 and 8B/70B)
    python benchmarks/bench_jsd.py --quick         # small shapes on any device (CI smoke test)

Writes results.json, results.csv and bench_jsd.png to --out and prints markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _bench_util import (
    GIB,
    Step,
    available_bytes,
    device_name,
    environment,
    free_memory,
    markdown_table,
    measure,
    write_csv,
)

REPO = Path(__file__).resolve().parents[1]
# Measure the checked-out kernel, whether or not the package is installed.
sys.path.insert(0, str(REPO / "kernels"))
import gradref_kernels  # noqa: E402
from gradref_kernels import fused_linear_jsd  # noqa: E402
from gradref_kernels.reference import jsd_distillation_reference  # noqa: E402

DTYPE = torch.bfloat16
DTYPE_NAME = "bf16"
CHUNK_SIZE = 1024  # rows per chunk, for ours and Liger alike (both default to it)
QUICK_CHUNK_SIZE = 64  # so that the quick shapes still run several chunks
IGNORE_EVERY = 7  # every 7th label is ignore_index
LOGIT_STD = 2.0  # spread of the random logits, about that of a trained LM head
LOSS_KWARGS: dict[str, Any] = {
    "weight_hard_loss": 0.5,
    "weight_soft_loss": 0.5,
    "beta": 0.5,
    "ignore_index": -100,
    "temperature": 1.0,
}
PRECISION_MAX_ROWS = 1024  # keeps the float64 reference small (S1: 1 GiB per logits tensor)
FLOOR = "gemm-floor"
ROUNDED = "float64, rounded"  # the precision table's floor: the exact result, rounded once
PACKAGES = ["triton", "liger-kernel", "matplotlib", "numpy"]  # versions recorded in results.json


# --- shapes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    family: str
    n: int  # rows: batch * sequence
    hs: int  # student hidden size
    ht: int  # teacher hidden size
    v: int  # vocabulary

    @property
    def name(self) -> str:
        return f"{self.family}-n{self.n}"

    @property
    def flop(self) -> int:
        """Matmul work of forward + backward: both logits, grad_input, grad_weight."""
        return 2 * self.n * self.v * (3 * self.hs + self.ht)

    def with_rows(self, n: int) -> Shape:
        return dataclasses.replace(self, n=n)


LLAMA3_VOCAB = 128256
FULL_SHAPES = [
    *(Shape("s1", n, 2048, 4096, LLAMA3_VOCAB) for n in (4096, 8192, 16384)),
    Shape("8b70b", 8192, 4096, 8192, LLAMA3_VOCAB),  # Llama-3 8B student, 70B teacher
]
# Tiny: bf16 matmuls run at a few GFLOP/s on a 2-core CPU, and CI has two minutes.
QUICK_SHAPES = [Shape("quick", n, 64, 128, 2048) for n in (64, 128, 256)]
SHAPES = {shape.name: shape for shape in FULL_SHAPES + QUICK_SHAPES}


# --- the problem: inputs, weights, labels -----------------------------------------------------


@dataclass(frozen=True)
class Problem:
    student_input: torch.Tensor  # (N, Hs), requires grad
    student_weight: torch.Tensor  # (V, Hs), requires grad
    teacher_input: torch.Tensor  # (N, Ht)
    teacher_weight: torch.Tensor  # (V, Ht)
    true_labels: torch.Tensor  # (N,) int64
    student_bias: torch.Tensor | None  # (V,), requires grad
    teacher_bias: torch.Tensor | None  # (V,)

    def args(self) -> tuple[torch.Tensor | None, ...]:
        """Positional arguments in the order shared by ours, the reference and Liger."""
        return (
            self.student_input,
            self.student_weight,
            self.teacher_input,
            self.teacher_weight,
            self.true_labels,
            self.student_bias,
            self.teacher_bias,
        )

    def leaves(self) -> dict[str, torch.Tensor]:
        """The tensors that get gradients, by name."""
        named = {"student_input": self.student_input, "student_weight": self.student_weight}
        if self.student_bias is not None:
            named["student_bias"] = self.student_bias
        return named

    def drop_grads(self) -> None:
        for tensor in self.leaves().values():
            tensor.grad = None

    def copy_as(self, dtype: torch.dtype) -> Problem:
        """Fresh leaves holding the same values in `dtype` (exact when widening)."""

        def leaf(tensor: torch.Tensor, grad: bool) -> torch.Tensor:
            return tensor.detach().to(dtype).requires_grad_(grad)

        student_bias, teacher_bias = self.student_bias, self.teacher_bias
        return Problem(
            leaf(self.student_input, True),
            leaf(self.student_weight, True),
            leaf(self.teacher_input, False),
            leaf(self.teacher_weight, False),
            self.true_labels,
            None if student_bias is None else leaf(student_bias, True),
            None if teacher_bias is None else leaf(teacher_bias, False),
        )


def make_problem(shape: Shape, device: torch.device, bias: bool, seed: int) -> Problem:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int, std: float = 1.0, grad: bool = False) -> torch.Tensor:
        values = torch.randn(*size, generator=gen, device=device, dtype=DTYPE) * std
        return values.requires_grad_(grad)

    labels = torch.randint(0, shape.v, (shape.n,), generator=gen, device=device)
    labels[::IGNORE_EVERY] = LOSS_KWARGS["ignore_index"]
    return Problem(
        student_input=randn(shape.n, shape.hs, grad=True),
        student_weight=randn(shape.v, shape.hs, std=LOGIT_STD / math.sqrt(shape.hs), grad=True),
        teacher_input=randn(shape.n, shape.ht),
        teacher_weight=randn(shape.v, shape.ht, std=LOGIT_STD / math.sqrt(shape.ht)),
        true_labels=labels,
        student_bias=randn(shape.v, grad=True) if bias else None,
        teacher_bias=randn(shape.v) if bias else None,
    )


# --- implementations --------------------------------------------------------------------------

LossFn = Callable[[Problem], torch.Tensor]


@dataclass(frozen=True)
class Impl:
    name: str
    description: str
    loss_fn: LossFn | None  # None where it cannot run, and `unavailable` says why
    unavailable: str = ""


def _ours(path: str, chunk_size: int, loss_kwargs: dict[str, Any]) -> LossFn:
    # compiled=False: the portable path as NPU users run it, with no torch.compile.
    kwargs = {**loss_kwargs, "chunk_size": chunk_size, "implementation": path, "compiled": False}
    return lambda p: fused_linear_jsd(*p.args(), **kwargs)


def _ours_compiled(chunk_size: int, loss_kwargs: dict[str, Any]) -> LossFn:
    # The loss inside a compiled function, as a compiled training step holds it; "auto" is
    # the Triton path on CUDA, the portable one elsewhere.
    kwargs = {**loss_kwargs, "chunk_size": chunk_size}

    def loss(*args: torch.Tensor | None) -> torch.Tensor:
        return fused_linear_jsd(*args, **kwargs)  # type: ignore[arg-type,return-value]

    compiled = torch.compile(loss, fullgraph=True)
    return lambda p: compiled(*p.args())


def _eager(loss_kwargs: dict[str, Any]) -> LossFn:
    return lambda p: jsd_distillation_reference(*p.args(), **loss_kwargs, upcast=False)


def _liger_impls(chunk_size: int, loss_kwargs: dict[str, Any]) -> list[Impl]:
    """Liger-Kernel's chunked loss, compiled and eager; rows that say why when not importable."""
    about = "liger_kernel LigerFusedLinearJSDLoss, compiled={}"
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss
    except ImportError as exc:
        missing = f"not installed ({exc})"
        return [
            Impl("liger-compiled", about.format(True), None, missing),
            Impl("liger-eager", about.format(False), None, missing),
        ]

    def liger(compiled: bool) -> LossFn:
        module = LigerFusedLinearJSDLoss(**loss_kwargs, compiled=compiled, chunk_size=chunk_size)
        return lambda p: module(*p.args())

    return [
        Impl("liger-compiled", about.format(True), liger(True)),
        Impl("liger-eager", about.format(False), liger(False)),
    ]


def all_impls(
    device: torch.device, chunk_size: int, loss_kwargs: dict[str, Any] = LOSS_KWARGS
) -> list[Impl]:
    about = "gradref_kernels fused_linear_jsd, implementation={!r}, compiled=False"
    on_cuda = device.type == "cuda"
    return [
        Impl("ours-torch", about.format("torch"), _ours("torch", chunk_size, loss_kwargs)),
        Impl(
            "ours-triton",
            about.format("triton"),
            _ours("triton", chunk_size, loss_kwargs) if on_cuda else None,
            "" if on_cuda else "measured on CUDA only",
        ),
        Impl(
            "ours-compiled",
            "gradref_kernels fused_linear_jsd, implementation='auto', inside "
            "torch.compile(fullgraph=True)",
            _ours_compiled(chunk_size, loss_kwargs),
        ),
        Impl(
            "eager",
            "jsd_distillation_reference: full logits, in the input dtype",
            _eager(loss_kwargs),
        ),
        *_liger_impls(chunk_size, loss_kwargs),
    ]


def forward_backward(loss_fn: LossFn, problem: Problem) -> Step:
    def step() -> torch.Tensor:
        loss = loss_fn(problem)
        loss.backward()  # grad_output 1
        return loss.detach()

    return step


def gemm_floor(problem: Problem, rows: int) -> Step:
    """The four matmuls alone, in the input dtype, over blocks of `rows` rows.

    The student logits stand in for their gradient dZ: same shape, same dtype.
    """
    xs, ws = problem.student_input.detach(), problem.student_weight.detach()
    xt, wt = problem.teacher_input, problem.teacher_weight

    def step() -> None:
        grad_input = torch.empty_like(xs)
        grad_weight = None
        for start in range(0, xs.shape[0], rows):
            block = slice(start, start + rows)
            dz = xs[block] @ ws.T
            xt[block] @ wt.T  # the teacher logits: computed, then dropped
            torch.mm(dz, ws, out=grad_input[block])
            if grad_weight is None:
                grad_weight = dz.T @ xs[block]
            else:
                grad_weight.addmm_(dz.T, xs[block])

    return step


def floor_rows(shape: Shape, device: torch.device, chunk_size: int) -> int:
    """Full N when both N x V logits fit, else the kernels' chunking."""
    logits_bytes = 2 * shape.n * shape.v * DTYPE.itemsize
    room = available_bytes(device)
    return shape.n if room is None or logits_bytes < 0.9 * room else chunk_size


# --- performance rows -------------------------------------------------------------------------


@dataclass
class PerfRow:
    family: str
    shape: str
    n: int
    hs: int
    ht: int
    v: int
    impl: str
    status: str  # ok | skipped | oom | error
    reason: str = ""
    time_ms: float | None = None  # median forward + backward
    time_min_ms: float | None = None
    iters: int | None = None
    warmup: int | None = None
    first_call_s: float | None = None  # wall time of the first call: compilation, autotuning
    tflops: float | None = None  # 2*N*V*(3*Hs + Ht) / time
    x_floor: float | None = None  # time / GEMM-floor time at this shape
    peak_extra_gib: float | None = None  # CUDA: peak allocated minus inputs and weights
    loss: float | None = None
    note: str = ""

    @classmethod
    def new(cls, shape: Shape, impl: str, status: str, reason: str = "", note: str = "") -> PerfRow:
        dims = {"n": shape.n, "hs": shape.hs, "ht": shape.ht, "v": shape.v}
        return cls(
            shape.family, shape.name, **dims, impl=impl, status=status, reason=reason, note=note
        )


@dataclass(frozen=True)
class Settings:
    device: torch.device
    warmup: int
    iters: int
    chunk_size: int


def measured_row(
    shape: Shape, name: str, step: Step, problem: Problem, settings: Settings, note: str = ""
) -> PerfRow:
    row = PerfRow.new(shape, name, "ok", note=note)
    try:
        result = measure(step, problem.drop_grads, settings.device, settings.warmup, settings.iters)
    except torch.OutOfMemoryError as exc:
        row.status, row.reason = "oom", str(exc).splitlines()[0]
    except Exception as exc:  # one broken implementation must not end the run
        traceback.print_exc()
        row.status, row.reason = "error", f"{type(exc).__name__}: {exc}".splitlines()[0]
    else:
        row.time_ms, row.time_min_ms = result.median_ms, result.min_ms
        row.iters, row.warmup = settings.iters, settings.warmup
        row.first_call_s = result.first_call_s
        row.tflops = shape.flop / (result.median_ms * 1e-3) / 1e12
        if result.peak_extra_bytes is not None:
            row.peak_extra_gib = result.peak_extra_bytes / GIB
        if result.last_output is not None:
            row.loss = result.last_output.item()
    problem.drop_grads()
    free_memory(settings.device)
    return row


class MemoryModel:
    """Predicts an implementation's peak extra memory from its own earlier rows.

    Bytes per logit (N x V element) measured at smaller shapes, times N x V: close for the
    full-logits reference, an overestimate for chunked implementations. None before any row.
    """

    def __init__(self) -> None:
        self._bytes_per_logit: dict[str, float] = {}

    def record(self, row: PerfRow) -> None:
        if row.peak_extra_gib is not None:
            per_logit = row.peak_extra_gib * GIB / (row.n * row.v)
            self._bytes_per_logit[row.impl] = max(per_logit, self._bytes_per_logit.get(row.impl, 0))

    def estimate(self, impl: str, shape: Shape) -> float | None:
        per_logit = self._bytes_per_logit.get(impl)
        return None if per_logit is None else per_logit * shape.n * shape.v


def impl_row(
    shape: Shape, impl: Impl, problem: Problem, settings: Settings, memory: MemoryModel
) -> PerfRow:
    if impl.loss_fn is None:
        return PerfRow.new(shape, impl.name, "skipped", impl.unavailable)
    need, room = memory.estimate(impl.name, shape), available_bytes(settings.device)
    if need is not None and room is not None and need > room:
        reason = f"needs ~{need / GIB:.0f} GiB, {room / GIB:.0f} GiB free (estimated)"
        return PerfRow.new(shape, impl.name, "skipped", reason)
    row = measured_row(shape, impl.name, forward_backward(impl.loss_fn, problem), problem, settings)
    memory.record(row)
    return row


def run_shape(
    shape: Shape,
    impls: Sequence[Impl],
    with_floor: bool,
    settings: Settings,
    bias: bool,
    memory: MemoryModel,
) -> list[PerfRow]:
    problem = make_problem(shape, settings.device, bias, seed=0)
    rows = []
    if with_floor:
        block = floor_rows(shape, settings.device, settings.chunk_size)
        how = "4 matmuls at full N" if block == shape.n else f"4 matmuls, chunks of {block} rows"
        rows.append(measured_row(shape, FLOOR, gemm_floor(problem, block), problem, settings, how))
        _progress(rows[-1])
    for impl in impls:
        rows.append(impl_row(shape, impl, problem, settings, memory))
        _progress(rows[-1])
    floor_ms = rows[0].time_ms if with_floor else None
    for row in rows:
        if floor_ms and row.time_ms:
            row.x_floor = row.time_ms / floor_ms
    return rows


def _progress(row: PerfRow) -> None:
    print(f"  {row.impl:<15} {row.status:<8} {_fmt(row.time_ms, 'ms')} {row.reason}", flush=True)


# --- precision --------------------------------------------------------------------------------


@dataclass
class PrecisionRow:
    case: str  # the problem: shape and dtype, or the close-distributions case
    impl: str
    quantity: str  # loss | grad student_input | grad student_weight | grad student_bias
    status: str
    reason: str = ""
    norm_rel: float | None = None  # ||a - g|| / ||g||
    max_rel: float | None = None  # max |a - g| / max |g|


def loss_and_grads(loss_fn: LossFn, problem: Problem) -> dict[str, torch.Tensor]:
    loss = loss_fn(problem)
    loss.backward()
    results = {"loss": loss.detach()}
    for name, leaf in problem.leaves().items():
        if leaf.grad is None:
            raise RuntimeError(f"no gradient for {name}")
        results[f"grad {name}"] = leaf.grad
    return results


def relative_errors(actual: torch.Tensor, golden: torch.Tensor) -> tuple[float, float]:
    """Norm-wise and max-wise relative error: how the field reads a result's accuracy (a mean
    of elementwise relative errors is dominated by the entries near zero)."""
    diff = (actual.double() - golden).abs()
    tiny = torch.finfo(torch.float64).tiny
    norm = (diff.norm() / golden.norm().clamp_min(tiny)).item()
    worst = (diff.max() / golden.abs().max().clamp_min(tiny)).item()
    return norm, worst


def precision_rows(
    case: str,
    problem: Problem,
    dtype: torch.dtype,
    impls: Sequence[Impl],
    loss_kwargs: dict[str, Any] = LOSS_KWARGS,
    loss_only: bool = False,
) -> list[PrecisionRow]:
    """Each implementation on `dtype` copies of the problem against the reference on float64
    copies of it."""
    golden = loss_and_grads(_eager(loss_kwargs), problem.copy_as(torch.float64))
    # The least error a result can have: the float64 result rounded once, to `dtype` (the
    # loss to float32, the dtype ours returns it in).
    rows = [
        PrecisionRow(case, ROUNDED, quantity, "ok", "", *relative_errors(rounded, exact))
        for quantity, exact in golden.items()
        if not loss_only or quantity == "loss"
        for rounded in [exact.to(torch.float32 if quantity == "loss" else dtype)]
    ]
    for impl in impls:
        if impl.loss_fn is None:
            rows.append(PrecisionRow(case, impl.name, "all", "skipped", impl.unavailable))
            continue
        try:
            actual = loss_and_grads(impl.loss_fn, problem.copy_as(dtype))
        except torch.OutOfMemoryError as exc:
            rows.append(PrecisionRow(case, impl.name, "all", "oom", str(exc).splitlines()[0]))
        except Exception as exc:  # one broken implementation must not end the run
            traceback.print_exc()
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            rows.append(PrecisionRow(case, impl.name, "all", "error", reason))
        else:
            for quantity, value in actual.items():
                if loss_only and quantity != "loss":
                    continue
                errors = relative_errors(value, golden[quantity])
                rows.append(PrecisionRow(case, impl.name, quantity, "ok", "", *errors))
        free_memory(problem.student_input.device)
    return rows


# Late in distillation: the teacher's weight is the student's, perturbed by this much of its
# spread, so the per-row JSD is small next to the entropies (about 3e-5 and 2e-6 at beta 0.5).
CLOSE_SHAPE = Shape("close", 256, 64, 64, 4096)
CLOSE_PERTURBATIONS = (8e-3, 2e-3)
CLOSE_KWARGS = {**LOSS_KWARGS, "weight_hard_loss": 0.0, "weight_soft_loss": 1.0}


def close_problem(device: torch.device, perturbation: float) -> Problem:
    """CLOSE_SHAPE in float32, the teacher's input the student's and its weight a perturbed
    copy of the student's."""
    base = make_problem(CLOSE_SHAPE, device, bias=False, seed=2).copy_as(torch.float32)
    gen = torch.Generator(device=device).manual_seed(3)
    weight = base.student_weight.detach()
    noise = torch.randn(weight.shape, generator=gen, device=device) * weight.std()
    return dataclasses.replace(
        base,
        teacher_input=base.student_input.detach(),
        teacher_weight=weight + perturbation * noise,
    )


def close_precision_rows(
    device: torch.device, chunk_size: int, names: Sequence[str]
) -> list[PrecisionRow]:
    """The float32 soft loss of each implementation where student and teacher are close."""
    impls = [impl for impl in all_impls(device, chunk_size, CLOSE_KWARGS) if impl.name in names]
    rows = []
    for perturbation in CLOSE_PERTURBATIONS:
        problem = close_problem(device, perturbation)
        with torch.no_grad():
            jsd = _eager(CLOSE_KWARGS)(problem.copy_as(torch.float64)).item()
        case = f"{CLOSE_SHAPE.name} fp32, JSD per row {jsd:.1e}"
        rows += precision_rows(case, problem, torch.float32, impls, CLOSE_KWARGS, loss_only=True)
    return rows


# --- output -----------------------------------------------------------------------------------


def _fmt(value: float | None, unit: str = "", digits: int = 3) -> str:
    if value is None:
        return "-"
    text = f"{value:.{digits}g}"
    return f"{text} {unit}" if unit else text


def perf_table(rows: Sequence[PerfRow]) -> str:
    headers = [
        "shape",
        "impl",
        "time ms",
        "x floor",
        "TFLOP/s",
        "peak extra GiB",
        "iters",
        "1st call s",
        "loss",
        "status / note",
    ]
    body = [
        [
            row.shape,
            row.impl,
            _fmt(row.time_ms),
            _fmt(row.x_floor),
            _fmt(row.tflops),
            _fmt(row.peak_extra_gib),
            _fmt(row.iters),
            _fmt(row.first_call_s),
            _fmt(row.loss, digits=6),
            row.note if row.status == "ok" else f"{row.status}: {row.reason}",
        ]
        for row in rows
    ]
    return markdown_table(headers, body)


def precision_table(rows: Sequence[PrecisionRow]) -> str:
    headers = ["case", "impl", "quantity", "norm-wise rel", "max-wise rel", "status"]
    body = [
        [
            row.case,
            row.impl,
            row.quantity,
            _fmt(row.norm_rel, digits=2),
            _fmt(row.max_rel, digits=2),
            row.status if row.status == "ok" else f"{row.status}: {row.reason}",
        ]
        for row in rows
    ]
    return markdown_table(headers, body)


def plot(rows: Sequence[PerfRow], path: Path, title: str) -> None:
    """Time and peak memory against N for the shape family with the most sizes."""
    # Imported here: a machine without matplotlib still gets the tables and files.
    import matplotlib

    matplotlib.use("Agg")  # no display on CI and GPU machines
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    families: dict[str, set[int]] = {}
    for row in rows:
        families.setdefault(row.family, set()).add(row.n)
    family = max(families, key=lambda name: len(families[name]))
    picked = [row for row in rows if row.family == family]
    sizes = sorted(families[family])

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(13, 5))
    for impl in dict.fromkeys(row.impl for row in picked):
        mine = [row for row in picked if row.impl == impl]
        done = [row for row in mine if row.status == "ok"]
        missing = [str(row.n) for row in mine if row.status != "ok"]
        if not done:
            continue
        label = "GEMM floor (the 4 matmuls)" if impl == FLOOR else impl
        label += f" (none at N={', '.join(missing)})" if missing else ""
        style = {"color": "black", "linestyle": "--"} if impl == FLOOR else {"marker": "o"}
        ax_time.plot([r.n for r in done], [r.time_ms for r in done], label=label, **style)
        if impl != FLOOR and any(r.peak_extra_gib is not None for r in done):
            ax_mem.plot([r.n for r in done], [r.peak_extra_gib for r in done], label=impl, **style)
    plain = FuncFormatter(lambda y, _: f"{y:g}")  # 200, not 2 x 10^2
    ax_time.set_ylabel("forward + backward, ms (median)")
    ax_mem.set_ylabel("peak extra memory, GiB")
    for ax in (ax_time, ax_mem):
        ax.set_xlabel("N (rows)")
        if not ax.lines:
            ax.text(0.5, 0.5, "not measured on this device", ha="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 10, 20, 50, 100, ...
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    dims = f"Hs={picked[0].hs}, Ht={picked[0].ht}, V={picked[0].v}"
    fig.suptitle(f"{family} ({dims}): {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(
    out: Path, meta: dict[str, Any], perf: Sequence[PerfRow], precision: Sequence[PrecisionRow]
) -> None:
    perf_dicts = [dataclasses.asdict(row) for row in perf]
    precision_dicts = [dataclasses.asdict(row) for row in precision]
    document = {**meta, "performance": perf_dicts, "precision": precision_dicts}
    (out / "results.json").write_text(json.dumps(document, indent=2) + "\n")
    sections = [{"section": "performance", **row} for row in perf_dicts]
    sections += [{"section": "precision", **row} for row in precision_dicts]
    write_csv(out / "results.csv", sections)


# --- command line -----------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    impl_names = [
        FLOOR,
        "ours-torch",
        "ours-triton",
        "ours-compiled",
        "eager",
        "liger-compiled",
        "liger-eager",
    ]
    parser = argparse.ArgumentParser(description="Speed, memory and precision of the JSD loss.")
    parser.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder")
    quick_names = ", ".join(shape.name for shape in QUICK_SHAPES)
    parser.add_argument("--quick", action="store_true", help=f"small shapes: {quick_names}")
    parser.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if any)")
    parser.add_argument(
        "--shapes", nargs="+", choices=list(SHAPES), metavar="NAME", help=", ".join(SHAPES)
    )
    parser.add_argument(
        "--impls",
        nargs="+",
        choices=impl_names,
        default=impl_names,
        metavar="NAME",
        help=f"{', '.join(impl_names)} (default: all)",
    )
    parser.add_argument("--iters", type=int, default=10, help="timed calls (median is reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (>= 1)")
    parser.add_argument(
        "--chunk-size",
        type=int,
        help=f"rows per chunk, ours and Liger (default {CHUNK_SIZE}, --quick {QUICK_CHUNK_SIZE})",
    )
    parser.add_argument("--bias", action="store_true", help="give student and teacher a bias")
    parser.add_argument(
        "--beta",
        type=float,
        default=LOSS_KWARGS["beta"],
        help="mixture weight of the loss: 0 is KL(T||S), 1 KL(S||T) (default 0.5)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=LOSS_KWARGS["temperature"],
        help="softmax temperature of the soft loss (default 1.0)",
    )
    parser.add_argument("--skip-precision", action="store_true", help="no float64 comparison")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.warmup < 1 or args.iters < 1:
        parser.error("--warmup and --iters must be at least 1")
    if not 0.0 <= args.beta <= 1.0:
        parser.error(f"--beta must lie in [0, 1], got {args.beta}")
    if not args.temperature > 0.0:
        parser.error(f"--temperature must be positive, got {args.temperature}")
    if args.shapes is None and not args.quick and args.device.type == "cpu":
        parser.error("the full set needs a GPU: pass --quick or --shapes")
    return args


def metadata(
    args: argparse.Namespace,
    settings: Settings,
    impls: Sequence[Impl],
    loss_kwargs: dict[str, Any],
) -> dict[str, Any]:
    return {
        "environment": environment(settings.device, REPO, PACKAGES),
        "kernel_module": gradref_kernels.__file__,
        "settings": {
            "dtype": str(DTYPE),
            "chunk_size": settings.chunk_size,
            "bias": args.bias,
            "ignore_every": IGNORE_EVERY,
            "logit_std": LOGIT_STD,
            **loss_kwargs,
            "warmup": settings.warmup,
            "iters": settings.iters,
            "quick": args.quick,
            "timing": "CUDA events" if settings.device.type == "cuda" else "perf_counter + sync",
        },
        "implementations": {impl.name: impl.description for impl in impls},
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.device.type == "cuda":
        if args.device.index is None:
            args.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(args.device)  # CUDA events record on the current device
    shapes = (
        [SHAPES[name] for name in args.shapes]
        if args.shapes
        else (QUICK_SHAPES if args.quick else FULL_SHAPES)
    )
    chunk_size = args.chunk_size or (QUICK_CHUNK_SIZE if args.quick else CHUNK_SIZE)
    settings = Settings(args.device, args.warmup, args.iters, chunk_size)
    loss_kwargs = {**LOSS_KWARGS, "beta": args.beta, "temperature": args.temperature}
    impls = [
        impl for impl in all_impls(args.device, chunk_size, loss_kwargs) if impl.name in args.impls
    ]

    perf: list[PerfRow] = []
    memory = MemoryModel()
    for shape in shapes:
        print(f"{shape.name}: N={shape.n} Hs={shape.hs} Ht={shape.ht} V={shape.v}", flush=True)
        perf += run_shape(shape, impls, FLOOR in args.impls, settings, args.bias, memory)

    precision: list[PrecisionRow] = []
    # The float64 reference needs a smaller N: the first shape's sizes, at most 1024 rows.
    precision_shape = shapes[0].with_rows(min(shapes[0].n, PRECISION_MAX_ROWS))
    if not args.skip_precision:
        print(f"precision: {precision_shape.name} against float64", flush=True)
        problem = make_problem(precision_shape, args.device, args.bias, seed=1)
        case = f"{precision_shape.name} {DTYPE_NAME}"
        precision = precision_rows(case, problem, DTYPE, impls, loss_kwargs)
        precision += close_precision_rows(args.device, chunk_size, args.impls)

    device = device_name(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        plot(perf, args.out / "bench_jsd.png", f"{DTYPE_NAME} forward + backward, {device}")
    except ImportError as exc:
        print(f"no plot: {exc}")
    meta = metadata(args, settings, impls, loss_kwargs)
    meta["wall_s"] = time.perf_counter() - started
    write_outputs(args.out, meta, perf, precision)

    timing = f"median of {settings.iters} after {settings.warmup} warm-ups"
    loss = f"beta {args.beta}, temperature {args.temperature}"
    print(f"\n## {DTYPE_NAME} forward + backward on {device} ({loss}; {timing})\n")
    print(perf_table(perf))
    if precision:
        print("\n## Precision against the float64 reference\n")
        print(precision_table(precision))
    print(f"\n{meta['wall_s']:.0f} s; results in {args.out}/")


if __name__ == "__main__":
    main()
