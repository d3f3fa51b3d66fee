"""Per-rank time, memory and communication of the vocab-parallel fused-linear JSD, against the
unsharded kernel on one device.

    python benchmarks/bench_vocab_parallel.py --ranks 2                  # 2 GPUs (NCCL), S1
    python benchmarks/bench_vocab_parallel.py --ranks 1                  # one GPU: W=1
    python benchmarks/bench_vocab_parallel.py --ranks 2 --device cpu --shape quick-n64   # gloo

Every rank builds the full problem of ``bench_jsd.py`` from the same seed on its own device
(``cuda:k``, or the CPU) and keeps its ``torch.chunk`` slice of the two LM heads; rank 0 first
times the unsharded ``fused_linear_jsd`` alone (its portable path, and on CUDA its Triton
path) while the others wait. Then every rank times forward and backward of
``vocab_parallel_fused_linear_jsd`` together. The ranks meet through a file in a temporary
directory, so no port is involved.

Communicated bytes are counted, not modelled: one extra call runs with
``torch.distributed.all_reduce`` wrapped, summing the payload of every all-reduce the loss
makes. They are set beside the least a vocab-parallel loss must all-reduce: the input gradient
in the input dtype, ``N * Hs`` elements (each rank holds the product of its slice of the logit
gradient with its slice of the weight, and only the sum over the ranks is the gradient).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _bench_util import GIB, device_name, git_commit, markdown_table, measure
from bench_jsd import (
    CHUNK_SIZE,
    DTYPE,
    DTYPE_NAME,
    LOSS_KWARGS,
    QUICK_CHUNK_SIZE,
    SHAPES,
    Problem,
    _ours,
    forward_backward,
    make_problem,
)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "kernels"))
from gradref_kernels import vocab_parallel_fused_linear_jsd  # noqa: E402

SEED = 0


@dataclasses.dataclass(frozen=True)
class Row:
    """One implementation's measurement on one rank."""

    name: str
    rank: int
    median_ms: float
    min_ms: float
    peak_gib: float | None
    all_reduces: int | None = None
    all_reduced_bytes: int | None = None


def local_problem(full: Problem, rank: int, ranks: int) -> Problem:
    """This rank's problem: the full inputs and labels, its slice of the heads and biases."""

    def piece(tensor: torch.Tensor, grad: bool) -> torch.Tensor:
        return tensor.detach().chunk(ranks, dim=0)[rank].clone().requires_grad_(grad)

    student_bias, teacher_bias = full.student_bias, full.teacher_bias
    return dataclasses.replace(
        full,
        student_weight=piece(full.student_weight, True),
        teacher_weight=piece(full.teacher_weight, False),
        student_bias=None if student_bias is None else piece(student_bias, True),
        teacher_bias=None if teacher_bias is None else piece(teacher_bias, False),
    )


def count_all_reduces(step: Any) -> tuple[int, int]:
    """How many all-reduces one call of ``step`` makes, and their payload in bytes."""
    counted: list[int] = []
    original = dist.all_reduce

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counted.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        step()
    finally:
        dist.all_reduce = original
    return len(counted), sum(counted)


def timed(name: str, step: Any, problem: Problem, rank: int, args: argparse.Namespace) -> Row:
    device = problem.student_input.device
    measured = measure(step, problem.drop_grads, device, args.warmup, args.iters)
    peak = measured.peak_extra_bytes
    return Row(
        name, rank, measured.median_ms, measured.min_ms, None if peak is None else peak / GIB
    )


