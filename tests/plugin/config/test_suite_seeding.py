"""A suite that seeds its own tests: gradref notices a test that reseeds torch after it and
records it, its own seeding turns off in one ini line, and two reports (or a run and its
baseline) compare when their tests saw the same inputs, judged by a fingerprint of each
reference's inputs (pytest_gradref/reference/inputs.py), whatever the seeds."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pytest_gradref.config.settings import BASELINE_REGRESSION_EXIT, seed_for_test
from pytest_gradref.reference.inputs import SAMPLE, fingerprints, sample_inputs
from pytest_gradref.report import diff as diff_module
from pytest_gradref.report.diff import FORMAT_VERSION

# Two tests that draw their inputs from torch's global generator.
KERNELS = """
import pytest
import torch


def loss(x, w):
    return torch.tanh(x @ w).square().sum()


@pytest.mark.parametrize("n", [3, 5])
def test_kernel(grad_reference, n):
    x = torch.randn(n, 4, dtype=torch.float64)
    w = torch.randn(4, 2, dtype=torch.float64)
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = loss(xx, ww)
    out.backward()
    ref.assert_close(out, (xx.grad, ww.grad))
"""
# What many kernel libraries do: every test reseeded, after gradref has seeded it.
SET_SEED = """
import pytest
import torch


@pytest.fixture(autouse=True)
def set_seed():
    torch.manual_seed(42)
