#!/bin/bash
cd /work/main
for pair in 1 2; do
  for tree in before after; do
    src=/work/loaded/src; [ $tree = after ] && src=/work/main/src
    echo "== $tree pair $pair $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$src .venv/bin/rdma-kv bench --scale concurrency --concurrency 1,8,64,256 --reps 10 --vs nixl \
       > docs/benchmarks/2026-11-27-jsq/$tree-$pair.txt 2>&1
    echo "rc=$?"
  done
done
