"""Check and tune the per-chunk JSD kernels on one CUDA GPU (a few minutes on an H200).

    python benchmarks/tune_chunk.py

1. Correctness at the Llama-3 vocabulary against the float64 reference of the per-chunk
   contract (tests/kernels/_chunk_reference.py, which test_chunk_kernels.py checks with), for
   the portable PyTorch function and the Triton kernel with their shipped defaults, plus
   run-to-run bitwise equality.
2. Triton: a BLOCK_V x num_warps sweep in the fused loss's layout (bf16 teacher logits and
   gradient) for the mixture (0 < beta < 1, three passes) and the KL endpoints (beta 0 and 1,
   two passes), at temperature 1 and 2, for 256 rows and the chunk sizes. Set
   _chunk_triton._default_config from its "best" lines (each names the shipped choice's time).
3. PyTorch: a sweep of the rows per slice (set _chunk_torch.SLICE_ELEMENTS from it).
4. Both kernels with their defaults across loss variants.

Timings are triton.testing.do_bench medians (L2 flushed between runs). "GB/s" counts the bytes
the Triton kernel moves (see the _chunk_triton docstring); "floor" is the time one read of both
logit blocks plus one gradient write would take at 4.3 TB/s, the least any implementation
must move. Both kernels write the gradient over the teacher logits, so repeated calls see
gradients as logits: the data changes, the work does not.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from triton.testing import do_bench

# The kernels from the checkout; the float64 oracle from the tests (test support, not shipped).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))
from _chunk_reference import IGNORE_INDEX, chunk_options, chunk_reference
from gradref_kernels import _chunk_torch, _chunk_triton
from gradref_kernels._options import LossOptions

HBM_BYTES_PER_S = 4.3e12
VOCAB = 128256
CHUNKS = (1024, 2048)
# Largest tolerated error, relative to the largest gradient entry / the loss.
MAX_GRAD_ERR, MAX_LOSS_ERR = 2e-5, 1e-5

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# (student logits, teacher logits, labels, gradient output): what a kernel is called with.
Args = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_inputs(n: int, vs: int = VOCAB, vt: int = VOCAB, seed: int = 0) -> Inputs:
    """Float32 logits like a distillation batch: every 7th label ignored, as in ANCHORS.md."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    student = 2.0 * torch.randn(n, vs, device="cuda", generator=gen)
    teacher = 2.0 * torch.randn(n, vt, device="cuda", generator=gen)
    labels = torch.randint(0, vs, (n,), device="cuda", generator=gen)
    labels[::7] = IGNORE_INDEX
    return student, teacher, labels


def fp32_args(inputs: Inputs) -> Args:
    """Fresh copies, the float32 gradient written over the teacher logits: for exact checks."""
    student, teacher, labels = inputs
    teacher = teacher.clone()
    return student.clone(), teacher, labels, teacher[:, : student.shape[1]]


def fused_loss_args(kernel: str, inputs: Inputs) -> Args:
    """Copies in the layout the fused loss gives each kernel on bf16 inputs: Triton reads bf16
    teacher logits and writes over them; PyTorch reads float32 teacher logits and writes the
    bf16 gradient packed at the start of their storage (no bytes between its rows)."""
    student, teacher, labels = inputs
    vocab_s = student.shape[1]
    if kernel == "triton":
        teacher = teacher.bfloat16()
        return student.clone(), teacher, labels, teacher[:, :vocab_s]
    teacher = teacher.clone()
    packed = teacher.view(-1).view(torch.bfloat16)[: teacher.shape[0] * vocab_s]
    return student.clone(), teacher, labels, packed.view(-1, vocab_s)


