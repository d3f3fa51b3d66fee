"""Generated blocks in the docs: text between ``<!-- NAME: ARGUMENT -->`` and ``<!-- /NAME -->``.

scripts/settings_table.py and scripts/module_table.py write such blocks from the code they
describe; with ``--check`` they change nothing and fail where a committed block differs, so
CI (scripts/check_docs.sh) fails when the docs and the code part.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def replace_blocks(text: str, name: str, render: Callable[[str], str]) -> str:
    """``text`` with every ``NAME`` block's body replaced by ``render(ARGUMENT)``."""
    opening = rf"(<!-- {re.escape(name)}: (?P<argument>[\w-]+) -->\n)"
    closing = rf"(<!-- /{re.escape(name)} -->)"
    pattern = re.compile(rf"{opening}(?P<body>.*?){closing}", re.DOTALL)

    def substitute(match: re.Match[str]) -> str:
        body = render(match.group("argument")).rstrip("\n") + "\n"
        return f"{match.group(1)}{body}{match.group(4)}"

    return pattern.sub(substitute, text)


def main(
    name: str, render: Callable[[str], str], pages: Sequence[Path], argv: Sequence[str]
) -> int:
    """Write (or with ``--check`` compare) every ``name`` block of ``pages``; 1 where one
    is stale (with --check) or a page holds none."""
    check = "--check" in argv
    status = 0
    for page in pages:
        text = page.read_text(encoding="utf-8")
        if f"<!-- {name}: " not in text:
            print(f"{page.relative_to(ROOT)}: no <!-- {name}: ... --> block", file=sys.stderr)
            status = 1
            continue
        new = replace_blocks(text, name, render)
        if new == text:
            continue
        if check:
            script = Path(sys.argv[0]).resolve()
            shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script.name
            print(
                f"{page.relative_to(ROOT)}: the {name} block differs from the code it is "
                f"generated from; run: python {shown}",
                file=sys.stderr,
            )
            status = 1
        else:
            page.write_text(new, encoding="utf-8")
            print(f"wrote {page.relative_to(ROOT)}")
    return status
