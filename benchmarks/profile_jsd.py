"""Where the time of one forward + backward of the fused-linear JSD loss goes.

    python benchmarks/profile_jsd.py                        # S1 at N = 8192, on CUDA
    python benchmarks/profile_jsd.py --shape quick-n256     # any device (a smoke test on CPU)

For each of our paths: the median time of a step after warm-ups, then torch.profiler over two
steps: the device time of each kernel, largest first, and how busy the device was (kernel time
over the span from the first kernel's start to the last one's end: the rest is idle time, such
as waits for the host). Shapes, inputs and loss options are those of bench_jsd.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_util import Step, synchronize
from bench_jsd import CHUNK_SIZE, SHAPES, Problem, all_impls, forward_backward, make_problem

OURS = ["ours-torch", "ours-triton"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="s1-n8192", choices=sorted(SHAPES))
    parser.add_argument("--chunk-size", type=int, default=CHUNK_SIZE)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5, help="timed steps (median)")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per path")
    parser.add_argument("--impls", nargs="+", default=OURS, choices=OURS)
    return parser.parse_args(argv)


def busy_fraction(prof: profile) -> tuple[float, float]:
    """(kernel time, span) in ms over the profiled CUDA kernels."""
    kernels = [event for event in prof.events() if event.device_type == DeviceType.CUDA]
    if not kernels:
        return 0.0, 0.0
    busy = sum(event.time_range.elapsed_us() for event in kernels)
    start = min(event.time_range.start for event in kernels)
    end = max(event.time_range.end for event in kernels)
    return busy / 1e3, (end - start) / 1e3


def profile_path(
    step: Step, problem: Problem, device: torch.device, args: argparse.Namespace
) -> None:
    """Times ``step`` and prints its profile."""

    def run() -> None:
        problem.drop_grads()
        step()

    for _ in range(args.warmup):
        run()
    times = []
    for _ in range(args.iters):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    print(f"{statistics.median(times):.2f} ms per step (median of {args.iters})")

    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        run()
        run()
        synchronize(device)
    sort_by = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_by, row_limit=args.top))
    if on_cuda:
        busy, span = busy_fraction(prof)
        print(f"2 profiled steps: kernels busy {busy:.2f} ms of a {span:.2f} ms span")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SHAPES[args.shape]
    problem = make_problem(shape, device, bias=False, seed=0)
    print(f"{shape.name}: N={shape.n} Hs={shape.hs} Ht={shape.ht} V={shape.v} on {device}")
    for impl in all_impls(device, args.chunk_size):
        if impl.name not in args.impls:
            continue
        print(f"== {impl.name}: ", end="")
        if impl.loss_fn is None:
            print(f"skipped, {impl.unavailable}")
            continue
        profile_path(forward_backward(impl.loss_fn, problem), problem, device, args)


if __name__ == "__main__":
    main()
