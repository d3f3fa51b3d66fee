"""The declared lower bounds and the environment that CI tests them in agree:
``scripts/setup_oldest.sh`` installs ``scripts/oldest-constraints.txt`` on the oldest Python
that ``requires-python`` admits."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli before Python 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PINS = ROOT / "scripts" / "oldest-constraints.txt"


def _project() -> dict[str, Any]:
    project: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project


def _oldest_python() -> str:
    """The oldest Python that ``requires-python`` admits, e.g. "3.9"."""
    return str(_project()["requires-python"]).removeprefix(">=")


def _lower_bounds() -> dict[str, Version]:
    """The `>=` bound of every runtime and test requirement that has one and that installs on
    the oldest Python."""
    project = _project()
    requirements = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    bounds: dict[str, Version] = {}
    python = _oldest_python()
    oldest = {"python_version": python, "python_full_version": f"{python}.0"}
    for line in requirements:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate(oldest):
            continue  # not installed on the oldest Python
        for spec in requirement.specifier:
            if spec.operator == ">=":
                bounds[canonicalize_name(requirement.name)] = Version(spec.version)
    return bounds


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in PINS.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name.strip())] = Version(version.strip())
    return pins


def test_the_oldest_environment_pins_every_declared_lower_bound() -> None:
    bounds, pins = _lower_bounds(), _pins()
    assert {"torch", "pytest", "pluggy", "pytest-xdist"} <= set(bounds)
    assert set(pins) == set(bounds), (
        f"{PINS.name} pins {sorted(pins)}, pyproject.toml bounds {sorted(bounds)}: pin each "
        "bounded requirement at its bound, and nothing else"
    )
    for name, bound in bounds.items():
        assert pins[name] == bound, (
            f"pyproject.toml admits {name}>={bound} but {PINS.name} tests {name}=={pins[name]}: "
            "make them the same, so that CI tests the bound users are promised"
        )


def test_requires_python_is_a_bound_that_oldest_python_reads() -> None:
    # scripts/oldest_python.sh finds python3.N from this line with sed; a new form must update
    # both.
    found = subprocess.run(
        ["bash", "-c", ". scripts/oldest_python.sh && oldest_python_version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert found.stdout == f"{_oldest_python()}\n"
    line = f'requires-python = "{_project()["requires-python"]}"'
    assert re.fullmatch(r'requires-python = ">=3\.[0-9]+"', line), line
    assert line in (ROOT / "pyproject.toml").read_text().splitlines()
