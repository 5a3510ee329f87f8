#!/bin/bash
# Alternating before/after of issue 16's transport re-cut: rdma-kv only (2 lanes and 1), every transfer notified.
cd "$(dirname "$0")"  # results land beside this script (they were renamed 2026-11-24-1346-house-*)
# "before": /tmp/before16 is a checkout of 3f7ae66 after `make install`.
uptime > uptime-start.txt
for i in 1 2 3 4; do
  for side in after before; do
    if [ $side = after ]; then B=/work/main/.venv/bin/rdma-kv; else B=/tmp/before16/.venv/bin/rdma-kv; fi
    timeout 900 $B bench --notify --no-cma --perftest '' --reps 5 --json $side-$i.json > $side-$i.txt 2>&1
    echo "$side $i rc=$? $(date -u +%H:%M:%S)" >> progress.txt
  done
done
uptime > uptime-end.txt
