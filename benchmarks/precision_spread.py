"""How far the kernel suite's errors move between CPU code paths, against the CI baseline.

Runs ``pytest tests/kernels tests/adopters`` on the CPU once per variant (oneDNN's ISA cap,
ATen's CPU capability, thread count, serial or under xdist), writes each run's precision report into
``--out``, and compares each with the committed baseline as the CI gate does. For every variant
it prints the greatest growth of any item's error (the raw ratio, and the ratio the gate judges
after the noise floor, greatest or normwise), the error in rounding steps of the item's dtype at
its scale, and the gate's verdict: the figures behind the gate's threshold and noise floor
(README, "Precision across CPU hosts").

    python benchmarks/precision_spread.py --out /tmp/spread            # every variant
    python benchmarks/precision_spread.py --out /tmp/spread --variants avx2 one-thread
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytest_gradref.config.thresholds import DEFAULT_THRESHOLD
from pytest_gradref.report.diff import (
    DEFAULT_NOISE,
    Diff,
    ItemDiff,
    compare_reports,
    load_report,
)

BASELINE = Path("tests/kernels/precision-baseline-cpu.json")

# ATEN_CPU_CAPABILITY moves ATen's kernels to another ISA but leaves Inductor's code generation
# out of step with them: on an AVX-512 host, torch 2.13 then miscompiles plain PyTorch (the bias
# gradient of an nn.Linear in a compiled module), which no real CPU of that ISA would see. The
# compiled tests are left out of those variants.
_EAGER_ONLY = ["--ignore=tests/kernels/test_compile.py"]

# name -> (environment, extra pytest arguments); the baseline itself is written under xdist
# with two workers (scripts/refresh_precision_baseline.sh).
VARIANTS: dict[str, tuple[dict[str, str], list[str]]] = {
    "as-baseline": ({}, ["-n", "2"]),
    "serial": ({}, []),
    "one-thread": ({"OMP_NUM_THREADS": "1"}, ["-n", "2"]),
    "onednn-avx512-bf16": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, ["-n", "2"]),
    "onednn-avx512": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, ["-n", "2"]),
    "onednn-avx2": ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, ["-n", "2"]),
    "aten-avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, ["-n", "2", *_EAGER_ONLY]),
    "aten-default": ({"ATEN_CPU_CAPABILITY": "default"}, ["-n", "2", *_EAGER_ONLY]),
}


def run_variant(name: str, out: Path) -> Path:
    environment, arguments = VARIANTS[name]
    report = out / f"{name}.json"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "tests/kernels",
        "tests/adopters",
        "-q",
        "-rf",
        "-p",
        "no:cacheprovider",
        "--gradref-device=cpu",
        f"--gradref-report={report}",
        *arguments,
    ]
    print(f"{name}: {' '.join(f'{k}={v}' for k, v in environment.items())} {' '.join(command)}")
    done = subprocess.run(
        command, env={**os.environ, **environment}, capture_output=True, text=True
    )
    # A failing test is a finding of the variant, shown in the table; no report is a crash.
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED ")]
    for line in failed:
        print(f"  {name}: {line}")
    if not report.exists():
        raise SystemExit(f"{name}: pytest wrote no report (exit {done.returncode}):\n{done.stdout}")
    return report


def raw_growth(diff: Diff, item: ItemDiff) -> float:
    """The error's growth with the absolute floor alone (no noise floor)."""
    return max(item.after, diff.floor) / max(item.before, diff.floor)


def describe_worst(diff: Diff, growth: Callable[[ItemDiff], Any]) -> str:
    """The item that grew most by ``growth`` (its first number is the growth shown), with its
    noise floor (four rounding steps of its dtype at its scale, or its reference's own error
    where larger)."""
    top = max((i for i in diff.items if not math.isnan(i.ratio)), key=growth)
    shown = growth(top)
    shown = shown[0] if isinstance(shown, tuple) else shown
    which = ", normwise" if top.normwise else ""
    return (
        f"{shown:.3g}x ({top.dtype}{which}, {top.before:.3g} -> {top.after:.3g}, "
        f"noise floor {top.noise_floor:.2g})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the reports")
    parser.add_argument("--variants", nargs="*", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument(
        "--reuse", action="store_true", help="compare reports already in --out, run nothing"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    baseline = load_report(BASELINE)
    print(f"baseline: {BASELINE}: {baseline.describe()}")
    print(f"gate: threshold {DEFAULT_THRESHOLD:g}x, noise floor {DEFAULT_NOISE:g} rounding steps")
    print("| variant | inputs | greatest raw growth | greatest judged growth | regressions |")
    print("|---|---|---|---|---|")
    for name in args.variants:
        path = args.out / f"{name}.json" if args.reuse else run_variant(name, args.out)
        # Compared even where the variant drew other inputs (ATen's scalar path draws other
        # normal numbers than its AVX2 and AVX512 paths): the gate would refuse such a run,
        # and the table says so in its inputs column.
        diff = compare_reports(baseline, load_report(path), allow_mismatch=True)
        inputs = "; ".join(m.split(":")[0] for m in diff.mismatches) or "as the baseline's"
        raw = describe_worst(diff, lambda item, diff=diff: raw_growth(diff, item))
        # Ties of the judged growth (all 1x, say) go to the greatest raw growth.
        judged = describe_worst(diff, lambda item, diff=diff: (item.ratio, raw_growth(diff, item)))
        print(
            f"| {name} | {inputs} | {raw} | {judged} | "
            f"{len(diff.regressions)} of {len(diff.items)} |"
        )


if __name__ == "__main__":
    main()
