"""Checks that every figure in the docs names where it comes from, and that what the docs name
exists.

The pages checked are README.md, docs/*.md and kernels/gradref_kernels/README.md (CHANGELOG.md
is history: its figures are as measured for that release, and the docs do not repeat them).

1. Figures. A figure is a measurement written in prose or in a table: a time, a size, a clock
   or a power (``39.1 ms``, ``2.00 GiB``), a ratio (``1.25x``), a percentage, a number in
   scientific notation, a count of tests, cases, items or operators, or "N of M". Each one sits
   in a section (the text between two headings) that holds a source comment before it:

       <!-- source: RESULTS [RESULTS...] (COMMAND) -->

   RESULTS are files in the repository that hold the figures (``benchmarks/results/...``, or a
   test that asserts them), and COMMAND the command that writes or checks them, naming a
   script, a test file or a test directory of the repository. Every file named must exist.
   A count (``14 cases``, ``7 of 12``) must appear, as a number, in one of the section's
   RESULTS files, so a count typed by hand or left behind by a later run fails; the docs
   state no total of the test suite.
   Values that are code (defaults, tolerances) are written as code spans, which are not
   figures; code blocks are output or code, and are run or skip-marked by the doc tests.
2. Paths. A code span that names a repository path (``benchmarks/...``, ``tests/...``,
   ``scripts/...``, ``pytest_gradref/...``, ``kernels/...``, ``docs/...``, ``.ci/...``)
   must exist, and so must the relative links of the pages outside docs/ (mkdocs checks those
   inside it).
3. The test command. The README's test command (its bash line that runs ``.venv/bin/pytest``
   on no path) is what CI runs: ``.ci/run`` holds a line that starts with it.

    python scripts/check_doc_sources.py
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNIT = r"(?:ms|us|µs|ns|s|min|GiB|MiB|KiB|GB|MB|KB|MHz|GHz|W|bytes|TFLOP/s)"
NUMBER = r"\d[\d,]*(?:\.\d+)?"
COUNT_NOUNS = (
    r"(?:tests?|cases?|items?|operators|dispatched operators|passed|failed|skipped|xfailed"
    r"|compiles|examples|regressions?|variants)"
)
FIGURES = (
    re.compile(rf"(?<![\w.]){NUMBER}\s?{UNIT}(?![\w/])"),
    re.compile(rf"(?<![\w.]){NUMBER}x\b"),
    re.compile(rf"(?<![\w.]){NUMBER}\s?%"),
    re.compile(r"(?<![\w.])\d+(?:\.\d+)?e[-+]?\d+\b"),
)
COUNTS = (
    re.compile(r"(?<![\w.-])(?P<n>\d[\d,]*) of \d[\d,]*\b"),
    re.compile(rf"(?<![\w.-])(?P<n>\d[\d,]*) (?:\w+ )?{COUNT_NOUNS}\b"),
)
SOURCE = re.compile(r"<!--\s*source:\s*(?P<body>.*?)-->", re.DOTALL)
REPO_PATH = re.compile(
    r"^(?:benchmarks|tests|scripts|pytest_gradref|kernels|docs|\.ci)/[\w./-]*[\w/]$"
)


def pages() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "kernels" / "gradref_kernels" / "README.md",
    ]


@dataclass
class Unit:
    """A paragraph, list, table, heading, comment or code block, and where it starts."""

    line: int
    text: str
    kind: str  # "prose", "code", "heading", "comment"


def units(text: str) -> Iterator[Unit]:
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        stripped = line.strip()
        if not stripped:
            index += 1
            continue
        fence = re.match(r"\s*(?:[-*+]\s+|\d+[.)]\s+)?(`{3,}|~{3,})", line)
        if fence:
            marker = fence.group(1)
            end = index + 1
            while end < len(lines) and not lines[end].strip().startswith(marker):
                end += 1
            yield Unit(index + 1, "\n".join(lines[index : end + 1]), "code")
            index = end + 1
            continue
        if stripped.startswith("<!--"):
            end = index
            while "-->" not in lines[end]:
                end += 1
            yield Unit(index + 1, "\n".join(lines[index : end + 1]), "comment")
            index = end + 1
            continue
        if stripped.startswith("#"):
            yield Unit(index + 1, line, "heading")
            index += 1
            continue
        end = index
        while (
            end + 1 < len(lines)
            and lines[end + 1].strip()
            and not re.match(r"\s*(`{3,}|~{3,})", lines[end + 1])
            and not lines[end + 1].lstrip().startswith("#")
        ):
            end += 1
        yield Unit(index + 1, "\n".join(lines[index : end + 1]), "prose")
        index = end + 1


def prose(text: str) -> str:
    """The text a reader reads as figures: no code spans, comments, link targets or images."""
    text = SOURCE.sub(" ", text)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.DOTALL)
    text = re.sub(r"`+[^`]*`+", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    return text


@dataclass
class Source:
    line: int
    results: list[str] = field(default_factory=list)
    command: str = ""


def parse_source(body: str, line: int) -> tuple[Source, list[str]]:
    """A source comment's files and command, and what is wrong with it."""
    errors = []
    body = " ".join(body.split())
    match = re.match(r"(?P<files>[^(]*)\((?P<command>.*)\)\s*$", body)
    if not match:
        return Source(line), ["a source comment is `<!-- source: RESULTS... (COMMAND) -->`"]
    files = [word.strip(",;") for word in match.group("files").split() if word.strip(",;")]
    source = Source(line, files, match.group("command"))
    if not files:
        errors.append("a source comment names no results file")
    for name in files:
        if not (ROOT / name.split("::")[0]).is_file():
            errors.append(f"the source {name} does not exist")
    named = [
        word.strip("'\";,")
        for word in source.command.split()
        if re.search(r"\.(py|sh)(::\S*)?$", word.strip("'\";,"))
        or REPO_PATH.match(word.strip("'\";,"))
    ]
    if not named:
        errors.append(
            f"the command ({source.command}) names no script, test file or test directory"
        )
    for word in named:
        if not (ROOT / word.split("::")[0]).exists():
            errors.append(f"the command's {word} does not exist")
    return source, errors


