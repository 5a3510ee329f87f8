#!/bin/bash
cd /work/main
for pair in 7 8 9 10 11 12; do
  for tree in before after; do
    src=/work/loaded/src; [ $tree = after ] && src=/work/main/src
    echo "== thread $tree pair $pair $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$src .venv/bin/rdma-kv bench --scale concurrency --concurrency 1,8,64,256 --reps 10 --vs nixl --progress thread \
       > docs/benchmarks/2026-11-27-jsq/thread-$tree-$pair.txt 2>&1
    echo "rc=$?"
  done
done
