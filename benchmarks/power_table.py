"""The default verdict's power table: false alarms on correct kernels, and the smallest scale
error and bias it catches, per dtype, loss, size and thread count.

Each cell is a loss of logits ``z = x @ w.T`` (log-softmax squared, tanh squared, cross-entropy,
and a sum that cancels: ``z.sum()`` with the rows of ``w`` centred, so the value and the input
gradient are sums of large terms near zero) at a size (the weight gradient's elements, 10^2 to
10^6), in a dtype, at a thread count. Per seed, one reference (the fixture's computation under
the default verdict: a float64 golden, a budget of 2) and two correct kernels:

- ``chunked``: the fused-linear pattern, rows in four chunks, the logits and their gradient in
  the dtype as the reference computes them, the weight gradient accumulated over chunks in
  float32 and rounded once: the same precision as the reference, another summation order;
- ``upcast``: the reference computed in the next finer dtype (float32 for half precision,
  float64 for float32), each result rounded once: more accurate than the reference.

The false-red rate counts both kernels' failures over ``--seeds`` seeds (target 0). Then the
chunked kernel's weight gradient is multiplied by ``1 + s`` (a scale error) or shifted by
``s`` times its mean magnitude (a bias), for ``s`` on a ladder, on ``--power-seeds`` seeds: the
smallest ``s`` that fails on every one of them is the cell's power (targets: <= 1% in half
precision, <= 1e-4 in float32); "-" where no rung fails on every seed.

    python benchmarks/power_table.py --jobs 15 --threads 1 2 --out power_table.txt
      (its last table: benchmarks/results/h200/power_table_host_cpu.txt, the H200 machine's CPU)
    python benchmarks/power_table.py --quick        # a small grid, a few seeds, printed
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as F
from _bench_util import git_commit

from pytest_gradref import Reference, compute_reference
from pytest_gradref.config.tolerances import DEFAULT_BUDGET, CheckPolicy

REPO = Path(__file__).resolve().parent.parent
Tensor = torch.Tensor
Head = Callable[[Tensor, Tensor], Tensor]  # (logits, labels) -> loss


def _cross_entropy(z: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(z, labels, reduction="sum")


HEADS: dict[str, Head] = {
    "log_softmax": lambda z, labels: torch.log_softmax(z, dim=-1).square().sum(),
    "tanh": lambda z, labels: torch.tanh(z).square().sum(),
    "cross_entropy": _cross_entropy,
    "cancelling_sum": lambda z, labels: z.sum(),
}
# (rows N, hidden H, vocabulary V): the weight gradient has V * H elements.
SIZES: dict[int, tuple[int, int, int]] = {
    100: (8, 10, 10),
    10_000: (32, 50, 200),
    1_000_000: (16, 500, 2000),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LADDERS = {
    "float32": (1e-7, 1e-6, 1e-5, 1e-4, 1e-3),
    "bfloat16": (1e-3, 3e-3, 1e-2, 3e-2, 1e-1),
    "float16": (1e-4, 3e-4, 1e-3, 3e-3, 1e-2),
}
FINER = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float64}
CHUNKS = 4


def inputs(seed: int, dtype: torch.dtype, size: int, head: str) -> tuple[Tensor, Tensor, Tensor]:
    rows, hidden, vocab = SIZES[size]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) / hidden**0.5
    if head == "cancelling_sum":
        w = w - w.mean(0)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    return x.to(dtype), w.to(dtype), labels


def reference(head: Head, x: Tensor, w: Tensor, labels: Tensor) -> Reference:
    """What grad_reference gives under the default verdict (autograd on the CPU)."""
    policy = CheckPolicy(backend="cpu", default_golden=torch.float64, default_budget=DEFAULT_BUDGET)

    def loss(x: Tensor, w: Tensor, labels: Tensor) -> Tensor:
        return head(x @ w.T, labels)

    return compute_reference(
        loss,
        (x, w, labels),
        {},
        argnums=(0, 1),
        has_aux=False,
        strategy="autograd",
        default_strategy="autograd",
        policy=policy,
    )


def chunked(head: Head, x: Tensor, w: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Value and gradients by the fused-linear pattern (see the module's docstring); the
    weight gradient comes back in float32, before its rounding."""
    value = torch.zeros((), dtype=torch.float32)
    grad_w = torch.zeros(w.shape, dtype=torch.float32)
    grad_x = []
    for rows, row_labels in zip(x.chunk(CHUNKS), labels.chunk(CHUNKS)):
        logits = (rows @ w.T).detach().requires_grad_()
        loss = head(logits, row_labels)
        (grad_logits,) = torch.autograd.grad(loss, logits)
        value += loss.detach().float()
        grad_w += grad_logits.float().T @ rows.float()
        grad_x.append((grad_logits.float() @ w.float()).to(x.dtype))
    return value.to(x.dtype), torch.cat(grad_x), grad_w


