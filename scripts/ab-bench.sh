#!/usr/bin/env bash
# A/B benchmark of two prebuilt builds on one model, alternating A B A B ...
# so drift on the machine hits both alike. Each run is one `pulsar-host bench`
# with the given arguments (and a fresh census: the .warm sidecar is removed).
#
#   scripts/ab-bench.sh A_DIR B_DIR MODEL ROUNDS OUT_DIR -- BENCH_ARGS...
#
# A_DIR/B_DIR as laid out by scripts/devbin.sh (pulsar-host, plugins/).
# Prints each run's table rows; full tables go to OUT_DIR/{A,B}-ROUND.txt.
set -uo pipefail
[ $# -ge 6 ] || { echo "usage: scripts/ab-bench.sh A_DIR B_DIR MODEL ROUNDS OUT_DIR -- BENCH_ARGS..." >&2; exit 2; }
A="$1" B="$2" M="$3" N="$4" O="$5"
shift 5
[ "${1:-}" = "--" ] && shift
mkdir -p "$O"
for r in $(seq 1 "$N"); do
  for side in A B; do
    dir="$A"; [ "$side" = B ] && dir="$B"
    rm -f "$M.warm"
    t0=$(date +%s)
    "$dir/pulsar-host" bench -m "$M" "$@" --plugin-dir "$dir/plugins" > "$O/$side-$r.txt" 2>>"$O/ab-$side.log"
    rc=$?
    echo "== $side round $r ($(( $(date +%s) - t0 )) s, exit $rc)"
    grep -E '^\| .*\| (pp|tg)[0-9]+ ' "$O/$side-$r.txt"
  done
done
