"""What the default verdict costs a whole suite: the kernel and adopter suites under the default
verdict (a float64 golden, the budget, the rounding spread where an item needs it) against the
cheapest mode (``--gradref-verdict=tolerance``: torch.testing's tolerances, no golden).

    python benchmarks/bench_suite_cost.py                      # the kernel and adopter suites
    python benchmarks/bench_suite_cost.py -m "not exhaustive"  # the main job's selection
    python benchmarks/bench_suite_cost.py --device cuda -n 0

Each mode runs once, as one pytest run with ``--junitxml`` (file order: pytest-randomly off).
Printed per mode: the wall time of the run, the outcome counts, and the test-seconds (each
test's setup + call + teardown, so pytest's and torch's start-up are left out). The ratio is
taken over the tests that passed in both runs, beside the ratio of the wall times, and the
default's extra test-seconds are broken down by test function (what bounds the ratio); the tests
that give an explicit budget skip in the cheapest mode, saying so, and the kernels that
torch.testing's default tolerances fail there (bf16 mostly) are left out. Exits 1 when the
default run fails.
Run-to-run noise is not estimated here: one run per mode, as a suite is run; repeat the command
to see it.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

from _bench_util import git_commit

REPO = Path(__file__).resolve().parent.parent
MODES = {"default": [], "tolerance": ["--gradref-verdict=tolerance"]}
SHOWN = 5  # test functions named in the breakdown of the default's extra time


@dataclass(frozen=True)
class SuiteRun:
    """One mode's run: its wall seconds and each test's outcome and seconds."""

    wall: float
    status: int
    outcomes: dict[str, tuple[str, float]]

    def count(self, outcome: str) -> int:
        return sum(1 for kind, _ in self.outcomes.values() if kind == outcome)


def junit_outcomes(path: Path) -> dict[str, tuple[str, float]]:
    """test id -> (passed / failed / skipped, seconds) from a JUnit XML file."""
    outcomes = {}
    for case in ElementTree.parse(path).iter("testcase"):
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                kind = "failed"
            elif child.tag == "skipped":
                kind = "skipped"
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = (kind, float(case.get("time")))
    return outcomes


def run_suite(mode: str, args: argparse.Namespace, out: Path) -> SuiteRun:
    junit = out / f"{mode}.xml"
    command = [
        sys.executable, "-m", "pytest", *args.paths, "-q", "-p", "no:cacheprovider",
        "-p", "no:randomly", "-n", args.workers, f"--junitxml={junit}", *MODES[mode],
    ]  # fmt: skip
    if args.marker:
        command += ["-m", args.marker]
    if args.device:
        command.append(f"--gradref-device={args.device}")
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (out / f"{mode}.log").write_text(f"{' '.join(command)}\n\n{done.stdout}{done.stderr}")
    if not junit.exists():
        sys.exit(
            f"{mode}: pytest wrote no JUnit XML (exit {done.returncode}); see {out}/{mode}.log"
        )
    return SuiteRun(wall, done.returncode, junit_outcomes(junit))


def print_where_it_goes(default: SuiteRun, cheapest: SuiteRun, both: list[str]) -> None:
    """The default's extra test-seconds by test function, the largest first: what bounds the
    suite's ratio."""
    extra: dict[str, float] = {}
    for test in both:
        function = test.split("[", 1)[0].rsplit(".", 1)[-1]
        extra[function] = extra.get(function, 0.0) + default.outcomes[test][1]
        extra[function] -= cheapest.outcomes[test][1]
    total = sum(extra.values())
    print(f"where the default's {total:+.1f} test-seconds go, by test function (the largest five):")
    for function, seconds in sorted(extra.items(), key=lambda pair: -pair[1])[:SHOWN]:
        print(f"  {seconds:+.1f} s  {function}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["tests/kernels", "tests/adopters"])
    parser.add_argument("-n", dest="workers", default="auto", help="xdist workers (default auto)")
    parser.add_argument("-m", dest="marker", help="a marker expression, as pytest's -m")
    parser.add_argument("--device", help="--gradref-device for both runs (default: auto)")
    parser.add_argument("--out", type=Path, help="folder for the logs and the JUnit XML")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="suite_cost-"))
    out.mkdir(parents=True, exist_ok=True)
    import torch  # after the arguments: --help needs no torch

    selection = " ".join(args.paths) + (f" -m {args.marker!r}" if args.marker else "")
    print(
        f"# python benchmarks/bench_suite_cost.py {' '.join(sys.argv[1:])}".rstrip()
        + f" ({platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"commit {git_commit(REPO) or 'unknown'})"
    )
    print(f"pytest {selection} -n {args.workers} -p no:randomly, once per mode; logs in {out}")
    runs = {mode: run_suite(mode, args, out) for mode in MODES}
    print()
    print("| mode | wall | exit | passed | skipped | failed | test-seconds |")
    print("|---|---|---|---|---|---|---|")
    for mode, run in runs.items():
        seconds = sum(s for _, s in run.outcomes.values())
        print(
            f"| {mode} | {run.wall:.1f} s | {run.status} | {run.count('passed')} | "
            f"{run.count('skipped')} | {run.count('failed')} | {seconds:.1f} s |"
        )
    default, cheapest = runs["default"], runs["tolerance"]
    both = [
        test
        for test, (kind, _) in default.outcomes.items()
        if kind == "passed" and cheapest.outcomes.get(test, ("", 0.0))[0] == "passed"
    ]
    if not both:
        print("no test passed in both modes: nothing to compare")
        return 1
    default_seconds = sum(default.outcomes[t][1] for t in both)
    cheapest_seconds = sum(cheapest.outcomes[t][1] for t in both)
    print()
    print(
        f"default / cheapest over the {len(both)} tests that passed in both: "
        f"{default_seconds:.1f} / {cheapest_seconds:.1f} test-seconds = "
        f"{default_seconds / cheapest_seconds:.3f}x; wall {default.wall:.1f} / "
        f"{cheapest.wall:.1f} s = {default.wall / cheapest.wall:.3f}x"
    )
    print_where_it_goes(default, cheapest, both)
    if cheapest.count("failed"):
        # The suites are written for the default verdict: the cheapest mode's tolerances
        # (torch.testing's defaults) fail kernels that the golden's budget passes, mostly bf16.
        print(
            f"the cheapest mode failed {cheapest.count('failed')} tests (see tolerance.log): "
            "they are left out of the ratio"
        )
    if default.count("failed") or default.status not in (0, 5):
        print(f"the default run failed (exit {default.status}; see default.log): no suite figure")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
