"""Check and tune the Triton JSD chunk kernel on one CUDA GPU (about a minute on an H200).

    python benchmarks/tune_chunk_triton.py

1. Correctness at the Llama-3 vocabulary against gradref_kernels.reference in float64 with
   autograd (through the logits-level wrapper of tests/kernels/test_chunk_triton.py), plus
   run-to-run bitwise equality and the bf16 gradient output (equal to torch's cast of the
   fp32 in-place gradient).
2. A BLOCK_V x num_warps sweep per chunk size for the configuration the fused loss runs on
   CUDA (0 < beta < 1, the three-pass case; bf16 teacher logits, bf16 gradient output). Set
   _chunk_triton._default_config from its "best" lines.
3. The best tile and the shipped default across chunk sizes and loss variants.

Timings are triton.testing.do_bench medians (L2 flushed between runs). "GB/s" counts the bytes
the kernel moves (see the _chunk_triton docstring); "floor" is the time one read of both logit
blocks plus one gradient write would take at 4.3 TB/s, the least any implementation must move.
The kernel works in place, so repeated calls see gradients as logits: the data changes, the
work does not.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from triton.testing import do_bench

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT / "kernels"), str(_ROOT / "tests" / "kernels")]
from gradref_kernels import _chunk_triton  # noqa: E402
from test_chunk_triton import IGNORE, WEIGHT_HARD, WEIGHT_SOFT, reference  # noqa: E402

HBM_BYTES_PER_S = 4.3e12
VOCAB = 128256
CHUNKS = (256, 512, 1024)
# Largest tolerated error, relative to the largest gradient entry / the loss.
MAX_GRAD_ERR, MAX_LOSS_ERR = 2e-5, 1e-5


def make_inputs(
    n: int, vs: int = VOCAB, vt: int = VOCAB, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits like a distillation batch: every 7th label ignored, as in ANCHORS.md."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    student = 2.0 * torch.randn(n, vs, device="cuda", generator=gen)
    teacher = 2.0 * torch.randn(n, vt, device="cuda", generator=gen)
    labels = torch.randint(0, vs, (n,), device="cuda", generator=gen)
    labels[::7] = IGNORE
    inv = 1.0 / (labels != IGNORE).sum().clamp_min(1).float()
    return student, teacher, labels, inv


def launch(
    inputs: tuple[torch.Tensor, ...],
    *,
    beta: float,
    temperature: float = 2.0,
    compute_hard: bool = True,
    grad_out: torch.Tensor | None = None,
    config: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    student, teacher, labels, inv = inputs
    kwargs = {
        "beta": beta,
        "temperature": temperature,
        "ignore_index": IGNORE,
        "weight_hard": WEIGHT_HARD,
        "weight_soft": WEIGHT_SOFT,
        "compute_hard": compute_hard,
        "grad_out": grad_out,
    }
    if config is None:
        return _chunk_triton.jsd_chunk_(student, teacher, labels, inv, **kwargs)
    block_v, num_warps = config
    return _chunk_triton._launch(
        student,
        teacher,
        labels,
        inv,
        **kwargs,
        block_v=block_v,
        num_warps=num_warps,
    )


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
        student, teacher, labels, inv = make_inputs(64, vs, vt, seed=1)
        grad = student.clone()
        soft, hard_loss = launch(
            (grad, teacher, labels, inv), beta=beta, temperature=temperature, compute_hard=hard
        )
        again = student.clone()
        soft2, hard2 = launch(
            (again, teacher, labels, inv), beta=beta, temperature=temperature, compute_hard=hard
        )
        # The bf16 output replaces the in-place write and leaves the logits as they were.
        kept = student.clone()
        grad_bf16 = torch.empty_like(grad, dtype=torch.bfloat16)
        launch(
            (kept, teacher, labels, inv),
            beta=beta,
            temperature=temperature,
            compute_hard=hard,
            grad_out=grad_bf16,
        )
        ref_grad, ref_soft, ref_hard = reference(
            student, teacher, labels, beta=beta, temperature=temperature, compute_hard=hard
        )
        grad_err = ((grad.double() - ref_grad).abs().max() / ref_grad.abs().max()).item()
        soft_err = abs(soft.item() - ref_soft.item()) / max(abs(ref_soft.item()), 1e-12)
        hard_err = abs(hard_loss.item() - ref_hard.item()) / max(abs(ref_hard.item()), 1e-12)
        bitwise = all(
            torch.equal(a, b) for a, b in ((grad, again), (soft, soft2), (hard_loss, hard2))
        )
        # Within one bf16 step of torch's cast: the kernel variant without the fp32 write is
        # compiled separately, and may contract multiply-adds differently.
        step = grad.abs() * 2.0**-8
        bf16_ok = bool(((grad_bf16.float() - grad).abs() <= step).all())
        bf16_ok &= torch.equal(kept, student)
        good = (
            grad_err < MAX_GRAD_ERR
            and max(soft_err, hard_err) < MAX_LOSS_ERR
            and bitwise
            and bf16_ok
        )
        ok &= good
        print(
            f"  beta={beta} tau={temperature} Vs={vs} Vt={vt}: grad {grad_err:.1e}  "
            f"soft {soft_err:.1e}  hard {hard_err:.1e}  bitwise-repeatable {bitwise}  "
            f"bf16-output-ok {bf16_ok}  {'ok' if good else 'FAIL'}"
        )
    return ok


def bytes_moved(
    labels: torch.Tensor, vs: int, vt: int, beta: float, grad_out: bool, teacher_bytes: int = 4
) -> int:
    """HBM traffic of one call, by the pass structure in the _chunk_triton docstring."""
    ignored = int((labels == IGNORE).sum())
    valid = labels.numel() - ignored
    read_pass = 4 * vs + teacher_bytes * vt
    passes = 2 if beta in (0.0, 1.0) else 3
    reads = passes * read_pass - teacher_bytes * (vt - vs)  # the last pass reads Vs of t
    write = 2 * vs if grad_out else 4 * vs
    return valid * (reads + write) + ignored * write


def bench(fn: Callable[[], object]) -> float:
    fn()  # compile outside the timing
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def report(name: str, n: int, ms: float, moved: int, vs: int) -> None:
    floor_ms = n * 4 * (3 * vs) / HBM_BYTES_PER_S * 1e3  # read z and t once, write once
    gbs = moved / ms / 1e6
    print(f"  {name:<44} {n:>5} {ms:>8.3f} {gbs:>8.0f} {100 * gbs / 4300:>6.1f}% {floor_ms:>8.3f}")


def header(title: str) -> None:
    print(f"== {title}")
    print(f"  {'variant':<44} {'n':>5} {'ms':>8} {'GB/s':>8} {'%peak':>7} {'floor':>8}")


def sweep_tiles() -> dict[int, tuple[int, int]]:
    """Fastest (BLOCK_V, num_warps) per chunk size, for the three-pass case as run on CUDA."""
    header(f"tile sweep: beta=0.5, tau=2, hard loss, V={VOCAB}, bf16 teacher and gradient")
    configs = [
        (block_v, num_warps)
        for block_v in (512, 1024, 2048, 4096, 8192)
        for num_warps in (4, 8, 16)
        if 4 <= block_v // (32 * num_warps) <= 32  # fp32 elements per thread and tensor
    ]
    best = {}
    for n in CHUNKS:
        student, teacher, labels, inv = make_inputs(n)
        inputs = (student, teacher.bfloat16(), labels, inv)
        grad_bf16 = torch.empty_like(student, dtype=torch.bfloat16)
        moved = bytes_moved(labels, VOCAB, VOCAB, 0.5, grad_out=True, teacher_bytes=2)
        timings = {}
        for config in configs:
            run = partial(launch, inputs, beta=0.5, grad_out=grad_bf16, config=config)
            timings[config] = bench(run)
            report(f"BLOCK_V={config[0]} num_warps={config[1]}", n, timings[config], moved, VOCAB)
        best[n] = min(timings, key=timings.__getitem__)
    for n, (block_v, num_warps) in best.items():
        print(f"  best for n={n}: BLOCK_V={block_v} num_warps={num_warps}")
    return best


def variants_table(best: dict[int, tuple[int, int]]) -> None:
    header("variants: [best] tile of the sweep, [default] _chunk_triton._default_config")
    variants = [  # (name, beta, temperature, compute_hard, bf16 teacher and gradient)
        ("beta=0.5 tau=2 hard, fp32 in place", 0.5, 2.0, True, False),
        ("beta=0.5 tau=2 hard, bf16 t+grad", 0.5, 2.0, True, True),
        ("beta=0.5 tau=1 soft only, bf16 t+grad", 0.5, 1.0, False, True),
        ("beta=0 tau=2 hard, bf16 t+grad", 0.0, 2.0, True, True),
        ("beta=1 tau=2 hard, bf16 t+grad", 1.0, 2.0, True, True),
    ]
    for n in CHUNKS:
        student, teacher, labels, inv = make_inputs(n)
        teacher_bf16 = teacher.bfloat16()
        grad_bf16 = torch.empty(n, VOCAB, device="cuda", dtype=torch.bfloat16)
        for name, beta, temperature, hard, copy in variants:
            inputs = (student, teacher_bf16 if copy else teacher, labels, inv)
            for label, config in (("best", best[n]), ("default", None)):
                ms = bench(
                    partial(
                        launch,
                        inputs,
                        beta=beta,
                        temperature=temperature,
                        compute_hard=hard,
                        grad_out=grad_bf16 if copy else None,
                        config=config,
                    )
                )
                moved = bytes_moved(
                    labels, VOCAB, VOCAB, beta, grad_out=copy, teacher_bytes=2 if copy else 4
                )
                report(f"{name} [{label}]", n, ms, moved, VOCAB)
        assert torch.isfinite(student).all(), "repeated in-place calls must stay finite"


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    ok = check_correctness()
    best = sweep_tiles()
    variants_table(best)
    print("correctness:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