"""


def _report(pytester: pytest.Pytester, name: str, *args: str) -> dict[str, Any]:
    result = pytester.runpytest("--gradref-device=cpu", f"--gradref-report={name}", *args)
    result.assert_outcomes(passed=2)
    return json.loads((pytester.path / name).read_text())


def _tests(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {test["nodeid"].split("::")[-1]: test for test in report["tests"]}


def test_a_test_that_reseeds_torch_after_gradref_is_recorded(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(KERNELS)
    pytester.makeconftest(SET_SEED)
    result = pytester.runpytest("--gradref-device=cpu", "--gradref-report=r.json")
    result.assert_outcomes(passed=2)
    # Said whatever the verbosity: --gradref-seed changes nothing in these tests.
    result.stdout.fnmatch_lines(
        [
            "seed: 2 tests reseeded torch after gradref seeded them (e.g. "
            "test_a_test_that_reseeds_torch_after_gradref_is_recorded.py::test_kernel[[]3[]]: "
            "torch seed 42), so --gradref-seed does not change their numbers; a suite that "
            "seeds its own tests turns gradref's seeding off with gradref_seed = off in its "
            "ini file"
        ]
    )
    for test in json.loads((pytester.path / "r.json").read_text())["tests"]:
        assert test["seed"] == seed_for_test(0, test["nodeid"])
        assert (test["reseeded"], test["torch_seed"]) == (True, 42)
    pytester.makeconftest("")
    result = pytester.runpytest("--gradref-device=cpu", "--gradref-report=r.json")
    result.assert_outcomes(passed=2)
    result.stdout.no_fnmatch_line("*reseeded torch*")
    for test in json.loads((pytester.path / "r.json").read_text())["tests"]:
        assert (test["reseeded"], test["torch_seed"]) == (False, test["seed"])


def test_reports_compare_by_their_inputs_whatever_the_seeds(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(KERNELS)
    pytester.makeconftest(SET_SEED)
    base = _report(pytester, "base.json", "--gradref-seed=0")
    other_seed = _report(pytester, "seed5.json", "--gradref-seed=5", "-p", "xdist", "-n", "2")
    assert other_seed["base_seed"] == 5
    assert [t["seed"] for t in other_seed["tests"]] != [t["seed"] for t in base["tests"]]
    assert [t["inputs"] for t in other_seed["tests"]] == [t["inputs"] for t in base["tests"]]
    load = diff_module.load_report
    diff = diff_module.compare_reports(
        load(pytester.path / "base.json"), load(pytester.path / "seed5.json")
    )
    assert len(diff.items) == 6
    assert not diff.regressions
    assert diff.mismatches == []

    # Without the suite's seeding the two seeds draw other numbers: not comparable, each
    # test named; under the same seed they compare again.
    pytester.makeconftest("")
    _report(pytester, "own0.json", "--gradref-seed=0")
    _report(pytester, "own5.json", "--gradref-seed=5")
    with pytest.raises(diff_module.UnusableInput) as refused:
        diff_module.compare_reports(
            load(pytester.path / "own0.json"), load(pytester.path / "own5.json")
        )
    module = "test_reports_compare_by_their_inputs_whatever_the_seeds.py"
    assert str(refused.value).startswith(
        f"inputs differ in 2 tests: {module}::test_kernel[3], {module}::test_kernel[5] (the "
        "fingerprints of their references' inputs differ"
    )
    assert "--allow-mismatch compares anyway" in str(refused.value)
    _report(pytester, "again0.json", "--gradref-seed=0")
    again = diff_module.compare_reports(
        load(pytester.path / "own0.json"), load(pytester.path / "again0.json")
    )
    assert len(again.items) == 6


def test_the_gate_judges_a_baseline_by_inputs_whatever_the_seeds(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(KERNELS)
    pytester.makeconftest(SET_SEED)
    _report(pytester, "base.json", "--gradref-seed=0")
    gate = ["--gradref-device=cpu", "--gradref-baseline=base.json", "--gradref-baseline-fail"]
    result = pytester.runpytest(*gate, "--gradref-seed=3")
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["against base.json: 6 items compared, 0 regressions*"])

    pytester.makeconftest("")
    result = pytester.runpytest(*gate, "--gradref-seed=3")
    result.assert_outcomes(passed=2)
    assert result.ret == BASELINE_REGRESSION_EXIT
    result.stdout.fnmatch_lines(
        ["WARNING: nothing judged against base.json: inputs differ in 2 tests: *test_kernel[[]3]*"]
    )


def test_a_baseline_without_fingerprints_refuses_another_seed_before_any_test(
    pytester: pytest.Pytester,
) -> None:
    # A report written before fingerprints (format 2) is judged by its base seed, as before.
    pytester.makepyfile(KERNELS)
    old = _report(pytester, "base.json", "--gradref-seed=0")
    old["format_version"] = 2
    for test in old["tests"]:
        for field in ("inputs", "torch_seed", "reseeded"):
            del test[field]
    (pytester.path / "base.json").write_text(json.dumps(old))
    result = pytester.runpytest(
        "--gradref-device=cpu", "--gradref-baseline=base.json", "--gradref-seed=3"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*written with base seed 0, this run uses 3*--gradref-seed=0*"])
    result = pytester.runpytest("--gradref-device=cpu", "--gradref-baseline=base.json")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["against base.json: 6 items compared, 0 regressions*"])


def test_a_committed_format_2_report_still_loads() -> None:
    # Written by the H200 run before input fingerprints (format 3) existed.
    path = Path(__file__).parents[3] / "benchmarks/results/reports/kernels-h200-cuda-verdict.json"
    baseline = diff_module.load_report(path)
    assert baseline.format_version == 2
    assert diff_module.mismatches(baseline, baseline) == []


# Draws from torch's generator as the suite left it: seeded once, at conftest import.
DRAWS = """
import json

import torch


def test_first(gradref_device):
    with open("draws.json", "w") as handle:
        json.dump(torch.rand(3).tolist(), handle)


def test_recorded(grad_reference):
    x = torch.randn(3, dtype=torch.float64)
    ref = grad_reference(lambda t: t.square().sum(), x)
    ref.assert_close((x * x).sum(), 2 * x)
