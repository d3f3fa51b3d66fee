"""What one randomly rounded run of the reference costs, and the distribution of its errors.

The rounding spread (pytest_gradref/reference/spread.py) runs the reference ``RUNS`` times
under ``RandomRounding`` where an item fails its budget. For a few references this prints the
time of one run and, over ``--runs`` seeds, the mean and standard deviation of each run's
error against the float64 golden: the value's, and each gradient's greatest and normwise. Two
trees compared on the same host (``PYTHONPATH=<other tree> python benchmarks/...``) should
show the same distributions, since the verdict's allowance is read from them.

    python benchmarks/bench_rounding_spread.py --runs 200
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from functools import partial
from typing import Any, Callable

import torch
from _bench_util import synchronize

from pytest_gradref.config.tolerances import CheckPolicy
from pytest_gradref.reference.computation import compute_reference
from pytest_gradref.reference.spread import RandomRounding


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def logits_loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The logsumexp of centred logits, as test_verdict_noise.py's summation-order cases."""
    return torch.logsumexp(_wide(x @ w.T), dim=-1).mean()


def kl(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student), as test_rounded_reference.py's rounded-reference cases."""
    student = torch.log_softmax(_wide(x) @ _wide(w).T, -1)
    teacher = torch.log_softmax(_wide(t), -1)
    return (teacher.exp() * (teacher - student)).sum(-1).mean()


def _logits_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(512, 64, generator=gen)
    w = torch.randn(2048, 64, generator=gen)
    return x.to(dtype), (w - w.mean(0)).to(dtype)


def _kl_inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=gen)
    w = torch.randn(200, 96, generator=gen) / 4
    teacher = x @ w.T + 0.1 * torch.randn(64, 200, generator=gen)
    return x.bfloat16(), w.bfloat16(), teacher.bfloat16()


# name -> (reference, inputs, rounded)
CASES: dict[str, tuple[Callable[..., torch.Tensor], Callable[[], tuple[Any, ...]], bool]] = {
    "logits bf16 512x64 @ 2048x64": (logits_loss, partial(_logits_inputs, torch.bfloat16), False),
    "logits fp32 512x64 @ 2048x64": (logits_loss, partial(_logits_inputs, torch.float32), False),
    "kl bf16 64x96 @ 200x96": (kl, _kl_inputs, False),
    "kl bf16 64x96 @ 200x96, rounded": (kl, _kl_inputs, True),
}


def _spread_of(
    fn: Callable[..., torch.Tensor], args: tuple[Any, ...], rounded: bool, device: torch.device
) -> Any:
    policy = CheckPolicy(backend=device.type, default_golden=torch.float64, default_budget=2)
    reference = compute_reference(
        fn,
        args,
        {},
        argnums=(0, 1),
        has_aux=False,
        strategy="autograd",
        default_strategy="autograd",
        policy=policy,
        golden=torch.float64,
        rounded=rounded,
    )
    assert reference.golden is not None
    assert reference.golden.spread is not None
    return reference.golden, reference.golden.spread


def _summary(values: list[float]) -> str:
    return f"{statistics.fmean(values):.4g} +- {statistics.stdev(values):.2g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=48, help="seeds per case (default 48)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--device", default="cpu", help="where the runs compute (default cpu)")
    options = parser.parse_args()
    torch.set_num_threads(options.threads)
    device = torch.device(options.device)
    print(
        f"# {options.runs} randomly rounded runs a case on {device}, torch {torch.__version__}, "
        f"{options.threads} thread(s); errors against the float64 golden, mean +- sd over runs"
    )
    print(
        "| case | ms a run | value rms | grad 0 greatest | grad 0 normwise "
        "| grad 1 greatest | grad 1 normwise |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (fn, inputs, rounded) in CASES.items():
        args = tuple(t.to(device) for t in inputs())
        golden, spread = _spread_of(fn, args, rounded, device)
        errors: dict[str, list[float]] = {
            "value": [],
            "g0max": [],
            "g0norm": [],
            "g1max": [],
            "g1norm": [],
        }
        spread.strategy(replace(spread.problem, mode=partial(RandomRounding, -1)))  # warm-up
        synchronize(device)
        start = time.perf_counter()
        for seed in range(options.runs):
            mode = partial(RandomRounding, seed, spread.rounded_to)
            run = spread.strategy(replace(spread.problem, mode=mode))
            errors["value"].append(float(run.value.double() - golden.value.double()))
            for index in (0, 1):
                error = run.arg_grads[index].double() - golden.arg_grads[index].double()
                errors[f"g{index}max"].append(float(error.abs().max()))
                errors[f"g{index}norm"].append(float(error.norm()))
        synchronize(device)
        milliseconds = (time.perf_counter() - start) / options.runs * 1e3
        value_rms = statistics.fmean(e * e for e in errors["value"]) ** 0.5
        cells = [_summary(errors[key]) for key in ("g0max", "g0norm", "g1max", "g1norm")]
        print(f"| {name} | {milliseconds:.1f} | {value_rms:.4g} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
