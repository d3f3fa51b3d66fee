"""Every setting of ``Reference.assert_close`` can go on ``@pytest.mark.gradref``, aux
tolerances included: per test, or per parameter with ``pytest.param(..., marks=...)``."""

from __future__ import annotations

import inspect
import json

import pytest

from pytest_gradref.config.markers import _KEYWORDS, MARKER_LINES
from pytest_gradref.reference.result import Reference

# A float32 loss whose aux holds log-probabilities; the kernel's are off by a relative 1e-3,
# far beyond the default verdict's budget, within rtol=1e-2.
AUX_KERNEL = """
import pytest
import torch
from pytest_gradref import Tolerance

LOOSE = Tolerance(rtol=1e-2, atol=1e-6)
TIGHT = Tolerance(rtol=1e-9, atol=0.0)


def loss(x):
    logps = x.log_softmax(-1).sum(-1)
    return logps.sum(), {"logps": logps, "steps": 3}


def kernel(x):
    xx = x.clone().requires_grad_()
    value, aux = loss(xx)
    value.backward()
    return value.detach(), xx.grad, {"logps": aux["logps"].detach() * (1 + 1e-3), "steps": 3}


def draw():
    return torch.randn(4, 5, dtype=torch.float32, generator=torch.Generator().manual_seed(0))


@pytest.mark.gradref(aux_tolerances={"logps": LOOSE})
def test_marker_tolerance(grad_reference):
    x = draw()
    value, grad, aux = kernel(x)
    grad_reference(loss, x, has_aux=True).assert_close(value, grad, aux=aux)


def test_no_tolerance_fails(grad_reference):
    x = draw()
    value, grad, aux = kernel(x)
    grad_reference(loss, x, has_aux=True).assert_close(value, grad, aux=aux)


@pytest.mark.parametrize(
    "scale",
    [1.0, pytest.param(2.0, marks=pytest.mark.gradref(aux_tolerances={"logps": LOOSE}))],
)
def test_per_parameter(grad_reference, scale):
    x = draw() * scale
    value, grad, aux = kernel(x)
    grad_reference(loss, x, has_aux=True).assert_close(value, grad, aux=aux)


@pytest.mark.gradref(aux_tolerances={"logps": TIGHT})
def test_the_argument_wins_for_its_items(grad_reference):
    x = draw()
    value, grad, aux = kernel(x)
    ref = grad_reference(loss, x, has_aux=True)
    ref.assert_close(value, grad, aux=aux, aux_tolerances={"aux['logps']": LOOSE})


@pytest.mark.gradref(aux_tolerances={"logps": LOOSE})
def test_the_marker_leaves_other_references_alone(grad_reference):
    # A reference without an aux, and one whose aux is left unchecked on purpose.
    from pytest_gradref import UNCHECKED

    x = draw()
    value, grad, _ = kernel(x)
    plain = grad_reference(lambda t: loss(t)[0], x)
    plain.assert_close(value, grad)
    grad_reference(loss, x, has_aux=True).assert_close(value, grad, aux=UNCHECKED)


@pytest.mark.gradref(aux_tolerances={"lgops": LOOSE})
def test_a_key_not_in_the_aux(grad_reference):
    x = draw()
    value, grad, aux = kernel(x)
    grad_reference(loss, x, has_aux=True).assert_close(value, grad, aux=aux)
"""


