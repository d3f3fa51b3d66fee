"""CI's stage budget (scripts/stage_budget.py) fails a stage that grew past twice its committed
time, and never passes a run it could not judge; the committed times name every stage that
.ci/run runs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType

import pytest
from test_docs_checks import ROOT, _script


@pytest.fixture(scope="module")
def budget_script() -> ModuleType:
    return _script("stage_budget")


def write(tmp_path: Path, seconds: dict[str, float], stages: list[tuple[str, float]]) -> list[str]:
    budget = tmp_path / "budget.json"
    budget.write_text(
        json.dumps({"source": "t", "seconds": seconds, "unjudged": {"setup": "downloads"}})
    )
    recorded = tmp_path / "stages.tsv"
    recorded.write_text("".join(f"{name}\t{s}\n" for name, s in stages))
    return [str(budget), str(recorded)]


def test_a_stage_within_twice_its_time_passes(
    budget_script: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = write(
        tmp_path, {"lint": 30, "tests": 100}, [("setup", 900), ("lint", 60), ("tests", 150)]
    )
    assert budget_script.main(args) == 0
    out = capsys.readouterr().out
    assert "2.00x of 30 s" in out
    assert "1.50x of 100 s" in out
    assert "not judged: downloads" in out


def test_a_stage_past_twice_its_time_fails_naming_it(
    budget_script: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = write(tmp_path, {"lint": 30, "tests": 100}, [("lint", 30), ("tests", 201), ("setup", 1)])
    assert budget_script.main(args) == 1
    captured = capsys.readouterr()
    assert "OVER BUDGET" in captured.out
    assert "stage 'tests' took 201 s, over 2x its committed 100 s" in captured.err
    assert "lint" not in captured.err


@pytest.mark.parametrize(
    ("stages", "problem"),
    [
        ([], "no stage was recorded: the budget judged nothing"),
        (
            [("lint", 1), ("tests", 1), ("setup", 1), ("docs", 1)],
            "stage 'docs' has no committed time",
        ),
        ([("lint", 1), ("setup", 1)], "stage 'tests' of .ci/stage-seconds.json did not run"),
    ],
    ids=["nothing-recorded", "new-stage", "stage-gone"],
)
def test_what_cannot_be_judged_fails(
    budget_script: ModuleType,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    stages: list[tuple[str, float]],
    problem: str,
) -> None:
    assert budget_script.main(write(tmp_path, {"lint": 30, "tests": 100}, stages)) == 1
    assert problem in capsys.readouterr().err


def test_the_committed_times_name_every_stage_of_the_ci_script(budget_script: ModuleType) -> None:
    budget = budget_script.read_budget(ROOT / ".ci" / "stage-seconds.json")
    script = (ROOT / ".ci" / "run").read_text()
    stages = re.findall(r'^\s*step "([^"$]+)"', script, flags=re.MULTILINE)
    assert stages[-1] == "done"
    assert sorted(stages[:-1]) == sorted([*budget.seconds, *budget.unjudged])
    assert all(seconds > 0 for seconds in budget.seconds.values())
