#!/bin/bash
# The pump's doze, before/after, alternating pairs, as shipped (thread, every transfer notified).
#   BEFORE=<checkout of 54ca182, its .so built>/src AFTER=src OUT=<dir> bash docs/benchmarks/2026-12-01-doze/run.sh
# Run from a checkout with .venv (make install); each tree is put first on PYTHONPATH.
set -u
out=${OUT:?}; mkdir -p "$out"
for i in 1 2 3; do
  for side in before after; do
    src=${BEFORE:?}; [ $side = after ] && src=${AFTER:?}
    PYTHONPATH=$src timeout 600 .venv/bin/rdma-kv bench --notify --progress thread \
       --workloads kv-one-block,kv-random --reps 10 --rounds 2 --json "$out/$side-$i.json" > "$out/$side-$i.txt" 2>&1
    echo "$side $i $(date +%T) load=$(cut -d' ' -f1 /proc/loadavg)"
  done
done