"""


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("ini", "the gradref_seed ini key in tox.ini"),
        ("env", "the GRADREF_SEED environment variable"),
        ("cli", "the --gradref-seed option"),
    ],
)
def test_seeding_off_leaves_torch_to_the_suite(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str, named: str
) -> None:
    pytester.makepyfile(DRAWS)
    pytester.makeconftest("import torch\n\ntorch.manual_seed(123)\n")
    args = ["--gradref-device=cpu", "--gradref-report=r.json", "-p", "no:randomly"]
    if source == "ini":
        pytester.makeini("[pytest]\ngradref_seed = off\n")
    elif source == "env":
        monkeypatch.setenv("GRADREF_SEED", "off")
    else:
        args.append("--gradref-seed=off")
    result = pytester.runpytest(*args)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [f"gradref: *seed=off (from {named}: gradref leaves torch's seeding to the suite)*"]
    )
    torch.manual_seed(123)
    assert json.loads((pytester.path / "draws.json").read_text()) == torch.rand(3).tolist()
    report = json.loads((pytester.path / "r.json").read_text())
    assert report["base_seed"] is None
    (test,) = report["tests"]
    assert (test["seed"], test["reseeded"], test["torch_seed"]) == (None, None, 123)
    assert diff_module.load_report(pytester.path / "r.json").describe().count("seed=off") == 1


def test_a_bad_seed_names_off(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(gradref_device): pass")
    result = pytester.runpytest("--gradref-seed=of")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*Invalid gradref seed 'of' from the --gradref-seed option; it must be a "
            "non-negative integer, or off to leave seeding to the suite"
        ]
    )


def test_a_hypothesis_example_has_no_fingerprint(pytester: pytest.Pytester) -> None:
    # Hypothesis draws an example's inputs, and which example the record keeps depends on the
    # kernel's errors: the diff judges such a test by its seed, as before fingerprints.
    pytest.importorskip("hypothesis")
    pytester.makepyfile(
        """
import torch
from hypothesis import HealthCheck, given, settings, strategies as st


@settings(max_examples=5, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.floats(0.5, 2.0))
def test_given(grad_reference, k):
    x = torch.linspace(-1, 1, 8, dtype=torch.float64) * k
    grad_reference(lambda t: t.sin().sum(), x).assert_close(x.sin().sum(), x.cos())
