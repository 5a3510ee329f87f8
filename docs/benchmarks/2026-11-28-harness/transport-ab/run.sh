#!/bin/bash
set -u
cd /work/main
for i in 1 2 3; do
  order="before after"; [ $((i % 2)) = 0 ] && order="after before"
  for side in $order; do
    src=/work/main/src; [ $side = before ] && src=/work/before/src
    PYTHONPATH=$src timeout 300 .venv/bin/python -m rdma_kv bench --scale concurrency --concurrency 1,8,64,256 --reps 10 --vs nixl --progress poll --json /tmp/tab/scale-$side-$i.json > /tmp/tab/scale-$side-$i.txt 2>&1
    echo "scale $side $i $(date +%T) load=$(cut -d' ' -f1 /proc/loadavg)"
  done
done
for i in 1 2; do
  order="before after"; [ $((i % 2)) = 0 ] && order="after before"
  for side in $order; do
    src=/work/main/src; [ $side = before ] && src=/work/before/src
    PYTHONPATH=$src timeout 600 .venv/bin/python -m rdma_kv bench --notify --progress thread --workloads kv-one-block,kv-random --reps 10 --rounds 2 --vs nixl --json /tmp/tab/notify-$side-$i.json > /tmp/tab/notify-$side-$i.txt 2>&1
    echo "notify $side $i $(date +%T) load=$(cut -d' ' -f1 /proc/loadavg)"
  done
done
echo done
