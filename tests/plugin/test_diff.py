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

from pytest_gradref import diff as diff_module
from pytest_gradref.__main__ import main
from pytest_gradref.diff_output import render_markdown, render_text
from pytest_gradref.report import FORMAT_VERSION

# A kernel whose gradient is off by a relative error that the environment sets. float64's
# default tolerance is rtol = atol = 1e-7: at 2.5e-8 the error uses a real share of it (about a
# fifth) and at 1e-7 most of it, a fourfold growth that still passes; at 1e-10 and 4e-10 it
# grows fourfold too, within a thousandth of the allowance: noise.
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
        "0 regressions in 6 compared items (threshold 2x; errors under 10% of their allowance "
        "count as noise)"
    ) in out
    assert "<-" not in out

    status, out, _ = _diff(capsys, base, worse)
    assert status == 1
    assert "2 regressions in 6 compared items" in out
    lines = out.splitlines()
    table = lines[lines.index(next(x for x in lines if x.lstrip().startswith("ratio"))) + 1 :]
    # Worst first: the two skewed gradients, each about 4x, then the unchanged items.
    for row in table[:2]:
        assert "gradient of argument 0 (x)  <- error grew 4" in row
        assert float(row.split()[0].rstrip("x")) == pytest.approx(4, rel=0.05)
    assert all("<-" not in row for row in table[2:])
    # A threshold above the growth lets it pass.
    assert _diff(capsys, base, worse, "--threshold", "5")[0] == 0


