"""The ``pytest-gradref`` command (also ``python -m pytest_gradref``).

``pytest-gradref diff BASE.json NEW.json`` compares two precision reports. Exit status: 0 no
regression, 1 a regression, 2 unusable input, including two reports with no item in common
(the message says why).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from pytest_gradref.config.number_settings import number_problem
from pytest_gradref.config.thresholds import DEFAULT_THRESHOLD, MIN_THRESHOLD
from pytest_gradref.report.diff import (
    DEFAULT_FLOOR,
    DEFAULT_NOISE,
    UnusableInput,
    compare_reports,
    load_report,
)
from pytest_gradref.report.diff_output import FORMATS, PlotUnavailable, check_plotting, plot, render

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_UNUSABLE = 2


def _number(minimum: float, inclusive: bool = True) -> Callable[[str], float]:
    """An argparse type: a number at or above ``minimum`` (above it when not inclusive)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        problem = number_problem(value, minimum=minimum, inclusive=inclusive)
        if problem is not None:
            raise argparse.ArgumentTypeError(f"{problem}, got {text!r}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pytest-gradref", description="Tools for pytest-gradref precision reports."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    diff = commands.add_parser(
        "diff",
        help="compare two --gradref-report files item by item",
        description=(
            "Compare two --gradref-report files item by item, worst first. Exit status: 0 no "
            "regression, 1 a regression, 2 unusable input (also: no item in both reports)."
        ),
    )
    diff.add_argument("base", metavar="BASE.json", help="the report to compare against")
    diff.add_argument("new", metavar="NEW.json", help="the report under test")
    diff.add_argument(
        "--threshold",
        type=_number(MIN_THRESHOLD),
        default=DEFAULT_THRESHOLD,
        help=f"an item whose error grew by more than this factor regresses "
        f"(default {DEFAULT_THRESHOLD:g})",
    )
    diff.add_argument(
        "--floor",
        type=_number(0, inclusive=False),
        default=DEFAULT_FLOOR,
        help=f"errors below this absolute value count as this value, so that exact zeros do "
        f"not give infinite ratios (default {DEFAULT_FLOOR:g})",
    )
    diff.add_argument(
        "--noise",
        type=_number(0),
        default=DEFAULT_NOISE,
        help=f"errors below this many rounding steps of their item's dtype at its scale (the "
        f"float64 golden's greatest magnitude) count as that many: changes of rounding noise "
        f"are not regressions; normwise errors likewise, in steps of the dtype "
        f"(default {DEFAULT_NOISE:g})",
    )
    diff.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="compare even where the tests' inputs (for reports before format 3: the base "
        "seeds) or strategies differ",
    )
    diff.add_argument("--format", choices=FORMATS, default="text", help="output format")
    diff.add_argument(
        "--top",
        type=int,
        default=20,
        help="items shown in text and markdown: every regression, then the worst others up "
        "to this many rows (0: all; default 20)",
    )
    diff.add_argument(
        "--fail-on-vanished",
        action="store_true",
        help="exit 1 also when a test or item of the base is missing from the new report",
    )
    diff.add_argument("--plot", metavar="PATH", help="write a PNG of the errors (matplotlib)")
    return parser


def _diff(args: argparse.Namespace) -> int:
    try:
        if args.plot:
            check_plotting()  # before any work
        result = compare_reports(
            load_report(args.base),
            load_report(args.new),
            threshold=args.threshold,
            floor=args.floor,
            noise=args.noise,
            allow_mismatch=args.allow_mismatch,
        )
    except (UnusableInput, PlotUnavailable) as error:
        print(f"pytest-gradref diff: error: {error}", file=sys.stderr)
        return EXIT_UNUSABLE
    why = result.nothing_compared()
    if why:  # "0 regressions" of nothing must not pass a gate
        print(f"pytest-gradref diff: error: nothing to compare: {why}", file=sys.stderr)
        return EXIT_UNUSABLE
    sys.stdout.write(render(result, args.format, args.top))
    if args.plot:
        try:
            plot(result, args.plot)
        except OSError as error:
            print(f"pytest-gradref diff: error: cannot write the plot: {error}", file=sys.stderr)
            return EXIT_UNUSABLE
        print(f"plot written to {args.plot}", file=sys.stderr)
    if result.regressions or (args.fail_on_vanished and result.only_in_base):
        return EXIT_REGRESSION
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse's own errors exit with 2)."""
    args = _parser().parse_args(argv)
    return _diff(args)


if __name__ == "__main__":
    sys.exit(main())