def check_page(path: Path) -> list[str]:
    errors: list[str] = []
    where = path.relative_to(ROOT).as_posix()
    sources: list[Source] = []
    for unit in units(path.read_text(encoding="utf-8")):
        if unit.kind == "heading":
            sources = []
            continue
        if unit.kind == "code":
            continue  # code and output: run or skip-marked by the doc tests
        for match in SOURCE.finditer(unit.text):
            line = unit.line + unit.text.count("\n", 0, match.start())
            source, problems = parse_source(match.group("body"), line)
            sources.append(source)
            errors.extend(f"{where}:{line}: {problem}" for problem in problems)
        if unit.kind in ("prose",):
            errors.extend(f"{where}:{unit.line}: {e}" for e in check_paths(unit.text, path))
            text = prose(unit.text)
            figures = sorted({m.group(0) for pattern in FIGURES for m in pattern.finditer(text)})
            counts = sorted({m.group(0) for pattern in COUNTS for m in pattern.finditer(text)})
            if (figures or counts) and not sources:
                shown = ", ".join([*figures, *counts][:4])
                errors.append(
                    f"{where}:{unit.line}: figures with no source in their section ({shown}); "
                    "add <!-- source: RESULTS (COMMAND) --> above them"
                )
                continue
            for count in counts:
                number = re.match(r"\d[\d,]*", count)
                assert number is not None
                if not any(_holds(name, number.group(0)) for s in sources for name in s.results):
                    errors.append(
                        f"{where}:{unit.line}: the count {count!r} is in none of the section's "
                        f"sources ({', '.join(n for s in sources for n in s.results)}): stale, "
                        "or typed by hand"
                    )
    return errors


def _holds(name: str, number: str) -> bool:
    path = ROOT / name.split("::")[0]
    if not path.is_file():
        return False
    text = path.read_text(encoding="utf-8", errors="replace")
    plain = number.replace(",", "")
    return bool(re.search(rf"(?<![\d.]){re.escape(plain)}(?![\d])", text.replace(",", "")))


def check_paths(text: str, page: Path) -> list[str]:
    errors = []
    for span in re.findall(r"`([^`\s]+)`", text):
        candidate = span.split("::")[0].rstrip(",.:")
        if REPO_PATH.match(candidate) and not (ROOT / candidate).exists():
            errors.append(f"{candidate} does not exist")
    if page.parent != ROOT / "docs":
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                errors.append(f"the link {target} leads nowhere")
    return errors


def test_command_in_ci() -> list[str]:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL):
        for line in block.splitlines():
            line = line.split("#")[0].strip()
            if line.startswith(".venv/bin/pytest") and not any(
                not word.startswith("-") and not word.isdigit() and word != "auto"
                for word in line.split()[1:]
            ):
                commands.append(line.removeprefix(".venv/bin/"))
    if len(commands) != 1:
        return [
            f"README.md: expected one test command (.venv/bin/pytest on no path), found {commands}"
        ]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    if not any(re.match(rf"{re.escape(commands[0])}(\s|$)", line) for line in ci):
        return [f".ci/run does not run the README's test command: {commands[0]}"]
    return []


def run(argv: Sequence[str]) -> int:
    errors = [error for page in pages() for error in check_page(page)]
    errors += test_command_in_ci()
    for error in errors:
        print(error, file=sys.stderr)
    if errors:
        print(f"{len(errors)} problem(s) in the docs' sources", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
