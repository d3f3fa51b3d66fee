"""The host CPU's matrix-product throughput by dtype and operand layout: why the bf16 tests
dominate the test suite's time on a CPU without native bfloat16 arithmetic.

    python benchmarks/bench_cpu_gemm.py            # 1 thread and all cores
    python benchmarks/bench_cpu_gemm.py --threads 1

A product of the kernel suite's large case (1024 rows, hidden 1024, vocabulary 4096) in the
three layouts a linear layer's forward and backward take: x @ w.T (forward), g.T @ x (the
weight's gradient) and g @ w (the input's gradient), each in float32, float64 and bfloat16,
timed once after one warm-up call. Prints GFLOP/s.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

ROWS, HIDDEN, VOCAB = 1024, 1024, 4096


def gflops(a: torch.Tensor, b: torch.Tensor, flops: float) -> float:
    """a @ b's throughput, timed once after a warm-up call."""
    torch.mm(a, b)
    start = time.perf_counter()
    torch.mm(a, b)
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
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            x = torch.randn(ROWS, HIDDEN, dtype=dtype)
            w = torch.randn(VOCAB, HIDDEN, dtype=dtype)
            g = torch.randn(ROWS, VOCAB, dtype=dtype)
            cells = [
                gflops(x, w.T, flops),
                gflops(g.T, x, flops),
                gflops(g, w, flops),
            ]
            print(f"| {threads} | {dtype} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
