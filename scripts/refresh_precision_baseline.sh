#!/usr/bin/env bash
# Writes tests/kernels/precision-baseline-cpu.json: the precision report of the suite that CI
# gates on it (.ci/run: the README's test command, every test under tests/), on the CPU. Run it
# on purpose, after a change that is meant to move the errors or that adds gradref items, and
# commit the file with that change; CI never writes it, and fails naming this script when the
# suite records items the file lacks (the gradref_baseline_refresh ini key in pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pytest -q -p xdist -n 2 -p no:cacheprovider --gradref-device=cpu \
    --gradref-report=tests/kernels/precision-baseline-cpu.json
