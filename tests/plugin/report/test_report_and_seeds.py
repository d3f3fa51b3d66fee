"""The JSON precision report, crosscheck summaries and per-test seeds."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch
from _forked_runs import runpytest_forked

from pytest_gradref.report.diff import FORMAT_VERSION

CASES = """
import pytest
import torch


def loss(x, w):
    return torch.tanh(x @ w).square().sum()


@pytest.mark.parametrize("n", [3, 5])
def test_close(grad_reference, gradref_device, n):
    x = torch.randn(n, 4, device=gradref_device, dtype=torch.float64)
    w = torch.randn(4, 2, device=gradref_device, dtype=torch.float64)
    ref = grad_reference(loss, x, w, argnums=(0, 1))
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = loss(xx, ww)
    out.backward()
    ref.assert_close(out, (xx.grad, ww.grad))


def test_off_by_a_little(grad_reference, gradref_device):
    x = torch.randn(6, device=gradref_device, dtype=torch.float64)
    ref = grad_reference(lambda t: t.exp().sum(), x)
    with pytest.raises(AssertionError):
        ref.assert_close(x.exp().sum(), x.exp() * (1 + 1e-3))
"""


def _report(pytester: pytest.Pytester, *args: str) -> dict:
    # cpu explicitly: on a machine with accelerators, -n 2 would spread the workers over them.
    result = pytester.runpytest("--gradref-device=cpu", "--gradref-report=report.json", *args)
    result.assert_outcomes(passed=3)
    return json.loads((pytester.path / "report.json").read_text())


def test_report_content(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(CASES)
    report = _report(pytester)
    # What a comparison of two reports (pytest-gradref diff) needs about the run.
    assert report["format_version"] == FORMAT_VERSION
    assert report["base_seed"] == 0
    assert report["torch"] == torch.__version__
    assert (report["device"], report["backend"], report["strategy"]) == ("cpu", "cpu", "autograd")
    assert report["golden_on_cpu"] == []
    tests = {record["nodeid"]: record for record in report["tests"]}
    assert sorted(tests) == [
        "test_report_content.py::test_close[3]",
        "test_report_content.py::test_close[5]",
        "test_report_content.py::test_off_by_a_little",
    ]
    close = tests["test_report_content.py::test_close[3]"]
    assert close["device"] == "cpu"
    assert close["strategies"] == ["autograd"]
    labels = [item["label"] for item in close["items"]]
    assert labels == ["value", "gradient of argument 0 (x)", "gradient of argument 1 (w)"]
    for item in close["items"]:
        assert item["dtype"] == "float64"
        assert item["passed"] is True
        assert 0 <= item["headroom"] <= 1
        assert "torch.testing's default for float64" in item["criterion"]
    off = tests["test_report_content.py::test_off_by_a_little"]["items"]
    grad = next(item for item in off if item["label"].startswith("gradient"))
    assert grad["passed"] is False
    assert grad["headroom"] < 0
    assert grad["max_rel"] == pytest.approx(1e-3, rel=1e-6)


def test_report_is_the_same_under_xdist(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(CASES)
    serial = _report(pytester)
    parallel = _report(pytester, "-n", "2")
    assert parallel == serial


RECORDS_IT_RAN = """
from pathlib import Path


def test_runs(gradref_device):
    Path("ran").write_text("")
