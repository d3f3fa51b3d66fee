#!/usr/bin/env bash
# Writes tests/kernels/precision-baseline-cpu.json: the kernel suite's precision report on the
# CPU, which CI compares every run with (.ci/run). Run it on purpose, after a change that is
# meant to move the kernel's errors, and commit the file with that change; CI never writes it.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/pytest tests/kernels -q -p xdist -n 2 -p no:cacheprovider --gradref-device=cpu \
    --gradref-report=tests/kernels/precision-baseline-cpu.json
