#!/usr/bin/env bash
# Fails, naming each short filesystem, when any of DIR... has less than GIB GiB free. Used by
# .ci/run before it installs anything, so that a host short of disk says so at once.
#   bash scripts/check_free_disk.sh GIB DIR...
set -euo pipefail
if (($# < 2)) || [[ ! "$1" =~ ^[0-9]+$ ]]; then
    echo "check_free_disk.sh: expected GIB, a whole number of GiB, then one directory or more" \
        "(got: $*); e.g. bash scripts/check_free_disk.sh 13 . (.ci/run: set GRADREF_CI_DISK_GIB" \
        "to a whole number)" >&2
    exit 2
fi
need_gib=$1
shift
status=0
for dir in "$@"; do
    free_kib=$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')
    free_gib=$((free_kib / 1024 / 1024))
    if ((free_gib < need_gib)); then
        echo "check_free_disk.sh: $dir has $free_gib GiB free, and this run needs about" \
            "$need_gib GiB there at its peak: free some space, or run on a larger disk" >&2
        status=1
    else
        echo "disk: $dir has $free_gib GiB free (this run needs about $need_gib GiB)"
    fi
done
exit $status
