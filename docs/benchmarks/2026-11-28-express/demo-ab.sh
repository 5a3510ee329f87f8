#!/bin/bash
# The demo with and without express endpoints, alternating run by run, one
# tree (the connector's `express` setting). Prints each run's summary.
#   bash docs/benchmarks/2026-11-28-express/demo-ab.sh OUT_DIR PAIRS
set -euo pipefail
out=$1 pairs=${2:-3}
mkdir -p "$out"
for i in $(seq 1 "$pairs"); do
  order="off on"; [ $((i % 2)) = 0 ] && order="on off"
  for side in $order; do
    extra='{"express": false}'; [ "$side" = on ] && extra='{"express": true}'
    .venv/bin/rdma-kv demo --seed 1 --extra-config "$extra" > "$out/demo-$side-$i.txt" 2>&1
    echo "$side $i done $(date +%T) load=$(cut -d' ' -f1 /proc/loadavg)"
  done
done
