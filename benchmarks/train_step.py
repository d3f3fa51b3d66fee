"""A compiled distillation training step with the fused JSD loss at the end, timed against the
same step with Liger-Kernel's loss.

The student is small: a token embedding, a few MLP blocks (RMSNorm, Hs -> 4 Hs, GELU, back,
residual), a final RMSNorm and an LM head of the full vocabulary, all bf16; the teacher's
hidden states and LM head are given (offline distillation). One step: forward, the loss,
backward, a fused AdamW step. Variants:

- ``ours``: the whole step's forward and loss in one ``torch.compile(fullgraph=True)``;
- ``ours-outside``: the model compiled, the loss called after it, uncompiled;
- ``liger``: Liger-Kernel's ``LigerFusedLinearJSDLoss`` (``compiled=True``) inside the same
  compiled function (default mode: graph breaks allowed);
- ``liger-outside``: the model compiled, Liger's loss after it with its own compiled chunk step.

    python benchmarks/train_step.py                  # S1 sizes: N 8192, Hs 2048, Ht 4096, V 128256
    python benchmarks/train_step.py --quick          # small sizes on any device
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _bench_util import GIB, device_name, environment, markdown_table, measure
from torch import Tensor, nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "kernels"))
from gradref_kernels import FusedLinearJSDLoss  # noqa: E402

DTYPE = torch.bfloat16
IGNORE_EVERY = 7  # every 7th label is ignore_index, as in bench_jsd.py
LOSS_KWARGS: dict[str, Any] = {
    "weight_hard_loss": 0.5,
    "weight_soft_loss": 0.5,
    "beta": 0.5,
    "ignore_index": -100,
    "temperature": 1.0,
}
CHUNK_SIZE = 1024
VARIANTS = ["ours", "ours-outside", "liger", "liger-outside"]


@dataclass(frozen=True)
class Sizes:
    rows: int
    student_hidden: int
    teacher_hidden: int
    vocab: int
    layers: int


FULL = Sizes(rows=8192, student_hidden=2048, teacher_hidden=4096, vocab=128256, layers=2)
QUICK = Sizes(rows=256, student_hidden=64, teacher_hidden=128, vocab=2048, layers=2)


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Student(nn.Module):
    """Hidden states from token ids; the loss module gets them with the LM head's weight."""

    def __init__(self, sizes: Sizes, loss: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Embedding(sizes.vocab, sizes.student_hidden)
        self.blocks = nn.Sequential(*(Block(sizes.student_hidden) for _ in range(sizes.layers)))
        self.norm = nn.RMSNorm(sizes.student_hidden)
        self.lm_head = nn.Linear(sizes.student_hidden, sizes.vocab, bias=False)
        self.loss = loss

    def hidden(self, tokens: Tensor) -> Tensor:
        return self.norm(self.blocks(self.embed(tokens)))

    def forward(
        self, tokens: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor, labels: Tensor
    ) -> Tensor:
        loss: Tensor = self.loss(
            self.hidden(tokens), self.lm_head.weight, teacher_hidden, teacher_weight, labels
        )
        return loss


@dataclass(frozen=True)
class Batch:
    tokens: Tensor
    teacher_hidden: Tensor
    teacher_weight: Tensor
    labels: Tensor


def make_batch(sizes: Sizes, device: torch.device) -> Batch:
    gen = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, sizes.vocab, (sizes.rows,), generator=gen, device=device)
    labels = torch.randint(0, sizes.vocab, (sizes.rows,), generator=gen, device=device)
    labels[::IGNORE_EVERY] = LOSS_KWARGS["ignore_index"]
    std = 2.0 / math.sqrt(sizes.teacher_hidden)
    shape = (sizes.vocab, sizes.teacher_hidden)
    return Batch(
        tokens=tokens,
        teacher_hidden=torch.randn(
            sizes.rows, sizes.teacher_hidden, generator=gen, device=device, dtype=DTYPE
        ),
        teacher_weight=torch.randn(shape, generator=gen, device=device, dtype=DTYPE) * std,
        labels=labels,
    )


def loss_module(variant: str) -> nn.Module:
    if variant.startswith("ours"):
        return FusedLinearJSDLoss(**LOSS_KWARGS, chunk_size=CHUNK_SIZE)
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    return LigerFusedLinearJSDLoss(**LOSS_KWARGS, compiled=True, chunk_size=CHUNK_SIZE)


def make_step(
    variant: str, sizes: Sizes, batch: Batch, device: torch.device
) -> Callable[[], Tensor]:
    """One training step of a fresh student (same initial weights for every variant)."""
    torch.manual_seed(0)
    model = Student(sizes, loss_module(variant)).to(device=device, dtype=DTYPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    args = (batch.tokens, batch.teacher_hidden, batch.teacher_weight, batch.labels)
    if variant.endswith("-outside"):
        hidden = torch.compile(model.hidden)

        def loss_fn() -> Tensor:
            out: Tensor = model.loss(hidden(batch.tokens), model.lm_head.weight, *args[1:])
            return out
    else:
        compiled = torch.compile(model, fullgraph=variant == "ours")

        def loss_fn() -> Tensor:
            out: Tensor = compiled(*args)
            return out

    def step() -> Tensor:
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


@dataclass
class Row:
    variant: str
    status: str
    time_ms: float | None = None
    first_call_s: float | None = None
    peak_extra_gib: float | None = None
    loss: float | None = None
    reason: str = ""


def run(variant: str, sizes: Sizes, device: torch.device, warmup: int, iters: int) -> Row:
    try:
        batch = make_batch(sizes, device)
        step = make_step(variant, sizes, batch, device)
        result = measure(step, lambda: None, device, warmup, iters)
    except Exception as exc:  # one broken variant must not end the run
        traceback.print_exc()
        return Row(variant, "error", reason=f"{type(exc).__name__}: {exc}".splitlines()[0])
    finally:
        torch._dynamo.reset()
    peak = None if result.peak_extra_bytes is None else result.peak_extra_bytes / GIB
    loss = None if result.last_output is None else float(result.last_output)
    return Row(variant, "ok", result.median_ms, result.first_call_s, peak, loss)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, any device")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    parser.add_argument("--iters", type=int, default=10, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 1)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    device = torch.device(args.device)
    started = time.perf_counter()
    rows = []
    for variant in args.variants:
        rows.append(run(variant, sizes, device, args.warmup, args.iters))
        print(f"  {variant:<14} {rows[-1].status} {rows[-1].time_ms} ms", flush=True)
    env = environment(device, REPO, ["triton", "liger-kernel"])
    print(f"\n## Training step on {device_name(device)}: {sizes}")
    print(f"torch {env['torch']}, triton {env['triton']}, liger-kernel {env['liger-kernel']}, ")
    print(f"commit {env['commit']}; median of {args.iters} steps after {args.warmup} warm-ups\n")

    def fmt(value: float | None, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}g}"

    ours = next((r.time_ms for r in rows if r.variant == "ours" and r.time_ms), None)
    table = [
        (
            r.variant,
            r.status,
            fmt(r.time_ms),
            fmt(r.time_ms / ours if ours and r.time_ms else None),
            fmt(r.first_call_s),
            fmt(r.peak_extra_gib),
            fmt(r.loss, 6),
            r.reason,
        )
        for r in rows
    ]
    headers = [
        "variant",
        "status",
        "step ms",
        "x ours",
        "1st step s",
        "peak extra GiB",
        "loss",
        "note",
    ]
    print(markdown_table(headers, table))
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
