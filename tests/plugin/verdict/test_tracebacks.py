"""A failure's traceback ends at the user's line: the plugin's frames are hidden, as
torch.testing and pluggy hide theirs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pytest_gradref

TESTS = """
import torch


def loss(x):
    return x.square().sum()


def test_mismatch(grad_reference):
    x = torch.ones(3)
    ref = grad_reference(loss, x)
    ref.assert_close(ref.value + 1, 2 * x)  # the user's line


def test_bad_argnums(grad_reference):
    grad_reference(loss, torch.ones(3), argnums=2)  # the user's line


@pytest.mark.gradref(golden=torch.float64, budget=2)
def test_budget_mismatch(grad_reference):
    x = torch.ones(3)
    ref = grad_reference(loss, x)
    ref.assert_close(ref.value, 3 * x)  # the user's line


def test_error_inside_the_users_function(grad_reference):
    def broken(x):
        raise ValueError("broken loss")  # the user's function

    grad_reference(broken, torch.ones(3))


def test_kernel_reference_bad_argnums(grad_reference):
    grad_reference.kernel(loss, torch.ones(3), argnums=2)  # the user's line


def test_has_aux_mismatch(grad_reference):
    def three(x):
        return loss(x), x.sum(), x.mean()

    grad_reference(three, torch.ones(3), has_aux=True)  # the user's line


def test_bad_budget(grad_reference):
    x = torch.ones(3)
    ref = grad_reference(loss, x, golden=torch.float64)
    ref.assert_close(ref.value, 2 * x, budget=-1)  # the user's line
"""


@pytest.mark.parametrize("style", ["long", "short", "auto"])
def test_the_traceback_shows_the_users_frames_only(pytester: pytest.Pytester, style: str) -> None:
    pytester.makepyfile("import pytest\n" + TESTS)
    result = pytester.runpytest("--gradref-device=cpu", f"--tb={style}")
    result.assert_outcomes(failed=7)
    # No frame from anywhere in the package, however the path is shown (absolute, or relative
    # to the rootdir).
    package = Path(pytest_gradref.__file__).parent
    assert package.name == "pytest_gradref"
    frames = re.findall(rf"\S*\b{package.name}/\S+\.py", result.stdout.str())
    assert frames == []
    # Each failure's last frame is the user's line: the source line right above the error
    # (Python's ^^^ position markers aside).
    assert _lines_above_errors(result.stdout.lines) == {
        ("ref.assert_close(ref.value + 1, 2 * x)  # the user's line", "AssertionError"),
        ("grad_reference(loss, torch.ones(3), argnums=2)  # the user's line", "ValueError"),
        ("ref.assert_close(ref.value, 3 * x)  # the user's line", "AssertionError"),
        ('raise ValueError("broken loss")  # the user\'s function', "ValueError"),
        ("grad_reference.kernel(loss, torch.ones(3), argnums=2)  # the user's line", "ValueError"),
        ("grad_reference(three, torch.ones(3), has_aux=True)  # the user's line", "TypeError"),
        ("ref.assert_close(ref.value, 2 * x, budget=-1)  # the user's line", "ValueError"),
    }


def _lines_above_errors(lines: list[str]) -> set[tuple[str, str]]:
    """(source line, exception name) for each error in a run's FAILURES output."""
    found = set()
    above = ""
    for line in lines:
        error = re.match(r"E +(\w+Error): ", line)
        if error and above:
            found.add((above, error.group(1)))
        if line.startswith("E"):
            above = ""  # an error's further lines
        elif line.strip() and not re.fullmatch(r" *\^+ *", line):
            above = line.lstrip(">").strip()
    return found


def test_full_trace_still_shows_the_plugin(pytester: pytest.Pytester) -> None:
    # --full-trace is how a plugin bug is still debugged.
    pytester.makepyfile("import pytest\n" + TESTS)
    result = pytester.runpytest("--gradref-device=cpu", "--full-trace", "-k", "test_mismatch")
    result.assert_outcomes(failed=1)
    assert "pytest_gradref/reference/result.py" in result.stdout.str()
