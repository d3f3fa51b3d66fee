"""Runs the code blocks of the docs as a user would paste them: a pytest plugin built on Sybil.

scripts/check_docs.sh loads it (``python -m pytest -p doc_examples README.md docs ...`` with
``scripts`` on ``PYTHONPATH``). Each page runs in a directory of its own, block after block:

- ``python``: executed in the page's namespace (so later blocks see earlier names);
- a block with a title, ```` ```python title="test_first.py" ```` (any language): written to
  that file in the page's directory (a test file, a ``pyproject.toml``), not executed;
- ``bash`` / ``sh`` / ``shell``: run with bash (``-e``, ``-o pipefail``) in the page's
  directory, the environment's ``bin`` first on the PATH, no ``GRADREF_*`` variables;
- the page's directory holds a link to the repository's ``benchmarks/``, so a command that
  reads committed results (``benchmarks/results/...``) runs as from the repository's root;
- ``console`` and ``pycon`` (transcripts, with their output) cannot run: they, and any block
  above that cannot run here, carry ``<!-- skip: next "the reason" -->`` on the line before.
  A skip without a reason is an error.

``<!-- invisible-code-block: LANGUAGE ... -->`` holds set-up or a check that the page does not
show (a command that runs the test files the page wrote, or an assertion on what a block
printed). Every ``test_*.py`` a page writes must be run by one of its shell blocks (one that
names it, or a bare ``pytest``), so no test file on a page goes unrun.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sybil import Document, Example, Region, Sybil
from sybil.evaluators.python import PythonEvaluator
from sybil.parsers.abstract.lexers import LexerCollection
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer, RawFencedCodeBlockLexer
from sybil.parsers.markdown.skip import SkipParser

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = {"python", "py", "bash", "sh", "shell"}
TRANSCRIPTS = {"console", "pycon", "shell-session"}
SHELL = {"bash", "sh", "shell"}
TITLE = re.compile(r'title="(?P<title>[^"]+)"')
DIR_KEY = "__doc_dir__"
WRITTEN_KEY = "__doc_test_files__"
RUN_KEY = "__doc_shell_commands__"


class ReasonedSkipParser(SkipParser):
    """Sybil's skip, which must say why: ``<!-- skip: next "needs a GPU" -->``."""

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in super().__call__(document):
            action, reason = region.parsed
            if action in ("next", "start") and not (reason or "").strip():
                line = document.text.count("\n", 0, region.start) + 1
                raise ValueError(
                    f"{document.path}:{line}: 'skip: {action}' needs a reason, e.g. "
                    f'<!-- skip: {action} "needs a GPU" -->'
                )
            yield region


class BlockParser:
    """Fenced and invisible code blocks: the language, the title and the source."""

    def __init__(self) -> None:
        self.lexers = LexerCollection(
            [
                RawFencedCodeBlockLexer(
                    info_pattern=re.compile(r"(?P<info>[^\n]*)$\n", re.MULTILINE),
                ),
                DirectiveInHTMLCommentLexer(directive=r"invisible-code-block", arguments=r"[^\n]+"),
            ]
        )
        self.python = PythonEvaluator()

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in self.lexers(document):
            info = region.lexemes.get("info") or region.lexemes.get("arguments") or ""
            language = (info.split() or [""])[0].strip("{}.")
            title = TITLE.search(info)
            if title:
                region.parsed = (title.group("title"), region.lexemes["source"])
                region.evaluator = write_file
            elif language in ("python", "py"):
                region.parsed = region.lexemes["source"]
                region.evaluator = self.evaluate_python
            elif language in SHELL:
                region.parsed = region.lexemes["source"]
                region.evaluator = run_shell
            elif language in TRANSCRIPTS:
                region.parsed = language
                region.evaluator = refuse_transcript
            else:
                continue
            yield region

    def evaluate_python(self, example: Example) -> Any:
        with _in_page_dir(example):
            return self.python(example)


class _in_page_dir:
    def __init__(self, example: Example) -> None:
        self.dir = page_dir(example.namespace)
        self.previous = os.getcwd()

    def __enter__(self) -> None:
        os.chdir(self.dir)

    def __exit__(self, *exc: object) -> None:
        os.chdir(self.previous)


def page_dir(namespace: dict[str, Any]) -> Path:
    if DIR_KEY not in namespace:
        directory = Path(tempfile.mkdtemp(prefix="gradref-docs-"))
        # Commands that read committed results (benchmarks/results/...) run as from the root.
        (directory / "benchmarks").symlink_to(ROOT / "benchmarks", target_is_directory=True)
        namespace[DIR_KEY] = directory
        namespace[WRITTEN_KEY] = []
        namespace[RUN_KEY] = []
    directory: Path = namespace[DIR_KEY]
    return directory


def write_file(example: Example) -> None:
    name, source = example.parsed
    target = page_dir(example.namespace) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(str(source), encoding="utf-8")
    if Path(name).name.startswith("test_") and name.endswith(".py"):
        example.namespace[WRITTEN_KEY].append(name)


def child_environment() -> dict[str, str]:
    """The environment a user's shell would have: this environment's commands first on the
    PATH, none of the gradref settings or pytest options of the shell running the check."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("GRADREF_", "PYTEST_")) and key != "PYTHONPATH"
    }
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def run_shell(example: Example) -> None:
    source = str(example.parsed)
    directory = page_dir(example.namespace)
    example.namespace[RUN_KEY].append(source)
    completed = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", source],
        cwd=directory,
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    example.namespace["shell_output"] = completed.stdout
    if completed.returncode != 0:
        raise AssertionError(
            f"the shell block exited with status {completed.returncode}:\n{source}\n"
            f"--- stdout\n{completed.stdout}\n--- stderr\n{completed.stderr}"
        )


def refuse_transcript(example: Example) -> None:
    raise AssertionError(
        f"a {example.parsed} block (a transcript) cannot run: write its commands as a bash "
        'block, or put <!-- skip: next "why it cannot run here" --> on the line before it'
    )


def setup(namespace: dict[str, Any]) -> None:
    page_dir(namespace)


def teardown(namespace: dict[str, Any]) -> None:
    directory = namespace.get(DIR_KEY)
    written: list[str] = namespace.get(WRITTEN_KEY, [])
    commands: list[str] = namespace.get(RUN_KEY, [])
    try:
        unrun = [name for name in written if not _was_run(name, commands)]
        if unrun:
            raise AssertionError(
                f"test files written and never run by a shell block of the page: "
                f"{', '.join(unrun)} (add a block that runs pytest on them, visible or in "
                "<!-- invisible-code-block: bash ... -->)"
            )
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def _was_run(name: str, commands: list[str]) -> bool:
    for command in commands:
        for line in command.splitlines():
            words = line.split("#")[0].split()
            if "pytest" not in " ".join(words):
                continue
            if name in line or not any(word.endswith(".py") for word in words):
                return True
    return False


doc_examples = Sybil(
    parsers=[ReasonedSkipParser(), BlockParser()],
    path=str(ROOT),
    patterns=["README.md", "docs/*.md"],
    setup=setup,
    teardown=teardown,
)
pytest_collect_file = doc_examples.pytest()
