#!/bin/bash
cd /work/main
for mode in poll thread; do
for pair in 3 4 5 6; do
  for tree in before after; do
    src=/work/loaded/src; [ $tree = after ] && src=/work/main/src
    echo "== $mode $tree pair $pair $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$src .venv/bin/rdma-kv bench --scale concurrency --concurrency 1,8,64,256 --reps 10 --vs nixl --progress $mode \
       > docs/benchmarks/2026-11-27-jsq/$mode-$tree-$pair.txt 2>&1
    echo "rc=$?"
  done
done
done
