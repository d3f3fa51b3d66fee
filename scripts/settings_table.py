"""Writes the docs' settings tables from the plugin's one declaration of its settings.

The plugin's ``pytest_addoption`` is called with a parser that records what it registers, so
every option and ini key the plugin declares is listed, a new one included, with the help text
``--help`` shows; ``pytest_gradref.config.settings.OPTIONS`` names the environment variable and the
ini key of each setting that reads them (``OptionSpec.env``, ``OptionSpec.ini``). Blocks
between ``<!-- settings-table: FORMAT -->`` and ``<!-- /settings-table -->`` are written:

- ``full`` (docs/settings.md): option, environment variable, ini key, value, default, help;
- ``compact`` (README.md): option, environment variable, ini key, default;
- ``toml`` (docs/first-test.md): a ``pyproject.toml`` block setting every ini key to its
  default, each with its type, default and help, after pytest's ``-rs``;
- ``markers`` (README.md, docs/settings.md): every marker with its signature and help, from
  the lines the plugin registers them with (``pytest_gradref.config.markers.MARKER_LINES``), which
  ``pytest --markers`` shows too.

    python scripts/settings_table.py            # rewrite the blocks
    python scripts/settings_table.py --check    # fail where a block is stale (CI)
"""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docblocks import ROOT, main

PAGES = (ROOT / "README.md", ROOT / "docs" / "settings.md", ROOT / "docs" / "first-test.md")
NONE = "—"


@dataclass
class Setting:
    """One row: an option, an ini key, or both, with the environment variable where read."""

    flag: str | None = None
    ini: str | None = None
    env: str | None = None
    help: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)
    spec: Any = None

    @property
    def name(self) -> str:
        return self.flag or self.ini or "?"

    @property
    def kind(self) -> str:
        """The value's type, as a user writes it."""
        explicit = getattr(self.spec, "kind", None)
        if isinstance(explicit, str):
            return explicit
        action = self.kwargs.get("action", "store")
        if action in ("store_true", "store_false"):
            return "bool"
        converter = self.kwargs.get("type")
        if converter is float:
            return "number"
        if converter is int or self.default.isdigit():
            return "integer"
        if self.kwargs.get("metavar"):
            return "path"
        return "string"

    @property
    def default(self) -> str:
        """The default as the help states it ("Default: X." or "(default X"), else ""."""
        explicit = getattr(self.spec, "default", None)
        if isinstance(explicit, (str, int, float, bool)) and not isinstance(explicit, bool):
            return str(explicit)
        if isinstance(explicit, bool):
            return "true" if explicit else "false"
        match = re.search(r"Default: (\S+?)\.?(?:\s|$)", self.help) or re.search(
            r"\(default ([^;),]+)", self.help
        )
        if match:
            return match.group(1)
        if self.kwargs.get("action") == "store_true":
            return "false"
        return ""

    def value(self) -> str:
        """What the option takes, for the full table."""
        if self.flag is None:
            return self.kind
        if self.kind == "bool":
            where = " from env and ini" if self.env or self.ini else ""
            return f"flag{'; `true` or `false`' + where if where else ''}"
        metavar = self.kwargs.get("metavar")
        return f"`{metavar}`" if metavar else self.kind


class RecordingParser:
    """Stands in for pytest's parser: records every option and ini key registered."""

    def __init__(self) -> None:
        self.options: list[tuple[tuple[str, ...], dict[str, Any]]] = []
        self.inis: list[tuple[str, str, dict[str, Any]]] = []

    def getgroup(self, *args: Any, **kwargs: Any) -> RecordingParser:
        return self

    def addoption(self, *flags: str, **kwargs: Any) -> None:
        self.options.append((flags, kwargs))

    def addini(self, name: str, help: str = "", *args: Any, **kwargs: Any) -> None:
        self.inis.append((name, help, kwargs))


def declared_settings() -> list[Setting]:
    """Every option and ini key the plugin registers, paired through its OptionSpec."""
    from pytest_gradref import plugin
    from pytest_gradref.config import settings

    parser = RecordingParser()
    plugin.pytest_addoption(parser)  # type: ignore[arg-type]
    by_flag = {spec.flag: spec for spec in settings.OPTIONS}
    rows: list[Setting] = []
    ini_rows: dict[str, Setting] = {}
    for flags, kwargs in parser.options:
        flag = next(f for f in flags if f.startswith("--"))
        spec = by_flag.get(flag)
        row = Setting(flag=flag, help=str(kwargs.get("help", "")), kwargs=kwargs, spec=spec)
        if spec is not None:
            row.env = spec.env
            row.ini = spec.ini
            if row.ini:
                ini_rows[row.ini] = row
        rows.append(row)
    for name, help_text, kwargs in parser.inis:
        if name in ini_rows:
            continue
        rows.append(Setting(ini=name, help=help_text, kwargs=kwargs))
    return rows


def _cell(text: str | None, code: bool = True) -> str:
    if not text:
        return NONE
    return f"`{text}`" if code else text.replace("|", "\\|")


def render(fmt: str) -> str:
    rows = declared_settings()
    if fmt == "full":
        lines = [
            "| option | environment variable | ini key | value | default | what it does |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for row in rows:
            lines.append(
                f"| {_cell(row.flag)} | {_cell(row.env)} | {_cell(row.ini)} | {row.value()} "
                f"| {_cell(row.default)} | {_cell(row.help, code=False)} |"
            )
        return "\n".join(lines)
    if fmt == "compact":
        lines = [
            "| option | environment variable | ini key | default |",
            "| --- | --- | --- | --- |",
        ]
        for row in rows:
            lines.append(
                f"| {_cell(row.flag)} | {_cell(row.env)} | {_cell(row.ini)} "
                f"| {_cell(row.default)} |"
            )
        return "\n".join(lines)
    if fmt == "toml":
        lines = [
            '```toml title="pyproject.toml"',
            "[tool.pytest.ini_options]",
            "# pytest's own: say why each skipped test was skipped (gradref_skip, gradref_only, a",
            "# device that is not there), which pytest prints only with -rs",
            'addopts = "-rs"',
        ]
        for row in rows:
            if not row.ini:
                continue
            also = ", ".join(x for x in (row.flag, row.env) if x)
            default = row.default or "not set"
            head = f"{row.ini}: {row.kind}, default {default}" + (f"; also {also}" if also else "")
            lines.append("")
            lines.extend(textwrap.wrap(head, 96, initial_indent="# ", subsequent_indent="#   "))
            lines.extend(
                textwrap.wrap(row.help, 96, initial_indent="#   ", subsequent_indent="#   ")
            )
            lines.append(f"{row.ini} = {_toml_value(row)}")
        lines.append("```")
        return "\n".join(lines)
    if fmt == "markers":
        from pytest_gradref.config.markers import MARKER_LINES

        lines = ["| marker | effect |", "| --- | --- |"]
        for line in MARKER_LINES:
            signature, _, text = line.partition("): ")
            lines.append(f"| `{signature})` | {_cell(text, code=False)} |")
        return "\n".join(lines)
    raise SystemExit(f"unknown settings-table format {fmt!r}: full, compact, toml or markers")


def _toml_value(row: Setting) -> str:
    default = row.default
    if row.kind == "bool":
        return default if default in ("true", "false") else "false"
    if row.kind in ("integer", "number") and default:
        return default
    return f'"{default}"'


def run(argv: Sequence[str]) -> int:
    return main("settings-table", render, PAGES, argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
