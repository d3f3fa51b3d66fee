"""``pytest-gradref diff``: comparing two precision reports, its exit statuses and outputs."""

from __future__ import annotations

import builtins
import copy
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pytest_gradref.__main__ import main
from pytest_gradref.report import diff as diff_module
from pytest_gradref.report.diff import FORMAT_VERSION
from pytest_gradref.report.diff_output import render_markdown, render_text

# A kernel whose gradient is off by a relative error that the environment sets. float64's
# default tolerance is rtol = atol = 1e-7: at 2.5e-8 and at 1e-7 the test passes, and its error,
# some 10^8 rounding steps of float64 at the gradient's scale, grows fourfold: a regression. At
# 2.2e-16 and 8.9e-16 (one step of float64 and four) it grows fourfold too, within the noise.
SKEWED_KERNEL = """
import os

import pytest
import torch


def loss(x, w):
    return torch.tanh(x @ w).square().sum()


def kernel(x, w):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = loss(xx, ww)
    out.backward()
    skew = float(os.environ.get("KERNEL_SKEW", "0"))
    return out, xx.grad * (1 + skew), ww.grad


@pytest.mark.parametrize("n", [3, 5])
def test_kernel(grad_reference, n):
    x = torch.randn(n, 4, dtype=torch.float64)
    w = torch.randn(4, 2, dtype=torch.float64)
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    value, gx, gw = kernel(x, w)
    ref.assert_close(value, (gx, gw))
"""


def _run_suite(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, name: str, skew: str
) -> Path:
    monkeypatch.setenv("KERNEL_SKEW", skew)
    pytester.runpytest("--gradref-device=cpu", f"--gradref-report={name}").assert_outcomes(passed=2)
    return pytester.path / name