"""


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("out", "*--gradref-report=out: it is a directory; name a file, e.g. *out?gradref-rep*"),
        (
            "absent/report.json",
            "*--gradref-report=absent?report.json: its directory absent does not exist; create "
            "it first*",
        ),
        (
            "file.txt/report.json",
            "*--gradref-report=file.txt?report.json: its directory file.txt is not a directory*",
        ),
        ("r" * 300, "*--gradref-report=rrr*: no file can be created beside it in .: File name*"),
        (
            "read-only/report.json",
            "*--gradref-report=read-only?report.json: no file can be created beside it in "
            "read-only: Permission denied; name a file in a writable directory",
        ),
    ],
    ids=["directory", "missing-directory", "file-as-directory", "name-too-long", "read-only"],
)
@pytest.mark.parametrize("workers", [[], ["-p", "xdist", "-n", "2"]], ids=["serial", "xdist"])
def test_unwritable_report_path_is_a_usage_error_before_any_test(
    pytester: pytest.Pytester, target: str, message: str, workers: list[str]
) -> None:
    pytester.makepyfile(RECORDS_IT_RAN)
    pytester.mkdir("out")
    pytester.path.joinpath("file.txt").write_text("")
    read_only = pytester.mkdir("read-only")
    read_only.chmod(0o555)
    try:
        if target.startswith("read-only"):
            try:  # root (or a file system that ignores modes) writes there all the same
                read_only.joinpath("probe").write_text("")
            except PermissionError:
                pass
            else:
                pytest.skip("this user can write into a read-only directory")
        result = pytester.runpytest("--gradref-device=cpu", f"--gradref-report={target}", *workers)
    finally:
        read_only.chmod(0o755)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}"])
    assert not (pytester.path / "ran").exists()
    assert sorted(p.name for p in pytester.path.iterdir() if p.name.startswith(".")) == []


INTERRUPTS_THE_REPORT = """
import json

import pytest


dumps = json.dumps


def broken(document, **kwargs):
    # The report's text cannot be encoded half-way through: its write is interrupted.
    if isinstance(document, dict) and "format_version" in document:
        return '{"format_version": 1, "tests": [\\ud800'
    return dumps(document, **kwargs)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    json.dumps = broken
"""


def test_an_interrupted_report_write_leaves_the_previous_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(CASES)
    previous = json.dumps(_report(pytester))
    pytester.makeconftest(INTERRUPTS_THE_REPORT)
    # A subprocess: the conftest replaces json.dumps for the whole process.
    result = runpytest_forked(pytester, "--gradref-device=cpu", "--gradref-report=report.json")
    assert result.ret != pytest.ExitCode.OK
    # The report's own write was interrupted (not another plugin's, before it).
    result.stderr.fnmatch_lines(
        [
            "*pytest_gradref?report?writer.py*in pytest_sessionfinish",
            "UnicodeEncodeError: *surrogates*",
        ]
    )
    # Written beside the report and renamed over it: never a truncated report, nor a leftover.
    assert json.dumps(json.loads((pytester.path / "report.json").read_text())) == previous
    assert [p.name for p in pytester.path.iterdir() if p.name.startswith(".report.json")] == []


def test_crosscheck_disagreements_are_recorded_in_the_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
import torch


def loss(x):
    return (x * x).sum()


def test_agree(grad_reference):
    x = torch.randn(5, dtype=torch.float64)
    ref = grad_reference(loss, x)
    assert ref.strategy == "autograd"
    assert ref.crosscheck is not None
    assert [d.label for d in ref.crosscheck] == ["value", "gradient of argument 0 (x)"]
    assert all(d.max_abs == 0 and not d.exceeds_tolerance for d in ref.crosscheck)
"""
    )
    result = pytester.runpytest("--gradref-strategy=crosscheck", "--gradref-report=r.json")
    result.assert_outcomes(passed=1)
    record = json.loads((pytester.path / "r.json").read_text())["tests"][0]
    # The strategy whose result the test received, and per item the one it was checked
    # against.
    assert record["strategies"] == ["autograd"]
    assert [d["label"] for d in record["crosscheck"]] == ["value", "gradient of argument 0 (x)"]
    for entry in record["crosscheck"]:
        assert (entry["received"], entry["checked_against"]) == ("autograd", "grad_and_value")
    result.stdout.fnmatch_lines(
        [
            "*= gradref =*",
            "crosscheck: 2 items received autograd results, checked against grad_and_value; "
            "0 differ beyond tolerance",
        ]
    )


