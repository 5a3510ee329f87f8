#!/bin/bash
# Merged main (issues 28 + 29 landed) against 7fb5275 (before both), side by side, alternating pairs.
set -u
BEFORE=${BEFORE:-/work/wt-29-before}; AFTER=${AFTER:-/work/main}; OUT=${OUT:-/tmp/b29}; D=2026-11-26
load() { echo "$(date +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" | tee -a $OUT/load.txt; }
tree() { if [ "$1" = after ]; then echo $AFTER; else echo $BEFORE; fi; }
for pair in 1 2; do
  order="after before"; [ $pair = 2 ] && order="before after"
  for code in $order; do
    load "notify $code $pair"
    (cd $(tree $code) && timeout 900 .venv/bin/rdma-kv bench --vs nixl --notify --reps 5 --rounds 2 --json $OUT/notify-$code-$pair.json > $OUT/notify-$code-$pair.txt 2>&1)
  done
done
for pair in 1 2; do
  order="after before"; [ $pair = 2 ] && order="before after"
  for code in $order; do
    load "one-block thread $code $pair"
    (cd $(tree $code) && timeout 600 .venv/bin/rdma-kv bench --vs nixl --notify --progress thread --workloads kv-one-block --reps 10 --rounds 3 --perftest '' --json $OUT/oneblock-$code-$pair.json > $OUT/oneblock-$code-$pair.txt 2>&1)
  done
done
load "scale after"
(cd $AFTER && timeout 900 .venv/bin/rdma-kv bench --scale concurrency,producers --vs nixl --concurrency 1,8,64,256 --reps 5 --plot $OUT/scale-$D.png --csv $OUT/scale-after.csv --json $OUT/scale-after.json > $OUT/scale-after.txt 2>&1)
load done
# Then, by hand, the same evening: the scale curves before (7fb5275) and a
# second after-run, and the idle CPU of both trees.
#   (cd $BEFORE && .venv/bin/rdma-kv bench --scale concurrency,producers --vs nixl --concurrency 1,8,64,256 --reps 5 \
#      --csv $OUT/scale-before.csv --json $OUT/scale-before.json)
#   (cd $AFTER && .venv/bin/rdma-kv bench --scale concurrency,producers --vs nixl --concurrency 1,8,64,256 --reps 5 \
#      --csv $OUT/scale-after-2.csv --json $OUT/scale-after-2.json)
#   $AFTER/.venv/bin/python $AFTER/bench/idle_cpu.py --idle-s 2 --rounds 3 --json $OUT/idle-after.json
#   $BEFORE/.venv/bin/python $AFTER/bench/idle_cpu.py --idle-s 2 --rounds 3 --engines rdma-kv --json $OUT/idle-before.json
# The files were then copied to docs/benchmarks/2026-11-26-{notify,one-block-thread,scale,idle-cpu}-*.