def _diff(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(["diff", *map(str, args)])
    out, err = capsys.readouterr()
    return status, out, err


def test_injected_fourfold_error_growth_is_flagged_and_an_unchanged_kernel_is_not(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytester.makepyfile(test_suite=SKEWED_KERNEL)
    base = _run_suite(pytester, monkeypatch, "base.json", "2.5e-8")
    same = _run_suite(pytester, monkeypatch, "same.json", "2.5e-8")
    worse = _run_suite(pytester, monkeypatch, "worse.json", "1e-7")
    capsys.readouterr()  # the runs' own output

    status, out, _ = _diff(capsys, base, same)
    assert status == 0
    assert (
        "0 regressions in 6 compared items (threshold 2x; errors within 4 rounding steps of "
        "their dtype at their scale count as noise; a half-precision item's normwise error "
        "drifts when it grows past 6 sigmas of its rounding noise)"
    ) in out
    assert "<-" not in out

    status, out, _ = _diff(capsys, base, worse)
    assert status == 1
    assert "2 regressions in 6 compared items" in out
    lines = out.splitlines()
    table = lines[lines.index(next(x for x in lines if x.lstrip().startswith("ratio"))) + 1 :]
    # Worst first: the two skewed gradients, each about 4x, then the unchanged items. The
    # skew scales every element alike, so the greatest and the normwise error grow alike and
    # either may be the larger by a rounding: the verdict names the one that was.
    for row in table[:2]:
        assert "gradient of argument 0 (x)  <- " in row
        assert row.split("<- ")[1] in ("error grew 4x", "normwise error grew 4x")
        assert float(row.split()[0].rstrip("x")) == pytest.approx(4, rel=0.05)
    assert all("<-" not in row for row in table[2:])
    # A threshold above the growth lets it pass.
    assert _diff(capsys, base, worse, "--threshold", "5")[0] == 0


def test_fourfold_growth_within_a_few_rounding_steps_is_noise(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytester.makepyfile(test_suite=SKEWED_KERNEL)
    # 1 + skew is 1 + eps and 1 + 4 eps of float64: the gradient's error goes from about one
    # rounding step at its scale to about four.
    base = _run_suite(pytester, monkeypatch, "base.json", "2.2e-16")
    worse = _run_suite(pytester, monkeypatch, "worse.json", "8.9e-16")
    capsys.readouterr()
    report = diff_module.compare_reports(
        diff_module.load_report(base), diff_module.load_report(worse)
    )
    grown = [item for item in report.items if item.label.startswith("gradient of argument 0")]
    assert len(grown) == 2
    step = diff_module.EPSILONS["float64"]
    for item in grown:
        # It grew beyond the threshold, greatest and normwise (4-5x on the machine that wrote
        # this: whole rounding steps) ...
        assert item.after / item.before > diff_module.DEFAULT_THRESHOLD
        assert item.norm_after / item.norm_before > diff_module.DEFAULT_THRESHOLD
        assert item.after < item.noise_floor  # ... within four steps of float64 at its scale
        assert item.norm_after < diff_module.DEFAULT_NOISE * step  # normwise too
        assert item.ratio == 1.0
        assert not item.normwise
    assert not report.regressions
    # Judged raw (no noise steps, an absolute floor beneath both errors) it is flagged.
    status, out, _ = _diff(capsys, base, worse, "--noise", "0", "--floor", "1e-300")
    assert status == 1
    assert "2 regressions in 6 compared items" in out
    # The default absolute floor alone (1e-12, all a report without scales has) is above it.
    assert _diff(capsys, base, worse, "--noise", "0")[0] == 0


def _item(
    label: str,
    max_abs: Any,
    headroom: Any = 0.5,
    passed: bool = True,
    *,
    dtype: str = "float32",
    scale: float | None = 1.0,
    norm_rel: float | None = None,
) -> dict[str, Any]:
    """An item as a report holds it. At the default scale of 1 a float32 rounding step is
    1.2e-7, so the noise floor is 4.8e-7; ``scale=None`` leaves the field out, as a format-1
    report does."""
    item = {
        "label": label,
        "dtype": dtype,
        "max_abs": max_abs,
        "max_rel": max_abs,
        "criterion": "rtol=1.3e-06, atol=1e-05 from torch.testing's default for float32",
        "headroom": headroom,
        "passed": passed,
    }
    if norm_rel is not None:
        item["norm_rel"] = norm_rel
    if scale is not None:
        item["scale"] = scale
    return item


def _test(nodeid: str, *items: dict[str, Any], strategy: str = "autograd") -> dict[str, Any]:
    return {
        "nodeid": nodeid,
        "device": "cpu",
        "backend": "cpu",
        "strategies": [strategy],
        "seed": 1,
        "items": list(items),
        "crosscheck": [],
        "outcome": "passed",
    }


BASE: dict[str, Any] = {
    "format_version": FORMAT_VERSION,
    "base_seed": 0,
    "torch": "2.13.0+cpu",
    "device": "cpu",
    "backend": "cpu",
    "strategy": "autograd",
    "golden_on_cpu": [],
    "tests": [
        _test("t.py::test_a", _item("value", 1e-7), _item("gradient of argument 0 (x)", 2e-6)),
        _test("t.py::test_b", _item("value", 0.0, 1.0), _item("value", 3e-7)),
        _test("t.py::test_gone", _item("value", 1e-7)),
    ],
}


def _write(path: Path, document: Any) -> Path:
    path.write_text(json.dumps(document))
    return path


def _pair(tmp_path: Path, new: dict[str, Any]) -> tuple[Path, Path]:
    return _write(tmp_path / "base.json", BASE), _write(tmp_path / "new.json", new)


def _changed(**tests: dict[str, Any]) -> dict[str, Any]:
    new = copy.deepcopy(BASE)
    new["tests"] = [tests.get(t["nodeid"], t) for t in new["tests"] if t["nodeid"] in tests]
    return new


def test_vanished_tests_and_items_are_listed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = copy.deepcopy(BASE)
    new["tests"] = [
        _test("t.py::test_a", _item("value", 1e-7)),  # its gradient item vanished
        BASE["tests"][1],
        _test("t.py::test_new", _item("value", 1e-7)),
    ]
    base, new_path = _pair(tmp_path, new)
    status, out, _ = _diff(capsys, base, new_path)
    assert status == 0, "vanished coverage is listed; it fails only with --fail-on-vanished"
    assert "only in base (coverage that vanished): 2\n" in out
    assert "  t.py::test_gone\n" in out
    assert "  t.py::test_a: gradient of argument 0 (x)\n" in out
    assert "only in new: 1\n  t.py::test_new\n" in out
    assert _diff(capsys, base, new_path, "--fail-on-vanished")[0] == 1
    document = json.loads(_diff(capsys, base, new_path, "--format=json")[1])
    assert document["only_in_base"] == {
        "tests": ["t.py::test_gone"],
        "items": [{"nodeid": "t.py::test_a", "label": "gradient of argument 0 (x)"}],
    }
    assert document["only_in_new"]["tests"] == ["t.py::test_new"]


def test_repeated_labels_are_matched_in_order(tmp_path: Path) -> None:
    new = copy.deepcopy(BASE)
    new["tests"][1]["items"][1]["max_abs"] = 3e-6
    base, new_path = _pair(tmp_path, new)
    result = diff_module.compare_reports(
        diff_module.load_report(base), diff_module.load_report(new_path)
    )
    assert [(i.nodeid, i.label) for i in result.regressions] == [("t.py::test_b", "value #2")]


def test_items_with_a_rounded_error_compare_with_items_without(tmp_path: Path) -> None:
    # A budget with a rounded reference records rounded_error; a report from before that field
    # (or from a run without rounded=True) still compares item by item, by max_abs.
    new = copy.deepcopy(BASE)
    value, gradient = new["tests"][0]["items"]
    value.update(rounded_error=4e-7, criterion="budget 2x the bfloat16-rounded reference's ...")
    gradient.update(rounded_error=1e-6, max_abs=8e-6)
    base, new_path = _pair(tmp_path, new)
    result = diff_module.compare_reports(
        diff_module.load_report(base), diff_module.load_report(new_path)
    )
    assert [(i.label, i.ratio) for i in result.regressions] == [
        ("gradient of argument 0 (x)", pytest.approx(4))
    ]


def test_floor_keeps_exact_zeros_from_giving_infinite_ratios(tmp_path: Path) -> None:
    new = copy.deepcopy(BASE)
    new["tests"][1]["items"][0]["max_abs"] = 1e-13  # was exactly 0
    base, new_path = _pair(tmp_path, new)
    reports = diff_module.load_report(base), diff_module.load_report(new_path)
    result = diff_module.compare_reports(*reports)
    item = next(i for i in result.items if i.label == "value" and i.nodeid.endswith("test_b"))
    assert item.ratio == 1.0
    assert not result.regressions
    # The absolute floor alone (no noise steps) keeps it at 1x too ...
    assert {i.ratio for i in diff_module.compare_reports(*reports, noise=0).items} == {1.0}
    # ... and above the floor, zero to 1e-13 is a growth of 1e-13 / 1e-15 = 100x.
    lower = diff_module.compare_reports(*reports, floor=1e-15, noise=0)
    assert [i.label for i in lower.regressions] == ["value"]
    assert lower.regressions[0].ratio == pytest.approx(100)


def test_nan_error_and_a_newly_failing_item_are_regressions(tmp_path: Path) -> None:
    new = copy.deepcopy(BASE)
    new["tests"][0]["items"][0]["max_abs"] = "nan"
    new["tests"][0]["items"][1].update(headroom=-0.2, passed=False)  # same error, now fails
    base, new_path = _pair(tmp_path, new)
    result = diff_module.compare_reports(
        diff_module.load_report(base), diff_module.load_report(new_path)
    )
    assert {i.label: i.regression for i in result.regressions} == {
        "value": "error is now NaN",
        "gradient of argument 0 (x)": "now fails",
    }


def test_mismatched_seeds_are_refused_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Reports without input fingerprints (before format 3) compare by their base seeds;
    # test_suite_seeding.py has the fingerprints of later ones.
    old_base = {**copy.deepcopy(BASE), "format_version": 2}
    new = {**copy.deepcopy(BASE), "format_version": 2, "base_seed": 7}
    base, new_path = _write(tmp_path / "base.json", old_base), _write(tmp_path / "new.json", new)
    status, out, err = _diff(capsys, base, new_path)
    assert status == 2
    assert out == ""
    assert "base seeds differ: 0 in base, 7 in new" in err
    assert "--allow-mismatch compares anyway" in err
    status, out, _ = _diff(capsys, base, new_path, "--allow-mismatch")
    assert status == 0
    assert "compared despite a mismatch: base seeds differ: 0 in base, 7 in new" in out


def test_mismatched_strategies_are_refused_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = copy.deepcopy(BASE)
    new["tests"][0]["strategies"] = ["grad_and_value"]
    base, new_path = _pair(tmp_path, new)
    status, _, err = _diff(capsys, base, new_path)
    assert status == 2
    assert (
        "strategies differ in 1 tests, e.g. t.py::test_a: ['autograd'] in base (autograd "
        "chosen for the run by --gradref-strategy or its env/ini), ['grad_and_value'] in new "
        "(chosen by a gradref(strategy=...) marker on the test); only each device's own "
        "default (or a crosscheck's) compares across devices" in err
    )
    assert _diff(capsys, base, new_path, "--allow-mismatch")[0] == 0


def _on_device(document: dict[str, Any], backend: str, strategy: str) -> dict[str, Any]:
    """``document`` as a run on ``backend`` that took its default ``strategy``."""
    moved = copy.deepcopy(document)
    moved.update(device=f"{backend}:0", backend=backend, strategy=strategy)
    moved["strategy_is_default"] = True
    for test in moved["tests"]:
        test.update(device=f"{backend}:0", backend=backend, strategies=[strategy])
    return moved


def test_a_test_without_references_on_one_side_is_no_strategy_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # An xfailed test that failed before computing a reference records no strategy and no
    # items: its items are only in the other report, and the reports still compare.
    cuda = _on_device(BASE, "cuda", "autograd")
    npu = _on_device(BASE, "npu", "grad_and_value")
    npu["tests"][0].update(strategies=[], items=[], outcome="xfailed")
    status, out, _ = _diff(
        capsys, _write(tmp_path / "b.json", cuda), _write(tmp_path / "n.json", npu)
    )
    assert status == 0, out
    assert "strategies differ" not in out
    assert "only in base (coverage that vanished): 2" in out
    assert "t.py::test_a: value" in out


def test_device_default_strategies_compare_across_devices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cuda = _on_device(BASE, "cuda", "autograd")
    npu = _on_device(BASE, "npu", "grad_and_value")
    npu["tests"][0]["items"][1]["max_abs"] = 8e-6  # grew 4x on the npu
    base, new = _write(tmp_path / "base.json", cuda), _write(tmp_path / "new.json", npu)
    status, out, _ = _diff(capsys, base, new)
    assert status == 1
    assert "strategy=grad_and_value (npu default)" in out
    assert "strategy=autograd (cuda default)" in out
    assert "compared despite a mismatch" not in out
    assert "t.py::test_a: gradient of argument 0 (x)  <- error grew 4x" in out


@pytest.mark.parametrize(
    "why",
    ["chosen by an option", "one test's marker", "the same backend"],
)
def test_strategies_that_are_not_device_defaults_stay_a_mismatch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], why: str
) -> None:
    cuda = _on_device(BASE, "cuda", "autograd")
    npu = _on_device(BASE, "npu", "grad_and_value")
    if why == "chosen by an option":
        npu["strategy_is_default"] = False
    elif why == "one test's marker":
        npu["tests"][1]["strategies"] = ["crosscheck"]
    else:
        npu = _on_device(BASE, "cuda", "grad_and_value")
    base, new = _write(tmp_path / "base.json", cuda), _write(tmp_path / "new.json", npu)
    status, _, err = _diff(capsys, base, new)
    assert status == 2
    assert "strategies differ in" in err


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "base.json: cannot read it: No such file or directory"),
        ("{not json", "base.json: not JSON: "),
        ("[1, 2]", "base.json: not a pytest-gradref report (no list of tests)"),
        (
            {**BASE, "format_version": 99},
            "base.json: unknown report format version 99; this pytest-gradref reads version "
            "1, 2, 3",
        ),
        (
            {k: v for k, v in BASE.items() if k != "format_version"},
            "base.json: it has no format_version (written before reports had one)",
        ),
        ({**BASE, "tests": [{"items": []}]}, "base.json: a test record without a node id"),
        (
            {**BASE, "tests": [{"nodeid": "t.py::test_a", "items": [1]}]},
            "base.json: t.py::test_a: no list of items",
        ),
    ],
)
def test_unusable_input_exits_2_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: Any, why: str
) -> None:
    base = tmp_path / "base.json"
    if isinstance(content, str):
        base.write_text(content)
    elif content is not None:
        _write(base, content)
    new = _write(tmp_path / "new.json", BASE)
    status, out, err = _diff(capsys, base, new)
    assert status == 2
    assert out == ""
    assert err.startswith("pytest-gradref diff: error: ")
    assert why in err


