"""Timings live in results files with their source, not in code: a figure in a comment or a
docstring goes stale the day the code it describes gets faster, and no check would see it.
The Python of the package, the kernels, the tests, the benchmarks and the scripts is scanned
for a duration (a number with a unit of time) in its comments and docstrings. A limit the code
sets (a line that names a timeout) and a literal in double backquotes are not measurements."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ["pytest_gradref", "kernels", "tests", "benchmarks", "scripts"]
DURATION = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s?(?:ms|µs|us|ns|s|seconds|minutes|min)\b"
)
LITERAL = re.compile(r"``.*?``")


def prose(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of each comment and each line of each docstring in ``source``."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                for offset, line in enumerate(docstring.splitlines()):
                    yield node.body[0].lineno + offset, line


def durations(text: str) -> list[str]:
    """The durations a line of prose states as measured."""
    if "timeout" in text:
        return []
    return DURATION.findall(LITERAL.sub("", text))


def test_the_scan_finds_a_timing_and_passes_a_limit() -> None:
    source = (
        '"""Module.\n\nA one-test run took 1.9 s, of which the import is 1.2-1.5 s."""\n'
        "x = 1  # about 0.6 ms a call\n"
        "y = 2  # the rank timeout of 300 s, a limit\n"
        "z = 3  # a figure in a literal, ``39.1 ms``, is an example\n"
    )
    found = [(line, durations(text)) for line, text in prose(source)]
    assert [(line, hits) for line, hits in found if hits] == [
        (4, ["0.6 ms"]),
        (3, ["1.9 s", "1.2-1.5 s"]),
    ]


@pytest.mark.parametrize("folder", SCANNED)
def test_no_timing_in_comments_or_docstrings(folder: str) -> None:
    stated = [
        f"{path.relative_to(ROOT)}:{line}: {', '.join(hits)} in {text.strip()!r}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        if ".venv" not in path.parts
        for line, text in prose(path.read_text(encoding="utf8"))
        if (hits := durations(text))
    ]
    assert not stated, (
        "timings belong in a results file with their source (benchmarks/results/), not in "
        "code; cite the file instead:\n" + "\n".join(stated)
    )
