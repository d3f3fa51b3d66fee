"""The plugin beside the plugins people already run: pytest-randomly (who seeds what, and how a
run is reproduced), Hypothesis (``@given`` tests that take ``grad_reference``) and
pytest-rerunfailures (a test run again is recorded once)."""

from __future__ import annotations

import json

import pytest
from _forked_runs import runpytest_forked

pytest.importorskip("pytest_randomly")
pytest.importorskip("hypothesis")
pytest.importorskip("pytest_rerunfailures")

# Each test writes what it drew from torch, random and numpy, in the order the tests ran.
DRAWS = """
import json
import random

import numpy
import torch


def draw(name, path="draws.jsonl"):
    with open(path, "a") as handle:
        handle.write(json.dumps({
            "test": name,
            "torch": torch.rand(2).tolist(),
            "random": random.random(),
            "numpy": float(numpy.random.rand()),
        }) + "\\n")


def test_a(gradref_device):
    draw("a")


def test_b(gradref_device):
    draw("b")


def test_c(gradref_device):
    draw("c")


def test_d(gradref_device):
    draw("d")
"""


def _draws(pytester: pytest.Pytester, *args: str) -> tuple[list[str], dict[str, dict]]:
    """The order the tests ran in and what each drew, for one run with ``args``."""
    path = pytester.path / "draws.jsonl"
    path.unlink(missing_ok=True)
    result = pytester.runpytest("-p", "randomly", "-p", "no:cacheprovider", *args)
    result.assert_outcomes(passed=4)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["test"] for r in records], {r["test"]: r for r in records}


def test_randomly_and_gradref_seed_different_generators(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_draws=DRAWS)
    order, draws = _draws(pytester, "--randomly-seed=1", "--gradref-seed=7")
    # The same two seeds reproduce the run: the order and every draw.
    assert _draws(pytester, "--randomly-seed=1", "--gradref-seed=7") == (order, draws)

    # torch's generators are gradref's: another randomly seed (another order, other random
    # and numpy draws) leaves every torch draw as it was, and so does no randomly at all.
    orders = {tuple(order)}
    for seed in range(2, 6):
        other_order, other = _draws(pytester, f"--randomly-seed={seed}", "--gradref-seed=7")
        orders.add(tuple(other_order))
        for test in draws:
            assert other[test]["torch"] == draws[test]["torch"]
            assert other[test]["random"] != draws[test]["random"]
            assert other[test]["numpy"] != draws[test]["numpy"]
    assert len(orders) > 1, "randomly never changed the order: the test proves nothing"
    _, unshuffled = _draws(pytester, "-p", "no:randomly", "--gradref-seed=7")
    assert {t: d["torch"] for t, d in unshuffled.items()} == {
        t: d["torch"] for t, d in draws.items()
    }

    # random and numpy are randomly's: another gradref seed changes torch's draws alone.
    same_order, regraded = _draws(pytester, "--randomly-seed=1", "--gradref-seed=8")
    assert same_order == order
    for test in draws:
        assert regraded[test]["torch"] != draws[test]["torch"]
        assert regraded[test]["random"] == draws[test]["random"]
        assert regraded[test]["numpy"] == draws[test]["numpy"]


def test_the_header_names_both_seeds(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_draws=DRAWS)
    result = pytester.runpytest("-p", "randomly", "--randomly-seed=3", "--gradref-seed=9")
    result.stdout.fnmatch_lines(["Using --randomly-seed=3", "gradref: device=* seed=9*"])


# A @given test with grad_reference: the pattern the README shows. Each example's value is
# off by k steps of 1e-6, so the worst example is known: k=5, always run as an explicit one.
GIVEN = """
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st


@settings(
    max_examples=25,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    database=None,
    derandomize=True,
)
@given(k=st.integers(0, 5))
@example(k=5)
@example(k=0)
def test_examples(grad_reference, k):
    x = torch.linspace(-1, 1, 8)
    ref = grad_reference(lambda t: t.sin().sum(), x)  # a value of about 0: atol decides
    ref.assert_close(ref.value + k * 1e-6, x.cos())


@settings(
    max_examples=25,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    database=None,
    derandomize=True,
)
@given(k=st.integers(0, 5))
def test_fails_from_three(grad_reference, k):
    x = torch.linspace(-1, 1, 8)
    ref = grad_reference(lambda t: t.sin().sum(), x)
    ref.assert_close(ref.value + k * 4e-6, x.cos())  # atol 1e-5: k >= 3 fails
"""
# GIVEN's examples are judged by float32's atol: the tolerance verdict's.
GIVEN_VERDICT = "--gradref-verdict=tolerance"


