#!/usr/bin/env bash
# Creates .venv and installs the project with everything its tests, benchmarks and checks use.
# torch is installed first and pinned, so that no later requirement pulls in another build;
# set GRADREF_TORCH to choose another one (e.g. GRADREF_TORCH="torch==2.11.0").
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "${GRADREF_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install --quiet -e ".[test,triton,bench,lint]"