def test_fourfold_growth_within_a_negligible_share_of_the_allowance_is_noise(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytester.makepyfile(test_suite=SKEWED_KERNEL)
    base = _run_suite(pytester, monkeypatch, "base.json", "1e-10")
    worse = _run_suite(pytester, monkeypatch, "worse.json", "4e-10")
    capsys.readouterr()
    report = diff_module.compare(diff_module.load_report(base), diff_module.load_report(worse))
    grown = [item for item in report.items if item.label.startswith("gradient of argument 0")]
    assert len(grown) == 2
    for item in grown:
        assert item.after / item.before == pytest.approx(4, rel=0.05)  # it did grow fourfold
        assert item.after < item.noise_floor  # ... within a tenth of its allowance
        assert item.ratio == 1.0
    assert not report.regressions
    # Without the noise rule (an absolute floor alone) the same growth is flagged.
    status, out, _ = _diff(capsys, base, worse, "--noise", "1e-9")
    assert status == 1
    assert "2 regressions in 6 compared items" in out


def _item(label: str, max_abs: Any, headroom: Any = 0.5, passed: bool = True) -> dict[str, Any]:
    return {
        "label": label,
        "dtype": "float32",
        "max_abs": max_abs,
        "max_rel": max_abs,
        "criterion": "rtol=1.3e-06, atol=1e-05 from torch.testing's default for float32",
        "headroom": headroom,
        "passed": passed,
    }


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
    result = diff_module.compare(diff_module.load_report(base), diff_module.load_report(new_path))
    assert [(i.nodeid, i.label) for i in result.regressions] == [("t.py::test_b", "value #2")]


def test_items_with_a_rounded_error_compare_with_items_without(tmp_path: Path) -> None:
    # A budget with a rounded reference records rounded_error; a report from before that field
    # (or from a run without rounded=True) still compares item by item, by max_abs.
    new = copy.deepcopy(BASE)
    value, gradient = new["tests"][0]["items"]
    value.update(rounded_error=4e-7, criterion="budget 2x the bfloat16-rounded reference's ...")
    gradient.update(rounded_error=1e-6, max_abs=8e-6)
    base, new_path = _pair(tmp_path, new)
    result = diff_module.compare(diff_module.load_report(base), diff_module.load_report(new_path))
    assert [(i.label, i.ratio) for i in result.regressions] == [
        ("gradient of argument 0 (x)", pytest.approx(4))
    ]


def test_floor_keeps_exact_zeros_from_giving_infinite_ratios(tmp_path: Path) -> None:
    new = copy.deepcopy(BASE)
    new["tests"][1]["items"][0]["max_abs"] = 1e-13  # was exactly 0
    base, new_path = _pair(tmp_path, new)
    reports = diff_module.load_report(base), diff_module.load_report(new_path)
    result = diff_module.compare(*reports)
    item = next(i for i in result.items if i.label == "value" and i.nodeid.endswith("test_b"))
    assert item.ratio == 1.0
    assert not result.regressions
    # Above the floor, zero to 1e-13 is a growth of 1e-13 / 1e-15 = 100x.
    lower = diff_module.compare(*reports, floor=1e-15)
    assert [i.label for i in lower.regressions] == ["value"]
    assert lower.regressions[0].ratio == pytest.approx(100)


def test_nan_error_and_a_newly_failing_item_are_regressions(tmp_path: Path) -> None:
    new = copy.deepcopy(BASE)
    new["tests"][0]["items"][0]["max_abs"] = "nan"
    new["tests"][0]["items"][1].update(headroom=-0.2, passed=False)  # same error, now fails
    base, new_path = _pair(tmp_path, new)
    result = diff_module.compare(diff_module.load_report(base), diff_module.load_report(new_path))
    assert {i.label: i.regression for i in result.regressions} == {
        "value": "error is now NaN",
        "gradient of argument 0 (x)": "now fails",
    }


def test_mismatched_seeds_are_refused_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = copy.deepcopy(BASE)
    new["base_seed"] = 7
    base, new_path = _pair(tmp_path, new)
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
            "base.json: unknown report format version 99; this pytest-gradref reads version 1",
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
        ("--noise", "-0.1", "must be a number >= 0, got '-0.1'"),
        ("--noise", "a tenth", "not a number: 'a tenth'"),
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

1 regression in 4 compared items (threshold 2x; errors under 10% of their allowance count as noise).

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
    diff = diff_module.compare(diff_module.load_report(base), diff_module.load_report(new))
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


def test_format_versions_agree() -> None:
    assert FORMAT_VERSION in diff_module.FORMAT_VERSIONS


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


@pytest.mark.parametrize(
    ("before", "after", "regressed"),
    [
        # (error, share of its allowance used): the two items of an AMD EPYC host that moved
        # beyond 2x from the AMX baseline, rounding noise at 3-8% of what they were allowed.
        ((1.46e-8, 0.040), (2.95e-8, 0.081), False),
        ((5.22e-9, 0.029), (1.16e-8, 0.064), False),
        # A real error, a fifth of its allowance, grown fourfold: caught.
        ((2e-7, 0.2), (8e-7, 0.8), True),
        # From just over a twentieth of the allowance, fourfold: caught.
        ((3e-8, 0.06), (1.2e-7, 0.24), True),
        # Tenfold growth inside the noise share: not a regression.
        ((1e-9, 0.005), (1e-8, 0.05), False),
    ],
)
def test_growth_is_judged_in_units_of_the_allowance(
    tmp_path: Path, before: tuple[float, float], after: tuple[float, float], regressed: bool
) -> None:
    def report(error: float, share: float) -> dict[str, Any]:
        document = copy.deepcopy(BASE)
        document["tests"] = [_test("t.py::test_a", _item("value", error, headroom=1 - share))]
        return document

    base, new = (
        _write(tmp_path / "b.json", report(*before)),
        _write(tmp_path / "n.json", report(*after)),
    )
    result = diff_module.compare(diff_module.load_report(base), diff_module.load_report(new))
    assert bool(result.regressions) is regressed
    # Judged raw, every one of them grew beyond the threshold.
    raw = diff_module.compare(diff_module.load_report(base), diff_module.load_report(new), noise=0)
    assert len(raw.regressions) == 1


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
        "(not counted: simulated vs real)" in out
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
