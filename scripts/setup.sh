#!/usr/bin/env bash
# Creates .venv and installs the project with everything its tests, benchmarks and checks use.
# torch is installed first and pinned, so that no later requirement pulls in another build: the
# newest tested release built for the running Python. Set GRADREF_TORCH to choose another one
# (e.g. GRADREF_TORCH="torch==2.11.0"), GRADREF_PYTHON to the interpreter (default python3) and
# GRADREF_VENV to the environment's directory (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '[setup %3ds] %s\n' "$SECONDS" "$*"; }

python="${GRADREF_PYTHON:-python3}"
venv="${GRADREF_VENV:-.venv}"
step "creating $venv with $python ($("$python" --version 2>&1))"
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install)
minor=$("$venv/bin/python" -c 'import sys; print(sys.version_info[1])')
if [[ -n "${GRADREF_TORCH:-}" ]]; then
    torch="$GRADREF_TORCH"
elif ((minor < 10)); then
    torch="torch==2.8.0" # the last release built for Python 3.9
else
    torch="torch==2.13.0"
fi
step "upgrading pip"
"${pip[@]}" --quiet --upgrade pip
# The longest step (a minute or more, a few GB for a CUDA build): pip names each file it
# downloads and shows its progress.
step "installing $torch"
"${pip[@]}" --progress-bar on "$torch"
step "installing the project, editable, with its test, triton, bench, lint and docs extras"
"${pip[@]}" --quiet -e ".[test,triton,bench,lint,docs]"
step "caching the bytecode pytest rewrites (scripts/cache_bytecode.sh)"
bash scripts/cache_bytecode.sh "$venv/bin/python"
step "done: $("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'); activate with '. $venv/bin/activate'"
