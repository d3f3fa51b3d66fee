"""The host CPU's matrix-product throughput by dtype and operand layout: why the bf16 tests
dominate the test suite's time on a CPU without native bfloat16 arithmetic.

    python benchmarks/bench_cpu_gemm.py            # 1 thread and all cores
    python benchmarks/bench_cpu_gemm.py --threads 1

A product of the kernel suite's large case (1024 rows, hidden 1024, vocabulary 4096) in the
three layouts a linear layer's forward and backward take: x @ w.T (forward), g.T @ x (the
weight's gradient) and g @ w (the input's gradient), each in float32, float64, bfloat16 and
float16, and the half-precision ones again as the fused loss multiplies them where torch's own
are a scalar loop (gradref_kernels._matmuls.products_via_float32): on float32 copies, the
product rounded once, the copies and the rounding timed with it. Each is timed once after one
warm-up call. Prints GFLOP/s.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

ROWS, HIDDEN, VOCAB = 1024, 1024, 4096
# (dtype, multiplied on float32 copies): each row of the table.
ROWS_OF_TABLE = [
    (torch.float32, False),
    (torch.float64, False),
    (torch.bfloat16, False),
    (torch.float16, False),
    (torch.bfloat16, True),
    (torch.float16, True),
]


def gflops(a: torch.Tensor, b: torch.Tensor, flops: float, via_float32: bool) -> float:
    """a @ b's throughput (of float32 copies, rounded to a's dtype, with ``via_float32``),
    timed once after a warm-up call."""

    def product() -> torch.Tensor:
        if via_float32:
            return torch.mm(a.float(), b.float()).to(a.dtype)
        return torch.mm(a, b)

    product()
    start = time.perf_counter()
    product()
    return flops / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    args = parser.parse_args()
    print(
        f"# python benchmarks/bench_cpu_gemm.py --threads {' '.join(map(str, args.threads))} "
        f"({platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()})"
    )
    flops = 2.0 * ROWS * HIDDEN * VOCAB
    print("| threads | dtype | x @ w.T (forward) | g.T @ x (weight grad) | g @ w (input grad) |")
    print("|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype, via_float32 in ROWS_OF_TABLE:
            x = torch.randn(ROWS, HIDDEN, dtype=dtype)
            w = torch.randn(VOCAB, HIDDEN, dtype=dtype)
            g = torch.randn(ROWS, VOCAB, dtype=dtype)
            cells = [
                gflops(x, w.T, flops, via_float32),
                gflops(g.T, x, flops, via_float32),
                gflops(g, w, flops, via_float32),
            ]
            name = f"{dtype} via float32" if via_float32 else str(dtype)
            print(f"| {threads} | {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