def run_rank(rank: int, ranks: int, store_path: str, args: argparse.Namespace) -> None:
    on_cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    store = dist.FileStore(store_path, ranks)
    dist.init_process_group(
        "nccl" if on_cuda else "gloo",
        store=store,
        rank=rank,
        world_size=ranks,
        device_id=device if on_cuda else None,  # binds NCCL to this rank's GPU from the start
    )
    try:
        shape = SHAPES[args.shape]
        chunk_size = QUICK_CHUNK_SIZE if shape.family == "quick" else CHUNK_SIZE
        full = make_problem(shape, device, bias=False, seed=SEED)
        rows: list[Row] = []
        if rank == 0:
            for path in ("torch", "triton") if on_cuda else ("torch",):
                unsharded = forward_backward(_ours(path, chunk_size, LOSS_KWARGS), full)
                rows.append(timed(f"unsharded {path}", unsharded, full, rank, args))
        mine = local_problem(full, rank, ranks)
        del full  # each rank keeps only its slice of the heads
        if on_cuda:
            torch.cuda.empty_cache()
        dist.barrier()
        kwargs = {**LOSS_KWARGS, "chunk_size": chunk_size}
        sharded = forward_backward(
            lambda p: vocab_parallel_fused_linear_jsd(*p.args(), **kwargs), mine
        )
        row = timed(f"vocab-parallel W={ranks}", sharded, mine, rank, args)
        mine.drop_grads()
        count, payload = count_all_reduces(sharded)
        rows.append(dataclasses.replace(row, all_reduces=count, all_reduced_bytes=payload))
        gathered: list[list[Row] | None] = [None] * ranks
        dist.all_gather_object(gathered, rows)
        if rank == 0:
            report(
                shape, ranks, device, [r for rank_rows in gathered for r in rank_rows or []], args
            )
        dist.barrier()  # no rank leaves the group while rank 0 still reports
    finally:
        dist.destroy_process_group()


def report(
    shape: Any, ranks: int, device: torch.device, rows: list[Row], args: argparse.Namespace
) -> None:
    minimum = shape.n * shape.hs * DTYPE.itemsize
    lines = [
        f"# python benchmarks/bench_vocab_parallel.py --ranks {ranks} --device {args.device} "
        f"--shape {args.shape} --warmup {args.warmup} --iters {args.iters}",
        f"# {device_name(device)}; torch {torch.__version__}; commit {git_commit(REPO)}",
        f"# {shape.name}: N={shape.n} Hs={shape.hs} Ht={shape.ht} V={shape.v}, {DTYPE_NAME}, "
        "no bias; "
        f"forward + backward per call, median and least of {args.iters} timed calls",
        "",
        markdown_table(
            [
                "implementation",
                "rank",
                "median ms",
                "least ms",
                "peak GiB",
                "all-reduces",
                "all-reduced bytes",
            ],
            [
                [
                    r.name,
                    str(r.rank),
                    f"{r.median_ms:.2f}",
                    f"{r.min_ms:.2f}",
                    "-" if r.peak_gib is None else f"{r.peak_gib:.2f}",
                    "-" if r.all_reduces is None else str(r.all_reduces),
                    "-" if r.all_reduced_bytes is None else f"{r.all_reduced_bytes:,}",
                ]
                for r in rows
            ],
        ),
        "",
        f"least a vocab-parallel loss must all-reduce: the {DTYPE_NAME} input gradient, "
        f"N * Hs * {DTYPE.itemsize} = {minimum:,} bytes",
    ]
    sharded = [r for r in rows if r.all_reduced_bytes is not None]
    if sharded:
        payload = max(r.all_reduced_bytes or 0 for r in sharded)
        lines.append(
            f"all-reduced per rank per call: {payload:,} bytes, {payload / minimum:.2f}x that"
        )
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks (default 2)")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda: rank k on cuda:k over NCCL; cpu: every rank on the CPU over gloo",
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="s1-n4096")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    if args.ranks < 1:
        parser.error(f"--ranks must be at least 1, got {args.ranks}")
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        parser.error(
            f"--ranks {args.ranks} needs {args.ranks} CUDA devices, {torch.cuda.device_count()} "
            "visible: ask for fewer ranks, or --device cpu"
        )
    return args


def rank_process(rank: int, ranks: int, store_path: str, args: argparse.Namespace) -> None:
    """One rank's process: its measurements, then an exit that skips the interpreter's
    teardown. In CI, under load, a rank once aborted in that teardown after every figure was
    printed ("terminate called without an active exception": a c10d thread destroyed while
    running), which failed the run; six quiet runs here did not show it again."""
    run_rank(rank, ranks, store_path, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as folder:
        store_path = str(Path(folder) / "rendezvous")
        mp.spawn(rank_process, args=(args.ranks, store_path, args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