def test_aux_tolerances_on_the_marker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(AUX_KERNEL)
    result = pytester.runpytest(
        "--gradref-device=cpu", "-p", "no:randomly", "-v", "--gradref-report=r.json"
    )
    result.assert_outcomes(passed=4, failed=3)
    result.stdout.fnmatch_lines(
        [
            "*::test_marker_tolerance PASSED*",
            "*::test_no_tolerance_fails FAILED*",
            "*::test_per_parameter[[]1.0[]] FAILED*",
            "*::test_per_parameter[[]2.0[]] PASSED*",
            "*::test_the_argument_wins_for_its_items PASSED*",
            "*::test_the_marker_leaves_other_references_alone PASSED*",
            "*::test_a_key_not_in_the_aux FAILED*",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "E * ValueError: the test's @pytest.mark.gradref(aux_tolerances=...) names 'lgops', "
            "which is not in the aux; use a top-level key or index, or an item's label: "
            "aux[[]'logps'], aux[[]'steps']"
        ]
    )
    report = json.loads((pytester.path / "r.json").read_text())
    criteria = {
        (test["nodeid"].split("::")[-1], item["label"]): item["criterion"]
        for test in report["tests"]
        for item in test["items"]
    }
    # Where each item's tolerance came from: the marker, or the argument over the marker.
    assert criteria["test_marker_tolerance", "aux['logps']"] == (
        "rtol=0.01, atol=1e-06 from the test's "
        "@pytest.mark.gradref(aux_tolerances={'logps': ...}) marker"
    )
    assert criteria["test_the_argument_wins_for_its_items", "aux['logps']"] == (
        "rtol=0.01, atol=1e-06 from assert_close(aux_tolerances={\"aux['logps']\": ...})"
    )
    assert "budget" in criteria["test_marker_tolerance", "value"]  # the rest keeps the verdict


@pytest.mark.parametrize(
    ("decorator", "message"),
    [
        pytest.param(
            '@pytest.mark.gradref(aux_tolerances=[("logps", 1e-2)])',
            "@pytest.mark.gradref got aux_tolerances=[[]('logps', 0.01)[]]; it must be a "
            "mapping of an aux's top-level key or index, or an item's label, to a Tolerance, "
            "e.g. aux_tolerances={'logps': pytest_gradref.Tolerance(rtol=1e-2, atol=1e-5)}",
            id="not-a-mapping",
        ),
        pytest.param(
            '@pytest.mark.gradref(aux_tolerances={("logps",): Tolerance(rtol=0.1, atol=0)})',
            "@pytest.mark.gradref got aux_tolerances with key ('logps',); a key is a top-level "
            "key (str) or index (int) of the aux, or an item's label such as "
            "\"aux[[]'logps'][[]0]\", e.g. *",
            id="key-not-str-or-int",
        ),
        pytest.param(
            '@pytest.mark.gradref(aux_tolerances={"logps": 1e-2})',
            "@pytest.mark.gradref got aux_tolerances[[]'logps']=0.01; it must be a "
            "pytest_gradref.Tolerance(rtol=..., atol=...), e.g. *",
            id="value-not-a-tolerance",
        ),
        pytest.param(
            '@pytest.mark.gradref(aux_tolerance={"logps": Tolerance(rtol=0.1, atol=0)})',
            "@pytest.mark.gradref got unknown keyword(s) aux_tolerance; valid keywords are "
            "strategy, rtol, atol, golden, budget, rounded, check_dtype, aux_tolerances",
            id="unknown-keyword",
        ),
    ],
)
def test_a_bad_aux_tolerances_marker_is_a_usage_error(
    pytester: pytest.Pytester, decorator: str, message: str
) -> None:
    pytester.makepyfile(
        f"""
import pytest
from pytest_gradref import Tolerance

{decorator}
def test_misused(grad_reference):
    pass
"""
    )
    result = pytester.runpytest("--gradref-device=cpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: *::test_misused: {message}"])


def test_every_assert_close_setting_is_a_marker_keyword(pytester: pytest.Pytester) -> None:
    # The keyword-only arguments of assert_close but aux (the kernel's aux itself, not a
    # setting) and param_grads (the kernel's gradients).
    settings = {
        name
        for name, parameter in inspect.signature(Reference.assert_close).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    } - {"aux", "param_grads"}
    assert settings <= set(_KEYWORDS["gradref"]), settings - set(_KEYWORDS["gradref"])
    registered = next(line for line in MARKER_LINES if line.startswith("gradref("))
    assert all(f"{name}=" in registered for name in _KEYWORDS["gradref"])
    pytester.runpytest("--markers").stdout.fnmatch_lines(
        ["@pytest.mark.gradref(*check_dtype=True, aux_tolerances=None)*"]
    )