@pytest.mark.parametrize(
    ("tests", "why"),
    [
        (
            [_test("u.py::test_other", _item("value", 1e-7))],
            "no test in common: {base} holds 3 tests (e.g. t.py::test_a), {new} 1 test (e.g. "
            "u.py::test_other); compare reports of the same suite, written from the same rootdir",
        ),
        (
            [_test("t.py::test_a"), _test("t.py::test_gone")],
            "2 tests in common, but no item in both (e.g. t.py::test_a: 2 in {base}, 0 in {new}); "
            "a test records an item for each value it compares (assert_close)",
        ),
        (
            [_test("t.py::test_gone", _item("output", 1e-7))],
            "1 test in common, but no item in both (e.g. t.py::test_gone: 1 in {base}, 1 in "
            "{new}); their items' labels differ",
        ),
        ([], "{new} holds no test record (no test in it used grad_reference)"),
    ],
    ids=["no-test-in-common", "no-items", "other-labels", "empty"],
)
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_nothing_compared_exits_2_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tests: Any, why: str, fmt: str
) -> None:
    base, new = _pair(tmp_path, {**BASE, "tests": tests})
    status, out, err = _diff(capsys, base, new, f"--format={fmt}")
    assert status == 2, "0 regressions in 0 compared items is no pass"
    assert out == ""
    assert err.startswith("pytest-gradref diff: error: nothing to compare: ")
    assert why.format(base=base, new=new) in err


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--threshold", "0.99", "must be a number >= 1, got '0.99'"),
        ("--threshold", "nan", "must be a number >= 1, got 'nan'"),
        ("--floor", "0", "must be a number > 0, got '0'"),
        ("--noise", "-1", "must be a number >= 0, got '-1'"),
        ("--noise", "four steps", "not a number: 'four steps'"),
    ],
)
def test_bad_arguments_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str, value: str, message: str
) -> None:
    base, new = _pair(tmp_path, BASE)
    with pytest.raises(SystemExit) as exited:
        main(["diff", str(base), str(new), option, value])
    assert exited.value.code == 2
    assert f"argument {option}: {message}" in capsys.readouterr().err


def test_threshold_of_one_and_noise_of_zero_are_accepted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, new = _pair(tmp_path, BASE)
    assert _diff(capsys, base, new, "--threshold", "1", "--noise", "0")[0] == 0


