"""The docs' checks (scripts/check_docs.sh) catch what they are for: a settings table or module
table that parted from the code, a figure with no source, a stale count, a path that leads
nowhere. The checks themselves run in CI through scripts/check_docs.sh; these tests run their
logic on small pages."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def _script(name: str) -> ModuleType:
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(f"_docs_{name}", SCRIPTS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def settings_table() -> ModuleType:
    return _script("settings_table")


@pytest.fixture(scope="module")
def sources() -> ModuleType:
    return _script("check_doc_sources")


@pytest.fixture(scope="module")
def module_table() -> ModuleType:
    return _script("module_table")


# --- settings parity ----------------------------------------------------------------------


def test_every_registered_option_and_ini_key_is_in_the_tables(settings_table: ModuleType) -> None:
    from pytest_gradref import plugin

    parser = settings_table.RecordingParser()
    plugin.pytest_addoption(parser)
    flags = [f for flags, _ in parser.options for f in flags if f.startswith("--")]
    inis = [name for name, _, _ in parser.inis]
    full = settings_table.render("full")
    toml = settings_table.render("toml")
    for flag in flags:
        assert f"`{flag}`" in full
    for ini in inis:
        assert f"`{ini}`" in full
        assert f"\n{ini} = " in toml, f"the pyproject.toml block sets no {ini}"


def test_every_registered_marker_is_in_the_marker_table(settings_table: ModuleType) -> None:
    from pytest_gradref.config.markers import MARKER_LINES

    table = settings_table.render("markers")
    for line in MARKER_LINES:
        assert f"| `{line.partition('): ')[0]})` |" in table


def test_the_table_says_which_sources_a_setting_takes(settings_table: ModuleType) -> None:
    rows = {row.name: row for row in settings_table.declared_settings()}
    device = rows["--gradref-device"]
    assert (device.env, device.ini, device.default) == ("GRADREF_DEVICE", "gradref_device", "auto")
    report = rows["--gradref-report"]
    assert report.env is None
    assert report.ini is None
    assert "| `--gradref-report` | — | — |" in settings_table.render("full")


def test_a_stale_block_is_rewritten_and_fails_the_check(
    settings_table: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docblocks = sys.modules["docblocks"]
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- settings-table: compact -->\nold\n<!-- /settings-table -->\n")
    monkeypatch.setattr(docblocks, "ROOT", tmp_path)
    assert docblocks.main("settings-table", settings_table.render, [page], ["--check"]) == 1
    assert "old" in page.read_text()
    assert docblocks.main("settings-table", settings_table.render, [page], []) == 0
    assert "`--gradref-device`" in page.read_text()
    assert docblocks.main("settings-table", settings_table.render, [page], ["--check"]) == 0


# --- figures and their sources --------------------------------------------------------------


def _errors(
    sources: ModuleType, tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch
) -> list[str]:
    monkeypatch.setattr(sources, "ROOT", tmp_path)
    (tmp_path / "bench.py").write_text("")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True, exist_ok=True)
    (tmp_path / "benchmarks" / "results" / "out.txt").write_text("12 passed in 3.5 s\n")
    (tmp_path / "docs").mkdir(exist_ok=True)
    page = tmp_path / "docs" / "page.md"
    page.write_text(text)
    errors: list[str] = sources.check_page(page)
    return errors


SOURCE = "<!-- source: benchmarks/results/out.txt (python bench.py) -->\n"


@pytest.mark.parametrize(
    "figure",
    [
        "takes 39.1 ms",
        "2.00 GiB of memory",
        "1.25x the floor",
        "within 1%",
        "an error of 5.2e-9",
        "7 of 12 pass",
        "all 389 tests",
    ],
)
def test_a_figure_without_a_source_fails(
    sources: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, figure: str
) -> None:
    [error] = _errors(sources, tmp_path, f"# Page\n\nThe kernel {figure}.\n", monkeypatch)
    assert "figures with no source" in error


def test_a_source_above_in_the_section_covers_its_figures(
    sources: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = f"# Page\n\n{SOURCE}The suite: 12 passed in 3.5 s, 1.25x the floor.\n"
    assert _errors(sources, tmp_path, text, monkeypatch) == []
    # The next heading ends the section: the same figure there needs its own source.
    text += "\n## Next\n\nAlso 1.25x.\n"
    assert len(_errors(sources, tmp_path, text, monkeypatch)) == 1


def test_code_spans_and_code_blocks_hold_no_figures(
    sources: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "# Page\n\nA tolerance of `1.3e-6`.\n\n```text\n1.25x 39 ms\n```\n"
    assert _errors(sources, tmp_path, text, monkeypatch) == []


def test_a_count_missing_from_its_sources_is_stale(
    sources: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    [error] = _errors(sources, tmp_path, f"# Page\n\n{SOURCE}All 13 tests pass.\n", monkeypatch)
    assert "the count '13 tests' is in none of the section's sources" in error


def test_a_source_that_does_not_exist_fails(
    sources: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (
        "# Page\n\n<!-- source: benchmarks/results/gone.txt (python gone.py) -->\nIt takes 3 ms.\n"
    )
    errors = _errors(sources, tmp_path, text, monkeypatch)
    assert any("benchmarks/results/gone.txt does not exist" in e for e in errors)
    assert any("gone.py does not exist" in e for e in errors)


def test_a_repository_path_that_leads_nowhere_fails(
    sources: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "# Page\n\nSee `benchmarks/results/out.txt` and `benchmarks/results/missing.txt`.\n"
    [error] = _errors(sources, tmp_path, text, monkeypatch)
    assert "benchmarks/results/missing.txt does not exist" in error


def test_the_readme_test_command_is_what_ci_runs(sources: ModuleType) -> None:
    assert sources.test_command_in_ci() == []


# --- the modules' import layers --------------------------------------------------------------


def test_imports_under_type_checking_do_not_count(
    module_table: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""The package."""\n')
    (package / "light.py").write_text(
        '"""Light.\n\nNo torch."""\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n'
        "    import torch\n\n\ndef f():\n    import torch\n"
    )
    (package / "heavy.py").write_text('"""Heavy."""\nfrom pkg import light\nimport numpy\n')
    (package / "through.py").write_text('"""Through."""\nfrom pkg.heavy import x\n')
    monkeypatch.setitem(module_table.PACKAGES, "pkg", package)
    layers = module_table.loads_heavy("pkg")
    assert layers["pkg.light"] == (False, {"pkg"})  # a submodule loads its package first
    assert layers["pkg.heavy"][0] is True
    assert layers["pkg.through"] == (True, {"pkg", "pkg.heavy"})
    assert module_table.concern(package / "light.py") == "Light."
