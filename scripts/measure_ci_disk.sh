#!/usr/bin/env bash
# Measures the disk a full CI run takes at its peak: clones REV (default HEAD) of this checkout
# into a new directory, runs its .ci/run there with a new Inductor cache, samples the used space
# of the clone's filesystem every 3 s, prints the peak over the start, the run's exit status and
# seconds, and its stage table (or, if it failed, its last 40 lines), and removes the clone. .ci/run's disk check (GRADREF_CI_DISK_GIB) is set from this figure.
# Another job writing to the same filesystem meanwhile adds to the figure: run it on a quiet one.
#   bash scripts/measure_ci_disk.sh [REV]
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$(git rev-parse --short "${1:-HEAD}") # now: a commit made meanwhile is not this run's
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git clone -q . "$work/clone"
git -C "$work/clone" checkout -q "$rev"
used_mib() { df -Pk "$work" | awk 'NR == 2 { print int($3 / 1024) }'; }
start=$(used_mib)
(
    cd "$work/clone"
    TORCHINDUCTOR_CACHE_DIR="$work/inductor" bash .ci/run >"$work/ci.log" 2>&1
) &
ci=$!
peak=$start
while kill -0 "$ci" 2>/dev/null; do
    now=$(used_mib)
    ((now > peak)) && peak=$now
    sleep 3
done
status=0
wait "$ci" || status=$?
echo "$rev: .ci/run exited $status after $SECONDS s; its peak disk use" \
    "over the start: $((peak - start)) MiB ($(awk -v m=$((peak - start)) 'BEGIN { printf "%.1f", m / 1024 }') GiB)"
if ((status == 0)); then
    sed -n '/^stage times against/,$p' "$work/ci.log"
else
    tail -40 "$work/ci.log"
fi
exit $status