CROSSCHECKED_AUX = """
import itertools
import math

import torch


def loss(x):
    aux = {"chosen_rewards": 2 * x, "steps": torch.tensor(3), "pair": (x.sum(), 0.5), "name": "dpo"}
    return (x * x).sum(), aux


def test_agree(grad_reference):
    x = torch.randn(5, dtype=torch.float64)
    ref = grad_reference(loss, x, has_aux=True)
    assert [d.label for d in ref.crosscheck] == [
        "value",
        "gradient of argument 0 (x)",
        "aux['chosen_rewards']",
        "aux['steps']",
        "aux['pair'][0]",
        "aux['pair'][1]",
        "aux['name']",
    ]
    assert all(d.max_abs == 0 and not d.exceeds_tolerance for d in ref.crosscheck)


calls = itertools.count()


def changing(x):
    # Each run of fn sees the next call: autograd's first, grad_and_value's second.
    n = next(calls)
    aux = {
        "rewards": 2 * x * (1 + 1e-3 * n),
        "call": n,
        "name": ("first", "second")[n],
        f"only_in_run_{n}": x.sum(),
    }
    return (x * x).sum(), aux


def test_disagree(grad_reference):
    x = torch.randn(5, dtype=torch.float64)
    ref = grad_reference(changing, x, has_aux=True)
    found = {d.label: d for d in ref.crosscheck}
    assert list(found) == [
        "value", "gradient of argument 0 (x)", "aux", "aux['rewards']", "aux['call']", "aux['name']"
    ]
    assert not found["value"].exceeds_tolerance
    rewards = found["aux['rewards']"]
    # relative to the value checked against: 1e-3 of it, over its 1.001
    assert rewards.exceeds_tolerance and math.isclose(rewards.max_rel, 1e-3 / 1.001, rel_tol=1e-9)
    assert found["aux['call']"].exceeds_tolerance and found["aux['call']"].max_abs == 1
    name = found["aux['name']"]
    assert name.exceeds_tolerance and name.tolerance == "equality" and math.isnan(name.max_abs)
    structure = found["aux"]
    assert structure.exceeds_tolerance and "keys differ" in structure.tolerance
"""


