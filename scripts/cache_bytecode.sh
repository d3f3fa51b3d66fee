#!/usr/bin/env bash
# Writes the bytecode that every pytest process of the suite reads: pytest rewrites the asserts
# of each module of a plugin's distribution (hypothesis, xdist, this project's packages) and of
# the test files, and caches the result beside the source, unless PYTHONDONTWRITEBYTECODE is
# set, as container images often set it. Then every pytest process the suite starts (generated
# runs, their xdist workers, torchrun's ranks) rewrote them all again. One collection of the
# suite with writing allowed caches them for all; later processes read the cache whatever the
# variable says, and rewrite only a source changed since.
#
#   bash scripts/cache_bytecode.sh PYTHON [TEST_PATH...]    (default: tests)
set -euo pipefail
cd "$(dirname "$0")/.."
python="$1"
shift
# A collection error leaves some modules uncached, which costs time, not results: it is printed,
# and the setup goes on (the test run reports the error itself).
status=0
env -u PYTHONDONTWRITEBYTECODE "$python" -m pytest --collect-only -q -p no:randomly \
    -p no:cacheprovider --continue-on-collection-errors "${@:-tests}" >/dev/null || status=$?
if ((status != 0)); then
    echo "cache_bytecode.sh: collecting ${*:-tests} exited $status; the modules it could not" \
        "import are not cached (run pytest --collect-only ${*:-tests} to see why)"
fi
