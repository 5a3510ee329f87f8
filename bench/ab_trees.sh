#!/bin/bash
# Before/after of one change, alternating pair by pair on one machine:
# `rdma-kv bench` as shipped (progress="thread", every transfer notified)
# from two checkouts, each with its own `make install`.
#
#   bench/ab_trees.sh BEFORE_TREE AFTER_TREE OUT PAIRS REPS WORKLOADS [swap]
#
# e.g. bench/ab_trees.sh /work/before /work/main docs/benchmarks/DATE-NAME 3 10 kv-one-block,kv-random
# With "swap", every second pair runs the after tree first. Writes
# OUT/{before,after}-N.{txt,json}; prints each run's time and load.
set -euo pipefail
if [ $# -lt 6 ]; then
  sed -n 2,10p "$0"; exit 2
fi
before=$1 after=$2 out=$(realpath -m "$3") pairs=$4 reps=$5 workloads=$6 swap=${7:-}
mkdir -p "$out"
for i in $(seq 1 "$pairs"); do
  order="before after"
  if [ "$swap" = swap ] && [ $((i % 2)) = 0 ]; then order="after before"; fi
  for side in $order; do
    tree=$before; [ "$side" = after ] && tree=$after
    (cd "$tree" && .venv/bin/rdma-kv bench --notify --progress thread --workloads "$workloads" --reps "$reps" \
        --rounds 2 --json "$out/$side-$i.json" > "$out/$side-$i.txt" 2>&1)
    echo "$side $i done $(date +%T) load=$(cut -d' ' -f1 /proc/loadavg)"
  done
done