"""
    )
    result = pytester.runpytest("--gradref-device=cpu", "--gradref-report=r.json")
    result.assert_outcomes(passed=1)
    (test,) = json.loads((pytester.path / "r.json").read_text())["tests"]
    assert test["inputs"] == [None]
    assert test["torch_seed"] == test["seed"]


def test_a_fingerprint_sees_every_input_and_reads_no_host() -> None:
    x = torch.randn(64, 300, dtype=torch.float64)
    w = torch.randn(300, 4).t()  # another layout: sampled along each dimension
    labels = torch.randint(0, 4, (64,))
    module = torch.nn.Linear(4, 2)
    bias = torch.randn(2)

    def fn(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
        return (module(x.float() @ w.t()) + bias).sum() * scale

    def fingerprint(*args: Any, **kwargs: Any) -> str | None:
        return fingerprints([sample_inputs(fn, args, kwargs)])[0]

    same = fingerprint(x, w, labels, scale=2.0)
    assert same is not None
    assert fingerprint(x.clone(), w.clone(), labels.clone(), scale=2.0) == same
    # Each input counts: an argument, a plain value, a module's parameter, a closure's tensor.
    changed = [
        fingerprint(x * 2, w, labels, scale=2.0),
        fingerprint(x, w, labels, scale=3.0),
        fingerprint(x, w, labels.flip(0), scale=2.0),
    ]
    with torch.no_grad():
        module.weight.mul_(2)
    changed.append(fingerprint(x, w, labels, scale=2.0))
    bias.mul_(2)
    changed.append(fingerprint(x, w, labels, scale=2.0))
    assert len({same, *changed}) == 6
    # The samples are copies: a test changing its tensors afterwards changes no fingerprint.
    sampled = sample_inputs(fn, (x, w, labels), {"scale": 2.0})
    before = x.clone()
    x.add_(1)
    assert fingerprints([sampled])[0] == fingerprint(before, w, labels, scale=2.0)
    # At most SAMPLE elements of each tensor are read, however large.
    assert sampled is not None
    (data,) = sampled.data.values()
    assert data.numel() <= SAMPLE * (8 + 4 + 8) + 4 * (8 + 2)


def test_sampling_reads_nothing_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    # Sampling happens when a reference is computed; the one read is at the test's record.
    x = torch.randn(1000, 10)
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu"):

        def refuse(*args: Any, _name: str = name, **kwargs: Any) -> None:
            raise AssertionError(f"sample_inputs read the host with Tensor.{_name}")

        monkeypatch.setattr(torch.Tensor, name, refuse)
    assert sample_inputs(lambda t: t.sum(), (x,), {}) is not None


def test_a_tensor_subclass_has_no_fingerprint() -> None:
    class Wrapped(torch.Tensor):
        pass

    wrapped = torch.randn(3).as_subclass(Wrapped)
    assert sample_inputs(lambda t: t.sum(), (wrapped,), {}) is None
    assert fingerprints([None]) == [None]


def _record(nodeid: str, inputs: list[str | None], torch_seed: int) -> dict[str, Any]:
    return {
        "nodeid": nodeid,
        "strategies": ["autograd"],
        "seed": torch_seed,
        "torch_seed": torch_seed,
        "reseeded": False,
        "inputs": inputs,
        "items": [{"label": "value", "dtype": "float64", "max_abs": 1e-9, "passed": True}],
    }


def _document(base_seed: int | None, *tests: dict[str, Any]) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "base_seed": base_seed,
        "backend": "cpu",
        "strategy": "autograd",
        "strategy_is_default": True,
        "tests": list(tests),
    }


def _compare(base: dict[str, Any], new: dict[str, Any]) -> diff_module.Diff:
    parse = diff_module.parse_report
    return diff_module.compare_reports(parse(base, "base.json"), parse(new, "new.json"))


def test_fingerprints_not_seeds_decide_comparability() -> None:
    base = _document(0, _record("t.py::a", ["f1", "f2"], 1), _record("t.py::b", ["f3"], 2))
    # Other seeds, the same inputs (a suite's own seeding, or seeding off).
    for base_seed in (5, None):
        new = _document(
            base_seed, _record("t.py::a", ["f1", "f2"], 8), _record("t.py::b", ["f3"], 9)
        )
        assert len(_compare(base, new).items) == 2
    # A test that stopped after its first reference on one side: judged on that one.
    assert len(_compare(base, _document(0, _record("t.py::a", ["f1"], 1))).items) == 1
    # The same seeds, other inputs: refused, the tests named.
    many = [_record(f"t.py::c{i}", ["x"], 1) for i in range(7)]
    other = [_record(f"t.py::c{i}", ["y"], 1) for i in range(7)]
    with pytest.raises(diff_module.UnusableInput, match=r"inputs differ in 7 tests: t\.py::c0, "):
        _compare(_document(0, *many), _document(0, *other))
    with pytest.raises(diff_module.UnusableInput, match=r"t\.py::c4 and 2 more \(the finger"):
        _compare(_document(0, *many), _document(0, *other))
    allowed = diff_module.compare_reports(
        diff_module.parse_report(_document(0, *many), "base.json"),
        diff_module.parse_report(_document(0, *other), "new.json"),
        allow_mismatch=True,
    )
    assert allowed.mismatches[0].startswith("inputs differ in 7 tests")


def test_without_a_fingerprint_the_seed_torch_held_decides() -> None:
    base = _document(0, _record("t.py::a", [None], 1))
    assert len(_compare(base, _document(5, _record("t.py::a", [None], 1))).items) == 1
    with pytest.raises(diff_module.UnusableInput, match=r"inputs differ in 1 test: t\.py::a "):
        _compare(base, _document(0, _record("t.py::a", [None], 2)))


def test_a_report_before_fingerprints_compares_by_base_seed() -> None:
    old = copy.deepcopy(_document(0, _record("t.py::a", ["f1"], 1)))
    old["format_version"] = 2
    new = _document(5, _record("t.py::a", ["f1"], 1))
    with pytest.raises(diff_module.UnusableInput, match="base seeds differ: 0 in base, 5 in new"):
        _compare(old, new)
    off = _document(None, _record("t.py::a", ["f1"], 1))
    with pytest.raises(diff_module.UnusableInput, match="base seeds differ: 0 in base, off in new"):
        _compare(old, off)
