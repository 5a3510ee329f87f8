#!/bin/bash
# Before (f667eb9, /work/before) and after (main) alternating: one notified 2 MiB block as shipped (thread), and random blocks notified (thread).
OUT=/work/main/docs/benchmarks/2026-11-27-service-help
mkdir -p $OUT
for i in 1 2 3; do
  for side in before after; do
    dir=/work/before; [ $side = after ] && dir=/work/main
    (cd $dir && .venv/bin/rdma-kv bench --notify --progress thread --workloads kv-one-block,kv-random --reps 10 --rounds 2 --json $OUT/$side-$i.json > $OUT/$side-$i.txt 2>&1)
    echo "$side $i done $(date +%T) load=$(cut -d' ' -f1 /proc/loadavg)"
  done
done
