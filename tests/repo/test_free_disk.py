"""CI's disk check (scripts/check_free_disk.sh) fails a host short of the room the run's peak
needs, naming the directory, before .ci/run installs anything; and .ci/run holds one CUDA
environment on the oldest Python at a time, the peak that check is set for."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from test_docs_checks import ROOT

SCRIPT = ROOT / "scripts" / "check_free_disk.sh"
CI = (ROOT / ".ci" / "run").read_text().splitlines()


def check(need_gib: int, *dirs: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), str(need_gib), *dirs], capture_output=True, text=True, check=False
    )


def test_enough_room_passes_and_says_how_much(tmp_path: Path) -> None:
    result = check(0, str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert f"disk: {tmp_path} has " in result.stdout
    assert "GiB free (this run needs about 0 GiB)" in result.stdout


def test_too_little_room_fails_naming_the_directory_and_the_need(tmp_path: Path) -> None:
    result = check(10**9, str(tmp_path), str(tmp_path))
    assert result.returncode == 1
    assert result.stderr.count(f"{tmp_path} has ") == 2
    assert "needs about 1000000000 GiB there at its peak" in result.stderr


@pytest.mark.parametrize("arguments", [(), ("13",), ("13.5", "."), ("lots", ".")])
def test_bad_arguments_are_refused_saying_what_is_expected(arguments: tuple[str, ...]) -> None:
    result = subprocess.run(
        ["bash", str(SCRIPT), *arguments], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2
    assert "expected GIB, a whole number of GiB, then one directory or more" in result.stderr
    assert "GRADREF_CI_DISK_GIB" in result.stderr


def line_of(fragment: str) -> int:
    matches = [number for number, line in enumerate(CI) if fragment in line]
    assert len(matches) == 1, f"{fragment!r} on lines {matches} of .ci/run"
    return matches[0]


def test_ci_checks_the_disk_before_it_installs() -> None:
    installs = [n for n, line in enumerate(CI) if "scripts/setup" in line and "#" not in line]
    assert installs, ".ci/run installs nothing"
    checks = [n for n, line in enumerate(CI) if line.strip().startswith("bash scripts/check_free")]
    assert checks, ".ci/run checks no disk"
    assert max(checks) < min(installs)


def test_ci_removes_one_cuda_environment_before_it_installs_the_other() -> None:
    quick_start_used = max(
        n for n, line in enumerate(CI) if '"$quick_start_venv/bin/python"' in line
    )
    removed = line_of('rm -rf "$quick_start_venv"')
    oldest_installed = line_of("bash scripts/setup_oldest.sh")
    assert quick_start_used < removed < oldest_installed
    assert line_of("export PIP_NO_CACHE_DIR=1") < min(
        n for n, line in enumerate(CI) if "scripts/setup" in line and "#" not in line
    )