def run_triton(
    args: Args, options: LossOptions, config: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    student, teacher, labels, grad_out = args
    if config is None:
        return _chunk_triton.jsd_chunk_(
            student, teacher, labels, grad_out=grad_out, options=options
        )
    block_v, num_warps = config
    return _chunk_triton._launch(
        student,
        teacher,
        labels,
        grad_out=grad_out,
        options=options,
        block_v=block_v,
        num_warps=num_warps,
    )


def run_torch(
    args: Args, options: LossOptions, slice_rows: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    student, teacher, labels, grad_out = args
    if not slice_rows:  # the shipped default
        return _chunk_torch.jsd_chunk_(student, teacher, labels, grad_out=grad_out, options=options)
    return _chunk_torch._chunk_(student, teacher, labels, grad_out, slice_rows, options=options)


KERNELS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "torch": run_torch,
    "triton": run_triton,
}


def check_correctness() -> bool:
    print("== correctness vs float64 autograd (n = 64; error relative to the largest entry)")
    ok = True
    cases = [  # (beta, temperature, compute_hard, vs, vt)
        (0.0, 2.0, True, VOCAB, VOCAB),
        (0.5, 2.0, True, VOCAB, VOCAB),
        (1.0, 2.0, True, VOCAB, VOCAB),
        (0.5, 1.0, True, VOCAB, VOCAB),
        (0.3, 1.0, True, 128000, VOCAB),  # teacher vocabulary padded beyond the student's
    ]
    for beta, temperature, hard, vs, vt in cases:
        inputs = make_inputs(64, vs, vt, seed=1)
        labels = inputs[2]
        valid = labels != IGNORE_INDEX
        options = chunk_options(beta, temperature, hard)
        ref_grad, ref_soft, ref_hard = chunk_reference(*inputs, options)
        ref_grad = ref_grad[valid]
        for name, run in KERNELS.items():
            runs = [fp32_args(inputs), fp32_args(inputs)]
            losses = [run(args, options) for args in runs]
            grad = runs[0][3][valid]
            soft, hard_loss = losses[0]
            grad_err = ((grad.double() - ref_grad).abs().max() / ref_grad.abs().max()).item()
            soft_err = abs(soft.item() - ref_soft.item()) / max(abs(ref_soft.item()), 1e-12)
            hard_err = abs(hard_loss.item() - ref_hard.item()) / max(abs(ref_hard.item()), 1e-12)
            bitwise = torch.equal(runs[0][3][valid], runs[1][3][valid]) and torch.equal(
                torch.stack(losses[0]), torch.stack(losses[1])
            )
            good = grad_err < MAX_GRAD_ERR and max(soft_err, hard_err) < MAX_LOSS_ERR and bitwise
            ok &= good
            print(
                f"  {name:<7} beta={beta} tau={temperature} Vs={vs} Vt={vt}: grad {grad_err:.1e}"
                f"  soft {soft_err:.1e}  hard {hard_err:.1e}  bitwise-repeatable {bitwise}  "
                f"{'ok' if good else 'FAIL'}"
            )
    return ok


def bytes_moved(labels: torch.Tensor, vs: int, vt: int, beta: float) -> int:
    """HBM traffic of one Triton call (fp32 student, bf16 teacher and gradient), by the pass
    structure in the _chunk_triton docstring."""
    ignored = int((labels == IGNORE_INDEX).sum())
    valid = labels.numel() - ignored
    read_pass = 4 * vs + 2 * vt
    passes = 2 if beta in (0.0, 1.0) else 3
    reads = passes * read_pass - 2 * (vt - vs)  # the last pass reads Vs of t
    return valid * (reads + 2 * vs) + ignored * 2 * vs


def bench(fn: Callable[[], object]) -> float:
    fn()  # compile outside the timing
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def report(name: str, n: int, ms: float, moved: int) -> None:
    floor_ms = n * (4 + 2 + 2) * VOCAB / HBM_BYTES_PER_S * 1e3  # read z, t once, write once
    gbs = moved / ms / 1e6
    print(f"  {name:<48} {n:>5} {ms:>8.3f} {gbs:>8.0f} {100 * gbs / 4300:>6.1f}% {floor_ms:>8.3f}")


def header(title: str) -> None:
    print(f"== {title}")
    print(f"  {'variant':<48} {'n':>5} {'ms':>8} {'GB/s':>8} {'%peak':>7} {'floor':>8}")


# (beta, temperature) of the sweep: the mixture's three-pass kernel and the KL endpoints'
# two-pass ones, each with and without a shared softmax (temperature 1 or 2).
SWEEP_LOSSES = [(0.5, 1.0), (0.5, 2.0), (0.0, 1.0), (0.0, 2.0), (1.0, 1.0), (1.0, 2.0)]
SWEEP_ROWS = (256, *CHUNKS)


def sweep_triton() -> None:
    header(f"Triton sweep: hard loss, V={VOCAB}, bf16 teacher and gradient")
    tiles = [(1024, 4), (2048, 4), (2048, 8), (2048, 16), (4096, 8), (4096, 16), (8192, 16)]
    for beta, temperature in SWEEP_LOSSES:
        for n in SWEEP_ROWS:
            inputs = make_inputs(n)
            args = fused_loss_args("triton", inputs)
            moved = bytes_moved(inputs[2], VOCAB, VOCAB, beta)
            options = chunk_options(beta, temperature)
            timings = {}
            for config in tiles:
                timings[config] = bench(partial(run_triton, args, options, config))
                name = f"beta={beta} tau={temperature} BLOCK_V={config[0]} num_warps={config[1]}"
                report(name, n, timings[config], moved)
            block_v, num_warps = min(timings, key=timings.__getitem__)
            soft_loss = _chunk_triton._soft_loss(beta)
            shipped = _chunk_triton._default_config(n, VOCAB, soft_loss, temperature == 1.0)
            print(
                f"  best for beta={beta} tau={temperature} n={n}: BLOCK_V={block_v} "
                f"num_warps={num_warps} ({timings[block_v, num_warps]:.3f} ms; shipped "
                f"{shipped[0]} x {shipped[1]}: {timings.get(shipped, float('nan')):.3f} ms)"
            )


def sweep_torch() -> None:
    header(f"PyTorch sweep of rows per slice: beta=0.5, tau=1, hard loss, V={VOCAB}, bf16 grad")
    for n in CHUNKS:
        inputs = make_inputs(n)
        args = fused_loss_args("torch", inputs)
        moved = bytes_moved(inputs[2], VOCAB, VOCAB, 0.5)
        for rows in (256, 342, 512, n):
            ms = bench(partial(run_torch, args, chunk_options(0.5, 1.0), rows))
            report(f"rows per slice {rows if rows < n else 'all'}", n, ms, moved)


def variants_table() -> None:
    header("both kernels with their shipped defaults, in the fused loss's bf16 layout")
    variants = [  # (name, beta, temperature, compute_hard)
        ("beta=0.5 tau=1 hard", 0.5, 1.0, True),
        ("beta=0.5 tau=2 hard", 0.5, 2.0, True),
        ("beta=0.5 tau=1 soft only", 0.5, 1.0, False),
        ("beta=0 tau=1 hard", 0.0, 1.0, True),
        ("beta=1 tau=1 hard", 1.0, 1.0, True),
    ]
    for n in CHUNKS:
        inputs = make_inputs(n)
        for name, beta, temperature, hard in variants:
            moved = bytes_moved(inputs[2], VOCAB, VOCAB, beta)
            for kernel, run in KERNELS.items():
                args = fused_loss_args(kernel, inputs)
                ms = bench(partial(run, args, chunk_options(beta, temperature, hard)))
                report(f"{kernel:<7} {name}", n, ms, moved)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    ok = check_correctness()
    sections = sys.argv[1:] or ["triton", "torch", "variants"]
    if "triton" in sections:
        sweep_triton()
    if "torch" in sections:
        sweep_torch()
    if "variants" in sections:
        variants_table()
    print("correctness:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