def upcast(head: Head, x: Tensor, w: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    finer = FINER[x.dtype]
    xf, wf = x.to(finer).requires_grad_(), w.to(finer).requires_grad_()
    value = head(xf @ wf.T, labels)
    grad_x, grad_w = torch.autograd.grad(value, (xf, wf))
    return value.detach().to(x.dtype), grad_x.to(x.dtype), grad_w.to(x.dtype)


def passes(ref: Reference, value: Tensor, grad_x: Tensor, grad_w: Tensor) -> bool:
    try:
        ref.assert_close(value, (grad_x, grad_w))
    except AssertionError:
        return False
    return True


@dataclass
class Cell:
    dtype: str
    head: str
    size: int
    threads: int
    false_red: int = 0
    runs: int = 0
    spread_consulted: int = 0
    smallest_scale: float = math.nan
    smallest_bias: float = math.nan
    seconds: float = 0.0


def smallest_caught(ladder: Sequence[float], caught: Callable[[float], bool]) -> float:
    for rung in ladder:
        if caught(rung):
            return rung
    return math.nan


def run_cell(cell: Cell, seeds: int, power_seeds: int) -> Cell:
    torch.set_num_threads(cell.threads)
    start = time.perf_counter()
    dtype, head = DTYPES[cell.dtype], HEADS[cell.head]
    cases = []
    for seed in range(seeds):
        x, w, labels = inputs(seed, dtype, cell.size, cell.head)
        ref = reference(head, x, w, labels)
        value, grad_x, grad_w = chunked(head, x, w, labels)
        for kernel in ((value, grad_x, grad_w.to(dtype)), upcast(head, x, w, labels)):
            cell.runs += 1
            cell.false_red += not passes(ref, *kernel)
        assert ref.golden is not None
        assert ref.golden.spread is not None
        cell.spread_consulted += bool(ref.golden.spread.ran)
        if seed < power_seeds:
            cases.append((ref, value, grad_x, grad_w))

    def caught(kind: str) -> Callable[[float], bool]:
        def every_seed(rung: float) -> bool:
            for ref, value, grad_x, grad_w in cases:
                if kind == "scale":
                    wrong = grad_w * (1 + rung)
                else:
                    wrong = grad_w + rung * grad_w.abs().mean()
                if passes(ref, value, grad_x, wrong.to(dtype)):
                    return False
            return True

        return every_seed

    cell.smallest_scale = smallest_caught(LADDERS[cell.dtype], caught("scale"))
    cell.smallest_bias = smallest_caught(LADDERS[cell.dtype], caught("bias"))
    cell.seconds = time.perf_counter() - start
    return cell


def level(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:g}"


def table(cells: Sequence[Cell], seeds: int, power_seeds: int) -> str:
    lines = [
        f"# power_table.py at {git_commit(REPO)}, torch {torch.__version__}, host threads "
        f"{os.cpu_count()}; {seeds} seeds x 2 correct kernels per cell for the false reds, "
        f"{power_seeds} seeds for the power (the smallest rung caught on every seed)",
        "",
        "| dtype | loss | elements | threads | false red | runs that needed the spread | "
        "smallest scale caught | smallest bias caught | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c.dtype} | {c.head} | {c.size:.0e} | {c.threads} | {c.false_red} of {c.runs} "
            f"| {c.spread_consulted} of {seeds} | {level(c.smallest_scale)} | "
            f"{level(c.smallest_bias)} | {c.seconds:.1f} |"
        )
    red = sum(c.false_red for c in cells)
    runs = sum(c.runs for c in cells)
    lines += ["", f"false reds: {red} of {runs} correct runs"]
    for name, target in (("bfloat16", 1e-2), ("float16", 1e-2), ("float32", 1e-4)):
        missed = [
            c
            for c in cells
            if c.dtype == name and not (c.smallest_scale <= target and c.smallest_bias <= target)
        ]
        lines.append(
            f"{name}: {len(missed)} cells where a scale or bias of {target:g} is not caught on "
            "every seed" + "".join(f"\n  {c.head} {c.size:.0e} threads={c.threads}" for c in missed)
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--power-seeds", type=int, default=5)
    host = os.cpu_count() or 1
    parser.add_argument("--threads", type=int, nargs="+", default=sorted({1, 2, host}))
    parser.add_argument("--quick", action="store_true", help="10^2 and 10^4 only, 4 seeds")
    parser.add_argument("--jobs", type=int, default=1, help="cells run in this many processes")
    parser.add_argument("--out", type=Path, help="write the table here too")
    args = parser.parse_args()
    sizes = [100, 10_000] if args.quick else list(SIZES)
    seeds, power_seeds = (4, 2) if args.quick else (args.seeds, args.power_seeds)
    grid = [
        Cell(name, head, size, threads)
        for name in DTYPES
        for head in HEADS
        for size in sizes
        for threads in args.threads
    ]
    run = partial(run_cell, seeds=seeds, power_seeds=power_seeds)
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        cells = []
        for cell in pool.map(run, grid):
            print(
                f"{cell.dtype} {cell.head} {cell.size:.0e} t={cell.threads}: false red "
                f"{cell.false_red}/{cell.runs}, scale {level(cell.smallest_scale)}, bias "
                f"{level(cell.smallest_bias)} ({cell.seconds:.1f} s)",
                file=sys.stderr,
                flush=True,
            )
            cells.append(cell)
    text = table(cells, seeds, power_seeds)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0 if sum(c.false_red for c in cells) == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