def test_a_given_test_records_its_worst_example(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_given=GIVEN)
    result = pytester.runpytest("--gradref-device=cpu", "--gradref-report=r.json", GIVEN_VERDICT)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.no_fnmatch_line("*FailedHealthCheck*")
    tests = {t["nodeid"]: t for t in json.loads((pytester.path / "r.json").read_text())["tests"]}

    # One example's items (value and gradient), not 25 examples' 50.
    passing = tests["test_given.py::test_examples"]
    assert [i["label"] for i in passing["items"]] == ["value", "gradient of argument 0 (t)"]
    assert passing["strategies"] == ["autograd"]
    assert passing["items"][0]["max_abs"] == pytest.approx(5e-6, rel=0.05)  # k=5, the worst

    failing = tests["test_given.py::test_fails_from_three"]
    assert failing["outcome"] == "failed"
    assert [i["passed"] for i in failing["items"]] == [False, True]


def test_a_falsifying_example_prints_a_short_fixture(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_given=GIVEN)
    result = pytester.runpytest("--gradref-device=cpu", "-k", "fails_from_three", GIVEN_VERDICT)
    result.assert_outcomes(failed=1)
    # Hypothesis names the failing case (its wording varies across versions) and pytest the
    # test's arguments: the fixture in one short line, never its policy and records.
    result.stdout.fnmatch_lines(
        [
            # Hypothesis shrinks to k = 3 (6.170); 6.100, the lowest admitted, stops at 4.
            "grad_reference = GradReference(backend='cpu', strategy='autograd'), k = [34]",
            "E * test_fails_from_three(",
            "E * k=[34],",
            "E * )",
        ]
    )
    result.stdout.no_fnmatch_line("*CheckPolicy*")
    result.stdout.no_fnmatch_line("*Recording(*")


FLAKY = """
import pathlib

import torch


def test_flaky(grad_reference):
    x = torch.ones(3)
    ref = grad_reference(lambda t: t.square().sum(), x)
    marker = pathlib.Path("attempted")
    off = 0.0 if marker.exists() else 1.0  # the first run fails, the second passes
    marker.touch()
    ref.assert_close(ref.value + off, 2 * x)
"""


def test_a_rerun_test_is_recorded_by_its_last_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTEST_ADDOPTS")  # conftest.py keeps rerunfailures out of other runs
    pytester.makepyfile(test_flaky=FLAKY)
    result = pytester.runpytest("--gradref-device=cpu", "--gradref-report=r.json", "--reruns=2")
    assert result.parseoutcomes() == {"passed": 1, "rerun": 1}
    (record,) = json.loads((pytester.path / "r.json").read_text())["tests"]
    assert record["outcome"] == "passed"
    assert [i["passed"] for i in record["items"]] == [True, True]


COVERED = """
import torch


def test_value_and_gradient(grad_reference):
    x = torch.linspace(-1.0, 1.0, 5)
    ref = grad_reference(lambda t: t.tanh().sum(), x)
    ref.assert_close(x.tanh().sum(), 1 - x.tanh().square())


def test_a_second_reference(grad_reference):
    x = torch.ones(4)
    ref = grad_reference(lambda t: t.square().sum(), x)
    ref.assert_close(torch.tensor(4.0), 2 * x)
"""


def test_under_coverage_and_xdist_workers(pytester: pytest.Pytester) -> None:
    # pytest-cov measures the plugin's own code in each xdist worker while gradref runs its
    # hooks there and writes a report: the combination a CI job with --cov runs.
    pytest.importorskip("pytest_cov")
    pytester.makepyfile(test_covered=COVERED)
    result = runpytest_forked(
        pytester,
        "-p",
        "xdist",
        "-n",
        "2",
        "--gradref-device=cpu",
        "--gradref-report=r.json",
        "--cov=pytest_gradref",
        "--cov-report=term",
        timeout=300,
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*coverage: *", "*pytest_gradref*plugin.py*", "TOTAL*"])
    tests = json.loads((pytester.path / "r.json").read_text())["tests"]
    assert sorted(t["outcome"] for t in tests) == ["passed", "passed"]