MARKDOWN = """\
### gradref diff: **precision regression**

1 regression in 4 compared items (threshold 2x; errors within 4 rounding steps of their dtype \
at their scale count as noise; a half-precision item's normwise error drifts when it grows past \
6 sigmas of its rounding noise).

- base `{base}`: device=cpu backend=cpu strategy=autograd seed=0 torch=2.13.0+cpu (3 tests)
- new `{new}`: device=cpu backend=cpu strategy=autograd seed=0 torch=2.13.0+cpu (2 tests)

| | ratio | before | after | headroom before -> after | dtype | test | item |
|---|---:|---:|---:|---:|---|---|---|
| :x: error grew 5x | 5x | 2e-06 | 1e-05 | 50.0% -> 20.0% | float32 | `t.py::test_a` | \
gradient of argument 0 (x) |
|  | 1x | 1e-07 | 1e-07 | 50.0% -> 50.0% | float32 | `t.py::test_a` | value |
|  | 1x | 0 | 0 | 100.0% -> 100.0% | float32 | `t.py::test_b` | value |
|  | 1x | 3e-07 | 3e-07 | 50.0% -> 50.0% | float32 | `t.py::test_b` | value #2 |

Only in base (coverage that vanished): 1

- `t.py::test_gone`
"""


def test_markdown_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    new = _changed(
        **{
            "t.py::test_a": _test(
                "t.py::test_a",
                _item("value", 1e-7),
                _item("gradient of argument 0 (x)", 1e-5, headroom=0.2),
            ),
            "t.py::test_b": BASE["tests"][1],
        }
    )
    base, new_path = _pair(tmp_path, new)
    status, out, _ = _diff(capsys, base, new_path, "--format=markdown")
    assert status == 1
    assert out == MARKDOWN.format(base=base, new=new_path)


def test_a_ratio_taken_above_the_noise_floor_is_marked(tmp_path: Path) -> None:
    # Rows as the noise model makes them (built here, so that the test does not hang on how it
    # computes the floor): 1e-8 -> 6e-7 under a floor of 1e-7 is judged 6x, not 60x.
    base, new = _pair(tmp_path, BASE)
    diff = diff_module.compare_reports(diff_module.load_report(base), diff_module.load_report(new))
    raised = diff_module.ItemDiff(
        nodeid="t.py::test_a",
        label="value",
        dtype="float32",
        before=1e-8,
        after=6e-7,
        ratio=6.0,
        noise_floor=1e-7,
        headroom_before=0.99,
        headroom_after=0.4,
        passed_before=True,
        passed_after=True,
        regression="error grew 6x",
    )
    above = replace(raised, label="grad", before=1e-6, after=3e-6, ratio=3.0, regression="")
    unchanged = replace(raised, label="aux", before=1e-9, after=1e-9, ratio=1.0, regression="")
    diff.items = [raised, above, unchanged]
    legend = "the noise floor raised one error or both before the ratio was taken: it is not "
    lines = render_text(diff).splitlines()
    assert lines[-4].startswith("       6x*     1e-08      6e-07  ")
    assert lines[-4].endswith("t.py::test_a: value  <- error grew 6x")
    assert lines[-3].startswith("       3x      1e-06      3e-06  ")  # above the floor
    assert lines[-2].startswith("       1x      1e-09      1e-09  ")  # unchanged
    assert lines[-1] == f"* {legend}after / before"
    markdown = render_markdown(diff)
    assert "| :x: error grew 6x | 6x\\* | 1e-08 | 6e-07 |" in markdown
    assert "|  | 3x | 1e-06 | 3e-06 |" in markdown
    assert "|  | 1x | 1e-09 | 1e-09 |" in markdown
    assert f"\n\\* {legend}after / before.\n" in markdown
    # No row raised, no mark and no legend.
    diff.items = [above, unchanged]
    assert "*" not in render_text(diff)
    assert "\\*" not in render_markdown(diff)


def test_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, new = _pair(tmp_path, BASE)
    status, out, _ = _diff(capsys, base, new, "--format", "json")
    assert status == 0
    document = json.loads(out)
    assert document["regressions"] == 0
    assert document["base"]["base_seed"] == 0
    assert document["threshold"] == 2.0
    assert len(document["items"]) == 5
    assert {item["ratio"] for item in document["items"]} == {1.0}


def test_top_limits_the_rows_but_not_the_regressions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, new = _pair(tmp_path, BASE)
    out = _diff(capsys, base, new, "--top", "2")[1]
    assert "... 3 more items (--top 0 shows all)" in out
    assert "more items" not in _diff(capsys, base, new, "--top", "0")[1]