def test_crosscheck_pairs_the_aux(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(CROSSCHECKED_AUX)
    result = pytester.runpytest(
        "-p", "no:randomly", "--gradref-strategy=crosscheck", "--gradref-report=r.json"
    )
    result.assert_outcomes(passed=2)
    records = {
        r["nodeid"].split("::")[1]: r
        for r in json.loads((pytester.path / "r.json").read_text())["tests"]
    }
    assert len(records["test_agree"]["crosscheck"]) == 7
    # The agreeing aux is counted among the compared items; each disagreement is listed.
    result.stdout.fnmatch_lines(
        [
            "crosscheck: 13 items received autograd results, checked against grad_and_value; "
            "4 differ beyond tolerance",
            "autograd and grad_and_value disagree beyond tolerance:",
            "  *::test_disagree: aux (-) differs by nan (relative nan) between autograd "
            "(received) and grad_and_value (checked against); tolerance the same structure "
            "(keys differ: the actual lacks 'only_in_run_0'; it adds 'only_in_run_1'; the "
            "actual: grad_and_value's aux)",
            "  *::test_disagree: aux[[]'rewards'] (float64) differs by * (relative 0.000999) "
            "between autograd (received) and grad_and_value (checked against); tolerance "
            "rtol=1e-07, atol=1e-07 from torch.testing's default for float64",
            "  *::test_disagree: aux[[]'call'] (int64) differs by 1 (relative 1) between *; "
            "tolerance rtol=0, atol=0 from exact comparison for int64",
            "  *::test_disagree: aux[[]'name'] (str) differs by nan (relative nan) between *; "
            "tolerance equality",
        ]
    )


def test_crosscheck_equal_infinities_agree(pytester: pytest.Pytester) -> None:
    # Both strategies give +inf for the loss and +inf and -inf at the same gradient elements:
    # they differ by 0 there, as assert_close measures it, not by inf - inf = NaN.
    pytester.makepyfile(
        """
import torch


def loss(x, y):
    return x.exp().sum() + (-y).exp().sum()


def test_infinite(grad_reference):
    x = torch.tensor([0.0, 1000.0])
    y = torch.tensor([-1000.0, 0.0])
    ref = grad_reference(loss, x, y, argnums=(0, 1))
    assert torch.isposinf(ref.value)
    assert torch.isposinf(ref.grads[0][1]) and torch.isneginf(ref.grads[1][0])
    assert [(d.max_abs, d.max_rel, d.exceeds_tolerance) for d in ref.crosscheck] == [
        (0.0, 0.0, False)
    ] * 3
    ref.assert_close(loss(x, y), (x.exp(), -(-y).exp()))
"""
    )
    result = pytester.runpytest("--gradref-strategy=crosscheck", "--gradref-report=r.json")
    result.assert_outcomes(passed=1)
    record = json.loads((pytester.path / "r.json").read_text())["tests"][0]
    assert [(d["max_abs"], d["max_rel"]) for d in record["crosscheck"]] == [(0.0, 0.0)] * 3
    result.stdout.fnmatch_lines(
        [
            "crosscheck: 3 items received autograd results, checked against grad_and_value; "
            "0 differ beyond tolerance",
        ]
    )


def test_crosscheck_on_npu_received_grad_and_value(
    pytester: pytest.Pytester, npu_on_cpu: Callable[[str], None]
) -> None:
    # On the npu policy the test receives grad_and_value's result, checked against autograd.
    npu_on_cpu("")
    pytester.makepyfile(
        """
import torch

def test_npu(grad_reference):
    x = torch.randn(5, dtype=torch.float64)
    ref = grad_reference(lambda t: (t * t).sum(), x)
    assert ref.strategy == "grad_and_value"
    assert {(d.received, d.checked_against) for d in ref.crosscheck} == {
        ("grad_and_value", "autograd")
    }
"""
    )
    result = pytester.runpytest(
        "--gradref-device=npu", "--gradref-strategy=crosscheck", "--gradref-report=r.json"
    )
    result.assert_outcomes(passed=1)
    record = json.loads((pytester.path / "r.json").read_text())["tests"][0]
    assert record["strategies"] == ["grad_and_value"]
    assert {(d["received"], d["checked_against"]) for d in record["crosscheck"]} == {
        ("grad_and_value", "autograd")
    }
    result.stdout.fnmatch_lines(
        ["crosscheck: 2 items received grad_and_value results, checked against autograd; *"]
    )


def test_crosscheck_beyond_tolerance_is_always_summarised(pytester: pytest.Pytester) -> None:
    # A backend whose grad_and_value differs from autograd: simulated by a conftest that makes
    # the functional transform see a different function (torch.func.grad_and_value patched).
    pytester.makeconftest(
        """
import torch.func

_real = torch.func.grad_and_value


def skewed(fn, argnums=0, has_aux=False):
    transformed = _real(fn, argnums=argnums, has_aux=has_aux)

    def run(*args):
        grads, rest = transformed(*args)
        scale = lambda t: t * (1 + 1e-3)
        grads = torch.utils._pytree.tree_map(scale, grads)
        return grads, rest

    return run


torch.func.grad_and_value = skewed
"""
    )
    pytester.makepyfile(
        """
import torch

def test_disagree(grad_reference):
    x = torch.randn(5, dtype=torch.float64)
    ref = grad_reference(lambda t: (t * t).sum(), x)
    grad = ref.crosscheck[1]
    assert grad.exceeds_tolerance and grad.max_rel > 9e-4
    ref.assert_close((x * x).sum(), 2 * x)
"""
    )
    # A subprocess: the conftest replaces torch.func.grad_and_value for the whole process.
    result = runpytest_forked(pytester, "--gradref-strategy=crosscheck")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*= gradref =*",
            "crosscheck: 2 items received autograd results, checked against grad_and_value; "
            "1 differs beyond tolerance",
            "autograd and grad_and_value disagree beyond tolerance:",
            "*test_disagree: gradient of argument 0 (t) (float64) differs by *(relative 0.000999) "
            "between autograd (received) and grad_and_value (checked against); tolerance *",
            "tightest compared items (of 2):",
        ]
    )


