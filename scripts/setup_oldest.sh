#!/usr/bin/env bash
# Creates .venv-oldest: the project at its declared lower bounds (the oldest Python that
# requires-python admits, and scripts/oldest-constraints.txt), for CI to prove those bounds.
# Set GRADREF_OLDEST_PYTHON to an interpreter to use instead of the one found here.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '[setup_oldest %3ds] %s\n' "$SECONDS" "$*"; }

# The oldest Python comes from pyproject.toml, so raising requires-python moves this env too.
minor=$(sed -n 's/^requires-python = ">=\(3\.[0-9]*\)"$/\1/p' pyproject.toml)
if [[ -z "$minor" ]]; then
    echo 'setup_oldest.sh: expected a line requires-python = ">=3.N" in pyproject.toml' >&2
    exit 1
fi
# The first candidate that runs as that version: pyenv's shims are on PATH for every version
# but run only the selected ones, so its versions directory is searched as well.
candidates=("${GRADREF_OLDEST_PYTHON:-}" "$(command -v "python$minor" || true)")
if command -v pyenv >/dev/null; then
    candidates+=($(ls -d "$(pyenv root)"/versions/"$minor".*/bin/python 2>/dev/null | sort -rV))
fi
python=""
for candidate in "${candidates[@]}"; do
    if [[ -n "$candidate" ]] && [[ "$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" == "$minor" ]]; then
        python="$candidate"
        break
    fi
done
if [[ -z "$python" ]]; then
    echo "setup_oldest.sh: no Python $minor found (tried GRADREF_OLDEST_PYTHON, python$minor on" \
        "PATH and pyenv's versions); install it, e.g. 'pyenv install $minor', or set" \
        "GRADREF_OLDEST_PYTHON=/path/to/python$minor" >&2
    exit 1
fi
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
step "done: $(.venv-oldest/bin/python -c 'import pluggy, pytest, torch, xdist; print(f"torch {torch.__version__}, pytest {pytest.__version__}, pluggy {pluggy.__version__}, pytest-xdist {xdist.__version__}")')"
