"""Every number setting goes through one check (``pytest_gradref.config.number_settings``): a
bool is not a number anywhere, and the baseline gate's threshold and the diff's ``--threshold``
take exactly the same values."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_gradref import Reference, Tolerance
from pytest_gradref.__main__ import main
from pytest_gradref.config.markers import MarkerError, parse_gradref_mark


def _assert_close(**kwargs: Any) -> Callable[[Reference], object]:
    return lambda ref: ref.assert_close(ref.value, ref.grads, **kwargs)


def _marker(**kwargs: Any) -> Callable[[Reference], object]:
    # golden= so that a budget fails only for its own value.
    mark = pytest.mark.gradref(golden=torch.float64, **kwargs).mark
    return lambda ref: parse_gradref_mark(mark)


def _tolerance(**kwargs: Any) -> Callable[[Reference], object]:
    return lambda ref: Tolerance(**kwargs)


@pytest.mark.parametrize(
    ("check", "error", "message"),
    [
        (_assert_close(rtol=True), ValueError, "rtol must be a number >= 0, got True"),
        (_assert_close(atol=True), ValueError, "atol must be a number >= 0, got True"),
        (_assert_close(budget=True), ValueError, "budget must be a number > 0, got True"),
        (
            _tolerance(rtol=True, atol=0.0),
            ValueError,
            "Tolerance rtol must be a number >= 0, got True",
        ),
        (
            _tolerance(rtol=0.0, atol=True),
            ValueError,
            "Tolerance atol must be a number >= 0, got True",
        ),
        (
            _marker(rtol=True),
            MarkerError,
            "@pytest.mark.gradref got rtol=True; it must be a number >= 0",
        ),
        (
            _marker(atol=True),
            MarkerError,
            "@pytest.mark.gradref got atol=True; it must be a number >= 0",
        ),
        (
            _marker(budget=True),
            MarkerError,
            "@pytest.mark.gradref got budget=True; it must be a number > 0",
        ),
    ],
    ids=[
        "assert_close-rtol",
        "assert_close-atol",
        "assert_close-budget",
        "Tolerance-rtol",
        "Tolerance-atol",
        "marker-rtol",
        "marker-atol",
        "marker-budget",
    ],
)
def test_a_bool_is_not_a_number(
    grad_reference: Any,
    check: Callable[[Reference], object],
    error: type[Exception],
    message: str,
) -> None:
    ref = grad_reference(lambda x: x.square().sum(), torch.ones(3), golden=torch.float64)
    with pytest.raises(error) as raised:
        check(ref)
    assert str(raised.value) == message


# Both thresholds are numbers >= thresholds.MIN_THRESHOLD, 1: a ratio of growth.
THRESHOLDS = {"1": True, "1.5": True, "inf": True, "0.5": False, "0": False, "-1": False}
THRESHOLDS |= {"nan": False, "true": False, "": False}


@pytest.mark.parametrize(("text", "accepted"), THRESHOLDS.items(), ids=repr)
def test_the_baseline_and_the_diff_take_the_same_thresholds(
    pytester: pytest.Pytester,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    text: str,
    accepted: bool,
) -> None:
    # The gate reads its threshold before the baseline: an accepted one gets as far as the
    # absent file.
    with pytest.raises(pytest.UsageError) as gate:
        pytester.parseconfigure(
            "--gradref-baseline=absent.json", f"--gradref-baseline-threshold={text}"
        )
    gate_accepts = "absent.json: cannot read it" in str(gate.value)
    assert gate_accepts != ("--gradref-baseline-threshold" in str(gate.value)), gate.value
    # The diff parses its arguments before reading the reports: an accepted threshold gets as
    # far as the absent files. Unusable input either way: exit status 2.
    absent = str(tmp_path / "absent.json")
    try:
        status = main(["diff", absent, absent, f"--threshold={text}"])
    except SystemExit as exited:  # argparse's exit
        status = exited.code
    error = capsys.readouterr().err
    assert status == 2
    diff_accepts = "cannot read it" in error
    assert diff_accepts != ("argument --threshold" in error), error
    assert (gate_accepts, diff_accepts) == (accepted, accepted)
