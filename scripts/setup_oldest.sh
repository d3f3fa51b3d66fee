#!/usr/bin/env bash
# Creates .venv-oldest: the project at its declared lower bounds (the oldest Python that
# requires-python admits, and scripts/oldest-constraints.txt), for CI to prove those bounds.
# Set GRADREF_OLDEST_PYTHON to an interpreter to use instead of the one found here.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '[setup_oldest %3ds] %s\n' "$SECONDS" "$*"; }

. scripts/oldest_python.sh
python=$(oldest_python)
step "Python: $python ($("$python" -c 'import platform; print(platform.python_version())'))"
rm -rf .venv-oldest
"$python" -m venv .venv-oldest
pip=(.venv-oldest/bin/python -m pip install --quiet -c scripts/oldest-constraints.txt)
step "upgrading pip"
.venv-oldest/bin/python -m pip install --quiet --upgrade pip
# torch 2.6.0 exists for this Python only as PyPI's CUDA build, which imports only with its
# nvidia-* wheels: a few GB, fetched once into pip's cache.
step "$(grep '^torch==' scripts/oldest-constraints.txt) with its CUDA libraries (a few GB on a first install)"
"${pip[@]}" torch
step "the project with its test extra, at $(grep -v '^#' scripts/oldest-constraints.txt | grep -v '^torch' | tr '\n' ' ')"
"${pip[@]}" -e ".[test]"
.venv-oldest/bin/python -m pip check
step "caching the bytecode pytest rewrites (scripts/cache_bytecode.sh)"
bash scripts/cache_bytecode.sh .venv-oldest/bin/python tests/plugin tests/kernels
step "done: $(.venv-oldest/bin/python -c 'import pluggy, pytest, torch, xdist; print(f"torch {torch.__version__}, pytest {pytest.__version__}, pluggy {pluggy.__version__}, pytest-xdist {xdist.__version__}")')"