def test_plot_without_matplotlib_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = builtins.__import__

    def blocked(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", blocked)
    base, new = _pair(tmp_path, BASE)
    status, out, err = _diff(capsys, base, new, "--plot", tmp_path / "p.png")
    assert status == 2
    assert out == ""
    assert "--plot needs matplotlib" in err
    assert "pip install 'pytest-gradref[plot]'" in err
    assert not (tmp_path / "p.png").exists()


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    new = copy.deepcopy(BASE)
    new["tests"][0]["items"][1]["max_abs"] = 1e-5
    base, new_path = _pair(tmp_path, new)
    status, _, err = _diff(capsys, base, new_path, "--plot", tmp_path / "p.png")
    assert status == 1
    assert "plot written to" in err
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_that_cannot_be_written_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    base, new = _pair(tmp_path, BASE)
    status, out, err = _diff(capsys, base, new, "--plot", tmp_path / "no" / "such" / "p.png")
    assert status == 2
    assert "0 regressions" in out, "the comparison is shown before the plot is written"
    assert "pytest-gradref diff: error: cannot write the plot: " in err


def test_module_and_console_script(tmp_path: Path) -> None:
    from importlib.metadata import distribution

    # The distribution's own entry points: entry_points(group=...) needs Python 3.10.
    scripts = distribution("pytest-gradref").entry_points
    assert [
        ep.value for ep in scripts if ep.group == "console_scripts" and ep.name == "pytest-gradref"
    ] == ["pytest_gradref.__main__:main"]
    base, new = _pair(tmp_path, BASE)
    done = subprocess.run(
        [sys.executable, "-m", "pytest_gradref", "diff", str(base), str(new)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "0 regressions in 5 compared items" in done.stdout
    # The command loads neither torch nor pytest.
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pytest_gradref.__main__ import main; main(sys.argv[1:]); "
            "print(sorted(m for m in sys.modules if m in ('torch', 'pytest')))",
            "diff",
            str(base),
            str(new),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout.splitlines()[-1] == "[]"


# One rounding step of float32 at the scale of the sum item ATen's scalar path moved: 5.6e-8.
SUM_SCALE = 5.6e-8 / diff_module.EPSILONS["float32"]


@pytest.mark.parametrize(
    ("scale", "before", "after", "regressed"),
    [
        # (error, headroom) at the item's scale, float32. The two items of an AMD EPYC host
        # that moved beyond 2x from the AMX baseline (2.02x and 2.23x), rounding noise: at a
        # scale of 0.05-0.1 (their reports predate scales) under three float32 steps.
        (0.1, (1.46e-8, 0.960), (2.95e-8, 0.919), False),
        (0.05, (5.22e-9, 0.971), (1.16e-8, 0.936), False),
        # ATen's scalar path on this host: a float32 sum from one rounding step to four (5.4e-8
        # to 2.2e-7 at a step of 5.6e-8), noise ...
        (SUM_SCALE, (5.4e-8, 0.995), (2.2e-7, 0.979), False),
        # ... and from ten steps to twenty-five, 2.5x, caught though it uses a twentieth of its
        # tolerance before and an eighth after (a tenth of the allowance as noise judged 1.3x).
        (SUM_SCALE, (5.6e-7, 0.947), (1.4e-6, 0.868), True),
        # A real error, some thirty steps, grown fourfold: caught.
        (0.05, (2e-7, 0.8), (8e-7, 0.2), True),
        # Fourfold from just over the noise (4.2 steps to 17): caught.
        (1.0, (5e-7, 0.95), (2e-6, 0.8), True),
        # Tenfold growth within a step: not a regression.
        (1.0, (1e-8, 0.999), (1e-7, 0.99), False),
    ],
    ids=[
        "epyc-2.02x",
        "epyc-2.23x",
        "host-sum-1-to-4-steps",
        "host-sum-10-to-25-steps",
        "fourfold-from-30-steps",
        "fourfold-from-the-noise",
        "tenfold-within-a-step",
    ],
)
def test_growth_is_judged_in_rounding_steps_of_the_dtype_at_the_scale(
    tmp_path: Path,
    scale: float,
    before: tuple[float, float],
    after: tuple[float, float],
    regressed: bool,
) -> None:
    def report(error: float, headroom: float) -> dict[str, Any]:
        document = copy.deepcopy(BASE)
        document["tests"] = [
            _test("t.py::test_a", _item("value", error, headroom=headroom, scale=scale))
        ]
        return document

    base, new = (
        _write(tmp_path / "b.json", report(*before)),
        _write(tmp_path / "n.json", report(*after)),
    )
    result = diff_module.compare_reports(
        diff_module.load_report(base), diff_module.load_report(new)
    )
    [item] = result.items
    step = diff_module.EPSILONS["float32"] * scale
    assert item.noise_floor == pytest.approx(diff_module.DEFAULT_NOISE * step)
    assert bool(result.regressions) is regressed
    if regressed:
        assert item.regression == f"error grew {item.ratio:.3g}x"
    # Judged raw, every one of them grew beyond the threshold.
    raw = diff_module.compare_reports(
        diff_module.load_report(base), diff_module.load_report(new), noise=0
    )
    assert len(raw.regressions) == 1


def test_a_budgeted_bf16_error_grown_past_a_few_steps_is_flagged_whatever_its_headroom(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A bf16 gradient judged by a budget against its float64 golden: a generous allowance, so
    # its error grew nineteenfold (1.98 to 38.1, half a bf16 step at its scale to 9.6) while
    # the headroom only went from 99.4% to 89.1%. The old rule (a tenth of the allowance as
    # noise) called that noise; ten steps of bf16 are not.
    scale = 507.0  # a bf16 step there: 3.96
    base, new = (
        _write(
            tmp_path / name,
            {
                **BASE,
                "tests": [
                    _test(
                        "t.py::test_a",
                        _item(
                            "gradient of argument 0 (x)",
                            error,
                            headroom,
                            dtype="bfloat16",
                            scale=scale,
                        ),
                    )
                ],
            },
        )
        for name, error, headroom in (("b.json", 1.98, 0.994), ("n.json", 38.1, 0.891))
    )
    [item] = diff_module.compare_reports(
        diff_module.load_report(base), diff_module.load_report(new)
    ).items
    step = diff_module.EPSILONS["bfloat16"] * scale
    assert (item.before / step, item.after / step) == (
        pytest.approx(0.5, rel=0.01),
        pytest.approx(9.62, rel=0.01),
    )
    assert item.ratio == pytest.approx(38.1 / (diff_module.DEFAULT_NOISE * step))  # 2.4x
    assert item.regression == "error grew 2.4x"
    status, out, _ = _diff(capsys, base, new)
    assert status == 1
    assert (
        "     2.4x*      1.98       38.1            99.4% -> 89.1%  bfloat16  "
        "t.py::test_a: gradient of argument 0 (x)  <- error grew 2.4x" in out
    )


def test_normwise_growth_alone_is_flagged_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A systematic error spread over many elements: the greatest error unchanged (8 float32
    # steps at the scale of 1), the normwise error tenfold, from 8 steps of float32 to 84.
    def report(norm_rel: float) -> dict[str, Any]:
        item = _item("gradient of argument 0 (x)", 1e-6, norm_rel=norm_rel)
        return {**BASE, "tests": [_test("t.py::test_a", item)]}

    base, new = _write(tmp_path / "b.json", report(1e-6)), _write(tmp_path / "n.json", report(1e-5))
    [item] = diff_module.compare_reports(
        diff_module.load_report(base), diff_module.load_report(new)
    ).items
    assert (item.before, item.after) == (1e-6, 1e-6)
    assert item.normwise
    assert item.ratio == pytest.approx(10)
    assert item.regression == "normwise error grew 10x"
    status, out, _ = _diff(capsys, base, new)
    assert status == 1
    assert "t.py::test_a: gradient of argument 0 (x)  <- normwise error grew 10x" in out
    markdown = _diff(capsys, base, new, "--format=markdown")[1]
    assert "| :x: normwise error grew 10x | 10x | 1e-06 | 1e-06 |" in markdown
    [row] = json.loads(_diff(capsys, base, new, "--format=json")[1])["items"]
    assert (row["norm_before"], row["norm_after"], row["normwise"]) == (1e-6, 1e-5, True)
    # Tenfold within the noise (0.34 float32 steps to 3.4; four are 4.8e-7) is not flagged.
    quiet = _write(tmp_path / "q0.json", report(4e-8)), _write(tmp_path / "q1.json", report(4e-7))
    assert _diff(capsys, *quiet)[0] == 0


def _format_1(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` as a format-1 report: its items without scale and normwise error."""
    old = copy.deepcopy(document)
    old["format_version"] = 1
    for test in old["tests"]:
        for item in test["items"]:
            item.pop("scale", None)
            item.pop("norm_rel", None)
    return old


@pytest.mark.parametrize("versions", [(1, 1), (1, 2), (2, 1)], ids=["1-1", "1-2", "2-1"])
def test_a_format_1_report_compares_with_the_absolute_floor_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], versions: tuple[int, int]
) -> None:
    # test_a's gradient grows fourfold well above the noise (17 float32 steps to 67 at the scale
    # of 1); test_b's second value fourfold within it (0.08 steps to 0.34), which only a report
    # with a scale can tell from a regression.
    new = copy.deepcopy(BASE)
    new["tests"][0]["items"][1].update(max_abs=8e-6, norm_rel=8e-6)
    new["tests"][1]["items"][1]["max_abs"] = 4e-8
    old = copy.deepcopy(BASE)
    old["tests"][0]["items"][1]["norm_rel"] = 2e-6
    old["tests"][1]["items"][1]["max_abs"] = 1e-8
    documents = [
        _format_1(d) if v == 1 else {**d, "format_version": v} for d, v in zip((old, new), versions)
    ]
    base, new_path = (
        _write(tmp_path / "b.json", documents[0]),
        _write(tmp_path / "n.json", documents[1]),
    )
    result = diff_module.compare_reports(
        diff_module.load_report(base), diff_module.load_report(new_path)
    )
    assert (result.base.format_version, result.new.format_version) == versions
    grown = {(i.nodeid, i.label): i for i in result.items}
    gradient = grown["t.py::test_a", "gradient of argument 0 (x)"]
    assert gradient.regression == "error grew 4x"
    assert not gradient.normwise  # a normwise error on one side only (or none): unjudged
    small = grown["t.py::test_b", "value #2"]
    if versions == (1, 1):  # no scale on either side: the absolute floor (1e-12) alone
        assert small.noise_floor == diff_module.DEFAULT_FLOOR
        assert small.regression == "error grew 4x"
    else:  # the side with a scale gives the noise floor
        assert small.noise_floor == pytest.approx(4 * diff_module.EPSILONS["float32"])
        assert not small.regression
    status, out, _ = _diff(capsys, base, new_path)
    assert status == 1
    assert f"{len(result.regressions)} regression" in out


def _crosscheck(document: dict[str, Any], backend: str, default: str) -> dict[str, Any]:
    """``document`` as a crosscheck run on ``backend``: its tests received ``default``."""
    moved = _on_device(document, backend, default)
    moved.update(strategy="crosscheck", strategy_is_default=False, default_strategy=default)
    return moved


def test_a_crosscheck_report_compares_across_devices_as_a_default_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cpu = _crosscheck(BASE, "cpu", "autograd")
    npu = _on_device(BASE, "npu", "grad_and_value")
    base, new = _write(tmp_path / "base.json", cpu), _write(tmp_path / "new.json", npu)
    status, out, _ = _diff(capsys, base, new)
    assert status == 0
    assert "compared despite a mismatch" not in out
    # On one backend, against a strategy an option chose, the refusal names the crosscheck.
    chosen = _on_device(BASE, "cpu", "grad_and_value")
    chosen["strategy_is_default"] = False
    status, _, err = _diff(capsys, base, _write(tmp_path / "chosen.json", chosen))
    assert status == 2
    assert (
        "['autograd'] in base (the run was a crosscheck: its tests received cpu's default, "
        "autograd), ['grad_and_value'] in new (grad_and_value chosen for the run by "
        "--gradref-strategy or its env/ini)" in err
    )


def test_the_header_names_every_device_a_report_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    two = _on_device(BASE, "npu", "grad_and_value")
    two.update(devices=["npu:0", "npu:1"], simulated=True)  # a -n 2 run
    one = _on_device(BASE, "npu", "grad_and_value")
    one["devices"] = ["npu:0"]
    old = _on_device(BASE, "npu", "grad_and_value")  # written before reports had devices
    paths = {
        name: _write(tmp_path / f"{name}.json", doc)
        for name, doc in (("two", two), ("one", one), ("old", old))
    }
    status, out, _ = _diff(capsys, paths["two"], paths["one"])
    assert status == 0
    assert f"base: {paths['two']}: devices=npu:0,npu:1 (simulated) backend=npu " in out
    assert f"new:  {paths['one']}: device=npu:0 backend=npu " in out
    _, out, _ = _diff(capsys, "--format=markdown", paths["old"], paths["two"])
    assert f"- base `{paths['old']}`: device=npu:0 backend=npu " in out
    assert f"- new `{paths['two']}`: devices=npu:0,npu:1 (simulated) backend=npu " in out
    # A devices field that is no list of names is refused, and says what it got.
    old["devices"] = "npu:0"
    status, _, err = _diff(capsys, _write(tmp_path / "bad.json", old), paths["one"])
    assert status == 2
    assert "bad.json: devices must be a list of device names, got 'npu:0'" in err


def test_simulated_against_real_shows_changes_without_calling_them_regressions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cuda = _on_device(BASE, "cuda", "autograd")
    npu = _on_device(BASE, "npu", "grad_and_value")
    npu["simulated"] = True
    npu["tests"][0]["items"][1]["max_abs"] = 8e-6  # grew 4x on the simulated npu
    base, new = _write(tmp_path / "base.json", cuda), _write(tmp_path / "new.json", npu)
    status, out, _ = _diff(capsys, base, new)
    assert status == 0
    assert "device=npu:0 (simulated) backend=npu" in out
    assert "note: new ran on a simulated device, the other on a real one: " in out
    assert "0 regressions in 5 compared items" in out
    assert (
        "50.0% -> 50.0%   float32  t.py::test_a: gradient of argument 0 (x)  <- error grew 4x "
        "(not counted: see the note)" in out
    )
    # A failure or a NaN is one on any device: it counts across simulated and real too.
    failing = copy.deepcopy(npu)
    failing["tests"][0]["items"][0]["passed"] = False
    failing["tests"][1]["items"][1]["max_abs"] = "nan"
    status, out, _ = _diff(capsys, base, _write(tmp_path / "failing.json", failing))
    assert status == 1
    assert "2 regressions in 5 compared items" in out
    assert "now fails" in out
    assert "error is now NaN" in out
    # Two simulated reports gate as two real ones do.
    cuda["simulated"] = True
    status, out, _ = _diff(capsys, _write(tmp_path / "sim.json", cuda), new)
    assert status == 1
    assert "1 regression in 5 compared items" in out
    # ... unless they model other numerics (--gradref-simulate-numerics): then the change is
    # the model's, shown and not counted.
    ascend = copy.deepcopy(npu)
    ascend["simulated_numerics"] = "ascend"
    status, out, _ = _diff(
        capsys, _write(tmp_path / "sim.json", cuda), _write(tmp_path / "a.json", ascend)
    )
    assert status == 0
    assert "note: base ran the simulated npu with cpu numerics, new with ascend " in out
    assert "<- error grew 4x (not counted: see the note)" in out


def test_a_full_precision_items_noise_is_at_least_its_references_own_error(
    tmp_path: Path,
) -> None:
    # The kernel suite's close-student loss (float32, about 1e-6): a summation-order change
    # moved its error from 1.5e-12 to 4.9e-12, 12 to 41 rounding steps of its own scale, within
    # what a plain float32 reference errs there: noise of an ill-conditioned item.
    def report(error: float, dtype: str, reference: float) -> dict[str, Any]:
        document = copy.deepcopy(BASE)
        item = _item("value", error, dtype=dtype, scale=1e-6, norm_rel=error / 1e-6)
        item["reference_error"] = reference
        item["reference_norm_rel"] = reference / 1e-6
        document["tests"] = [_test("t.py::test_close", item)]
        return document

    def compare(before: float, after: float, dtype: str, reference: float) -> Any:
        base = _write(tmp_path / "b.json", report(before, dtype, reference))
        new = _write(tmp_path / "n.json", report(after, dtype, reference))
        return diff_module.compare_reports(
            diff_module.load_report(base), diff_module.load_report(new)
        )

    noise = compare(1.5e-12, 4.9e-12, "float32", 5e-12)
    assert not noise.regressions
    assert noise.items[0].noise_floor == pytest.approx(5e-12)
    # Past the reference's own error, growth counts again.
    assert compare(1.5e-12, 2e-11, "float32", 5e-12).regressions
    # A reference's error counts up to REFERENCE_NOISE_STEPS steps, no further: a formula as
    # unstable as a plain reference's (here one erring 8,400 steps) is still caught.
    step = diff_module.EPSILONS["float32"] * 1e-6
    capped = compare(3.6e-12, 5.8e-10, "float32", 1e-9)
    assert capped.items[0].noise_floor == pytest.approx(diff_module.REFERENCE_NOISE_STEPS * step)
    assert capped.regressions
    # bf16 items are judged in steps alone: a naive bf16 reference's error (here 128 steps)
    # says nothing of a float32-internal kernel's, whose growth from 6 steps to 64 is caught.
    assert compare(5e-8, 5e-7, "bfloat16", 1e-6).regressions


def _half_precision_report(norm_rel: float, numel: int | None, dtype: str = "bfloat16") -> Any:
    """One gradient item of a half-precision dtype at the scale of 1, whose greatest error
    (half a step) stays put while its normwise error is ``norm_rel``."""
    document = copy.deepcopy(BASE)
    item = _item(
        "gradient of argument 0 (x)",
        diff_module.EPSILONS[dtype] / 2,
        dtype=dtype,
        norm_rel=norm_rel,
    )
    if numel is not None:
        item["numel"] = numel
    document["tests"] = [_test("t.py::test_a", item)]
    return document


def test_a_half_precision_normwise_drift_beyond_its_rounding_noise_is_flagged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A bf16 gradient of 4,371 elements (the kernel suite's 3x47x31 grad_input) whose normwise
    # error went from 0.2% to 0.23%: far below the 2x threshold and within four bf16 steps,
    # but 15% is beyond what re-drawn roundings of that many elements explain (about 4%).
    def compare(before: float, after: float, numel: int | None, dtype: str = "bfloat16") -> Any:
        base = _write(tmp_path / "b.json", _half_precision_report(before, numel, dtype))
        new = _write(tmp_path / "n.json", _half_precision_report(after, numel, dtype))
        return base, new, diff_module.compare_reports(*map(diff_module.load_report, (base, new)))

    base, new, drifted = compare(2.0e-3, 2.3e-3, 4371)
    [item] = drifted.items
    assert item.drift_band == pytest.approx(1 + 6 * 0.447 / 4371**0.5)  # 1.041
    assert item.normwise
    assert item.ratio == pytest.approx(1.15)
    assert item.regression == (
        "normwise error drifted 1.15x (0.002 -> 0.0023): rounding noise moves it 1.04x at most "
        "over 4371 elements"
    )
    status, out, _ = _diff(capsys, base, new)
    assert status == 1
    assert "<- normwise error drifted 1.15x" in out
    [row] = json.loads(_diff(capsys, base, new, "--format=json")[1])["items"]
    assert (row["numel"], row["drift_band"]) == (4371, pytest.approx(item.drift_band))
    assert row["kind"] == "drifted"
    # The same in float16; shrinking errors are no drift.
    assert compare(2.0e-3, 2.3e-3, 4371, "float16")[2].regressions
    assert not compare(2.3e-3, 2.0e-3, 4371)[2].regressions
    # Within the band: no regression.
    assert not compare(2.0e-3, 2.06e-3, 4371)[2].regressions
    # Few elements (the band leans on many), an unknown size (a report from before the size
    # was recorded) and a float32 item keep the noise floor of four steps.
    assert not compare(2.0e-3, 2.3e-3, 100)[2].regressions
    assert not compare(2.0e-3, 2.3e-3, None)[2].regressions
    assert compare(2.0e-3, 2.3e-3, 4371)[2].items[0].drift_band < 1.05
    float32 = diff_module.EPSILONS["float32"]
    assert not compare(2 * float32, 2.3 * float32, 4371, "float32")[2].regressions
    # Errors of nearly exact items (under a sixteenth of a step) are raised to that before the
    # ratio: a few more elements off by a step is no drift.
    sixteenth = diff_module.EPSILONS["bfloat16"] / 16
    assert not compare(sixteenth / 4, sixteenth, 4371)[2].regressions


def _bf16_matmul_errors(
    blocks: int, *, rounded_twice: bool, reverse: bool = False
) -> tuple[float, float, int]:
    """The greatest and normwise relative error against float64 of a bf16 matmul gradient
    (x^T @ g, 3,813 elements, a reduction over 2,048 rows) accumulated in float32 over
    ``blocks`` blocks of the reduction (reversed), rounded to bf16 once, or (``rounded_twice``)
    each block's partial sum to bf16 too: the kernel suite's bf16 weight-gradient accumulation
    regression."""
    import torch

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 123, generator=generator).to(torch.bfloat16)
    g = torch.randn(2048, 31, generator=generator)  # float32: its products round
    golden = x.double().T @ g.double()
    parts = list(zip(x.split(-(-2048 // blocks)), g.split(-(-2048 // blocks))))
    total = torch.zeros(123, 31)
    for xs, gs in reversed(parts) if reverse else parts:
        partial = xs.float().T @ gs.float()
        total += partial.bfloat16().float() if rounded_twice else partial
    actual = total.bfloat16().double()
    error = actual - golden
    return (
        float(error.abs().max() / golden.abs().max()),
        float(error.norm() / golden.norm()),
        actual.numel(),
    )


def test_summation_order_is_no_drift_and_a_second_rounding_is(tmp_path: Path) -> None:
    # Real bf16 roundings: the same matmul accumulated in float32 in 1, 3, 7 or 16 blocks,
    # forwards or reversed (what another CPU path or thread count does), against the same
    # accumulated with each block rounded to bf16 first (what a bf16 accumulator does).
    def report(errors: tuple[float, float, int]) -> dict[str, Any]:
        greatest, normwise, numel = errors
        document = _half_precision_report(normwise, numel)
        document["tests"][0]["items"][0].update(max_abs=greatest, max_rel=greatest)
        return document

    def judged(before: tuple[float, float, int], after: tuple[float, float, int]) -> Any:
        base = _write(tmp_path / "b.json", report(before))
        new = _write(tmp_path / "n.json", report(after))
        return diff_module.compare_reports(*map(diff_module.load_report, (base, new))).items[0]

    once = {
        (blocks, reverse): _bf16_matmul_errors(blocks, rounded_twice=False, reverse=reverse)
        for blocks in (1, 3, 7, 16)
        for reverse in (False, True)
    }
    baseline = once[(1, False)]
    for errors in once.values():
        item = judged(baseline, errors)
        assert not item.regression, item
    twice = judged(baseline, _bf16_matmul_errors(7, rounded_twice=True))
    assert twice.regression.startswith("normwise error drifted"), twice


def test_an_item_as_noisy_as_its_reference_is_judged_at_its_references_noise(
    tmp_path: Path,
) -> None:
    # The kernel suite's close-student gradient (float32, scale 1.1e-4: a step is 1.3e-11)
    # errs 280 steps, as much as its plain float32 reference: a cancellation's noise. ATen's
    # scalar path moved it 2.23x, and the reference's error 1.42x: no regression. A kernel that
    # erred a tenth of its reference there (digits it earned) and loses most is one.
    def report(error: float, reference: float) -> dict[str, Any]:
        document = copy.deepcopy(BASE)
        item = _item("gradient of argument 0 (x)", error, scale=1.09e-4)
        item["reference_error"] = reference
        document["tests"] = [_test("t.py::test_close", item)]
        return document

    def compare(before: tuple[float, float], after: tuple[float, float]) -> Any:
        base = _write(tmp_path / "b.json", report(*before))
        new = _write(tmp_path / "n.json", report(*after))
        return diff_module.compare_reports(
            diff_module.load_report(base), diff_module.load_report(new)
        )

    noise = compare((3.78e-9, 3.63e-9), (8.42e-9, 5.14e-9))
    assert not noise.regressions
    assert noise.items[0].noise_floor == pytest.approx(5.14e-9)
    assert noise.items[0].ratio == pytest.approx(8.42 / 5.14)
    earned = compare((3.6e-10, 3.63e-9), (2.0e-9, 3.63e-9))
    step = diff_module.EPSILONS["float32"] * 1.09e-4
    assert earned.items[0].noise_floor == pytest.approx(diff_module.REFERENCE_NOISE_STEPS * step)
    [regression] = earned.regressions
    assert regression.regression == "error grew 2.4x"


def test_a_drift_and_a_growth_count_alike_across_a_simulated_and_a_real_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The two kinds of a change of the error's size: a 3.2x growth of the greatest error and a
    # 1.15x drift of a bf16 gradient's normwise error. Between two real reports both count;
    # between a simulated and a real one neither does (the devices' numerics move both), each
    # shown with its kind, decided on the numbers and not on the message.
    def pair(before: float, after: float, max_after: float) -> tuple[Any, Any]:
        old = _on_device(_half_precision_report(before, 4371), "cuda", "autograd")
        new = _on_device(_half_precision_report(after, 4371), "npu", "autograd")
        new["tests"][0]["items"][0]["max_abs"] = max_after
        return old, new

    half_step = diff_module.EPSILONS["bfloat16"] / 2
    cases = {
        diff_module.RegressionKind.DRIFTED: pair(2.0e-3, 2.3e-3, half_step),
        diff_module.RegressionKind.GREW: pair(2.0e-3, 2.0e-3, 4 * 3.2 * 2 * half_step),
    }
    for kind, (old, new) in cases.items():
        real = diff_module.compare_reports(
            *map(diff_module.parse_report, (old, new), "bn"), allow_mismatch=True
        )
        [item] = real.items
        assert (item.kind, bool(item.regression), item.uncounted) == (kind, True, "")
        new["simulated"] = True
        simulated = diff_module.compare_reports(
            *map(diff_module.parse_report, (old, new), "bn"), allow_mismatch=True
        )
        [item] = simulated.items
        assert (item.kind, item.regression) == (kind, "")
        assert item.uncounted.startswith(("error grew", "normwise error drifted"))
        assert not simulated.regressions


@pytest.mark.parametrize(
    "name",
    ["float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128"],
)
def test_reports_are_read_with_the_verdicts_epsilons(name: str) -> None:
    # One table, torch.finfo's, for the verdict and for the diff, which imports no torch.
    import torch

    from pytest_gradref.verdict.dtypes import epsilon

    dtype = getattr(torch, name)
    real = dtype.to_real() if dtype.is_complex else dtype
    assert diff_module.EPSILONS[name] == torch.finfo(real).eps == epsilon(dtype)
