#!/usr/bin/env bash
# The docs' checks, run by CI (.ci/run) in the main environment (the `docs` extra installed):
# the site builds in strict mode (a broken link, anchor or include fails), the settings and
# module tables match the code they are generated from, every figure names its source, and
# every Python and shell block of the README and the docs runs (or says why it cannot here).
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '[docs %3ds] %s\n' "$SECONDS" "$*"; }

step "generated tables (scripts/settings_table.py, scripts/module_table.py)"
python scripts/settings_table.py --check
python scripts/module_table.py --check
step "figures, paths and the README's test command (scripts/check_doc_sources.py)"
python scripts/check_doc_sources.py
step "mkdocs build --strict"
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
# Not --quiet: it hides the warnings that --strict counts, and the build would pass with them.
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$site"
step "the code blocks (Sybil: scripts/doc_examples.py)"
# A page's blocks share a namespace and run in order: --dist loadfile keeps each page on one
# xdist worker, and the pages run side by side.
PYTHONPATH="scripts${PYTHONPATH:+:$PYTHONPATH}" python -m pytest -q -p doc_examples \
    -p no:randomly -p no:cacheprovider -n auto --dist loadfile README.md docs \
    kernels/gradref_kernels/README.md
step "done"
