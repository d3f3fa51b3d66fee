"""CI's stage budget: each stage of ``.ci/run`` against twice its committed time.

``.ci/run`` writes one line per finished stage, ``NAME<TAB>SECONDS``, to a file; this script
reads it beside the committed times (``.ci/stage-seconds.json``) and fails when a stage took
more than ``FACTOR`` times its committed seconds, so a slowdown is seen in the change that
made it, long before the whole run reaches the CI host's time limit. Stages whose time is the
network's (the downloads of the installs) are printed and not judged; the JSON names them and
says why.

It judges data, never nothing: a run that recorded no stage, a stage without a committed time
and a committed stage that did not run all fail, each naming what to do.

    python scripts/stage_budget.py .ci/stage-seconds.json STAGES_FILE
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

# A stage may take up to this many times its committed seconds. Hosts differ (the CI host ran
# the whole of .ci/run at 1.1x this repository's 2-core development machine on the last
# landing), so a budget of 1x would fail on a slower host, and a slowdown worth seeing is larger.
FACTOR = 2.0


@dataclass(frozen=True)
class Budget:
    """The committed times: seconds per judged stage, and the stages left unjudged (with why)."""

    seconds: dict[str, float]
    unjudged: dict[str, str]
    source: str


@dataclass(frozen=True)
class StageCheck:
    """One stage's time against its budget (``committed`` is None for an unjudged stage)."""

    name: str
    seconds: float
    committed: float | None

    @property
    def over(self) -> bool:
        return self.committed is not None and self.seconds > FACTOR * self.committed


def read_budget(path: Path) -> Budget:
    data = json.loads(path.read_text())
    return Budget(
        seconds={name: float(s) for name, s in data["seconds"].items()},
        unjudged=dict(data.get("unjudged", {})),
        source=str(data.get("source", "")),
    )


def read_stages(path: Path) -> list[tuple[str, float]]:
    """The ``NAME<TAB>SECONDS`` lines .ci/run wrote, in the order the stages ran."""
    stages = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        name, sep, seconds = line.rpartition("\t")
        if not sep:
            raise ValueError(f"{path}:{number}: expected NAME<TAB>SECONDS, got {line!r}")
        stages.append((name, float(seconds)))
    return stages


def check(budget: Budget, stages: list[tuple[str, float]]) -> tuple[list[StageCheck], list[str]]:
    """Each stage's check, and the problems that fail the run (over budget, no committed time,
    a committed stage that did not run, no stage at all)."""
    checks = [StageCheck(name, seconds, budget.seconds.get(name)) for name, seconds in stages]
    problems = []
    if not stages:
        problems.append("no stage was recorded: the budget judged nothing")
    ran = {name for name, _ in stages}
    for item in checks:
        if item.over:
            assert item.committed is not None
            problems.append(
                f"stage {item.name!r} took {item.seconds:.0f} s, over {FACTOR:g}x its committed "
                f"{item.committed:.0f} s: find what slowed it (pytest --durations=0), or, if the "
                "growth is meant, commit the new time in .ci/stage-seconds.json"
            )
        elif item.committed is None and item.name not in budget.unjudged:
            problems.append(
                f"stage {item.name!r} has no committed time: add its seconds from a full run to "
                "'seconds' in .ci/stage-seconds.json (or to 'unjudged', saying why)"
            )
    for name in [*budget.seconds, *budget.unjudged]:
        if name not in ran:
            problems.append(
                f"stage {name!r} of .ci/stage-seconds.json did not run: remove it there, or "
                "restore the stage in .ci/run"
            )
    return checks, problems


def table(checks: list[StageCheck], budget: Budget) -> list[str]:
    lines = [f"stage times against {FACTOR:g}x the committed ones ({budget.source})"]
    for item in checks:
        if item.committed is None:
            verdict = f"not judged: {budget.unjudged.get(item.name, 'no committed time')}"
        else:
            verdict = f"{item.seconds / item.committed:.2f}x of {item.committed:.0f} s"
            verdict += " OVER BUDGET" if item.over else ""
        lines.append(f"  {item.seconds:6.0f} s  {item.name}: {verdict}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("budget", type=Path, help="the committed times (.ci/stage-seconds.json)")
    parser.add_argument("stages", type=Path, help="the NAME<TAB>SECONDS lines .ci/run wrote")
    args = parser.parse_args(argv)
    budget = read_budget(args.budget)
    checks, problems = check(budget, read_stages(args.stages))
    print("\n".join(table(checks, budget)))
    for problem in problems:
        print(f"stage budget: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