def test_verbose_summary_lists_the_tightest_items(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(CASES)
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        ["tightest compared items (of 8):", "  headroom *float64  gradient of argument 0 (t)*"]
    )
    quiet = pytester.runpytest()
    quiet.stdout.no_fnmatch_line("*tightest compared items*")


SEEDED = """
import json
import os

import pytest
import torch


@pytest.mark.parametrize("i", range(4))
def test_draw(i, gradref_device):
    path = os.path.join(os.environ["DRAWS_DIR"], f"draw{i}.json")
    with open(path, "w") as handle:
        json.dump(torch.rand(3).tolist(), handle)
"""


def _draws(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str) -> list:
    out = pytester.mkdir(f"draws{len(list(pytester.path.glob('draws*')))}")
    monkeypatch.setenv("DRAWS_DIR", str(out))
    pytester.runpytest(*args).assert_outcomes(passed=4)
    return [json.loads((out / f"draw{i}.json").read_text()) for i in range(4)]


def test_draws_are_the_same_serial_reversed_alone_and_under_xdist(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(SEEDED)
    pytester.makeconftest("import torch  # loaded before the tests, as in a torch project\n")
    serial = _draws(pytester, monkeypatch)
    assert len({tuple(d) for d in serial}) == 4, "each test draws its own numbers"
    parallel = _draws(pytester, monkeypatch, "-n", "2")
    assert parallel == serial
    alone = _draws(pytester, monkeypatch, "-k", "test_draw")
    assert alone == serial
    other_base = _draws(pytester, monkeypatch, "--gradref-seed=7")
    assert other_base != serial


def test_seed_shown_in_header_and_bad_seed_rejected(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(gradref_device): pass")
    pytester.runpytest("--gradref-seed=42").stdout.fnmatch_lines(["gradref: *seed=42*"])
    bad = pytester.runpytest("--gradref-seed=abc")
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*Invalid gradref seed 'abc' from the --gradref-seed option*"])


# A suite beside the gradref tests: its conftest seeds torch once, at import, and its plain
# test relies on that.
SEEDED_AT_IMPORT = """
import torch

torch.manual_seed(123)
"""
PLAIN_BESIDE_GRADREF = """
import torch


def test_plain():
    assert torch.initial_seed() == 123


def test_gradref(gradref_device):
    assert torch.initial_seed() != 123
"""


def test_only_the_tests_that_use_gradref_are_seeded(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(SEEDED_AT_IMPORT)
    pytester.makepyfile(test_beside=PLAIN_BESIDE_GRADREF)
    result = pytester.runpytest("-p", "no:randomly", "--gradref-seed=5")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        ["gradref: *seed=5 (from the --gradref-seed option; the tests that use gradref)*"]
    )
    # The ini key (or the option) seeds every test again: the plain test's seed is gradref's.
    pytester.makeini("[pytest]\ngradref_seed_every_test = true\n")
    seeded = pytester.runpytest("-p", "no:randomly")
    seeded.assert_outcomes(passed=1, failed=1)
    seeded.stdout.fnmatch_lines(
        ["gradref: *seed=0 (the default; every test, from the gradref_seed_every_test ini key*"]
    )


def test_the_header_is_shown_under_xdist_and_quiet(pytester: pytest.Pytester) -> None:
    # -q shows no session header, and an xdist controller collects nothing: the line heads the
    # workers' section instead, with each setting's source.
    pytester.makepyfile("def test_x(gradref_device): pass")
    result = pytester.runpytest("-q", "-n", "2", "--gradref-seed=9")
    result.stdout.fnmatch_lines(  # the host's first available device: cpu, cuda:0, ...
        [
            "*= gradref workers =*",
            "gradref: device=* (*; auto: first available) strategy=* (* default) "
            "seed=9 (from the --gradref-seed option; the tests that use gradref)*",
            "gw? -> * (*",
        ]
    )
