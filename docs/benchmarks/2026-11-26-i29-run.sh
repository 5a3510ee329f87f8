#!/bin/bash
# Only the `fixed` step of this script ran (01:47-01:57, load 2-16); the other
# steps were run, merged tree against 7fb5275, by 2026-11-26-merged-run.sh.
# Issue 29's benchmarks: the code before (main at 7fb5275, a detached
# worktree with its own .venv from `make install`) and after (i29, a
# detached worktree of the commit under test, same), side by side, pairs in
# alternating order so that drift on this shared host falls on both.
# The load average is logged before every step ($D-i29-load.txt).
#
#   BEFORE=/work/wt-29-before AFTER=/work/wt-29-after bash docs/benchmarks/2026-11-26-i29-run.sh
set -u
BEFORE=${BEFORE:-/work/wt-29-before}
AFTER=${AFTER:-/work/wt-29-after}
OUT=${OUT:-$(cd "$(dirname "$0")" && pwd)}
IMG=${IMG:-$OUT/../img}
D=${D:-2026-11-26}
STEPS=${STEPS:-"fixed notify thread scale idle"}

load() { echo "$(date +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" | tee -a "$OUT/$D-i29-load.txt"; }
tree() { if [ "$1" = after ]; then echo "$AFTER"; else echo "$BEFORE"; fi; }

for step in $STEPS; do
case $step in
fixed)  # 1. fixed cost per request, cold and warm; NIXL's request build in the same run
  for progress in poll thread; do
    load "fixed_cost --progress $progress"
    "$AFTER/.venv/bin/python" "$AFTER/bench/experiments/fixed_cost.py" --reps 100 --rounds 3 --modes cold,warm --nixl \
      --progress $progress --vs "$BEFORE/.venv/bin/python" --json "$OUT/$D-i29-fixed-cost-$progress.json"
  done ;;
notify)  # 2. every workload, every transfer notified, NIXL beside (the bench's reader: progress=poll)
  for pair in 1 2; do
    order="after before"; [ $pair = 2 ] && order="before after"
    for code in $order; do
      load "bench --notify $code $pair"
      (cd "$(tree $code)" && .venv/bin/rdma-kv bench --vs nixl --notify --reps 5 --rounds 3 \
        --json "$OUT/$D-i29-notify-$code-$pair.json")
    done
  done ;;
thread)  # 3. one notified 2 MiB block, as shipped: progress="thread", wait()
  for pair in 1 2; do
    order="after before"; [ $pair = 2 ] && order="before after"
    for code in $order; do
      load "bench --progress thread kv-one-block $code $pair"
      (cd "$(tree $code)" && .venv/bin/rdma-kv bench --vs nixl --notify --progress thread --workloads kv-one-block \
        --reps 10 --rounds 5 --perftest '' --json "$OUT/$D-i29-one-block-thread-$code-$pair.json")
    done
  done ;;
scale)  # 4. concurrent requests and producers; NIXL and the kernel's two-thread copy on the same plot
  load "bench --scale after 1"
  (cd "$AFTER" && .venv/bin/rdma-kv bench --scale concurrency,producers --vs nixl --reps 5 \
    --plot "$IMG/scale-$D.png" --csv "$OUT/$D-i29-scale-after-1.csv" --json "$OUT/$D-i29-scale-after-1.json")
  load "bench --scale before 1"
  (cd "$BEFORE" && .venv/bin/rdma-kv bench --scale concurrency,producers --scale-backends rdma-kv --reps 5 \
    --csv "$OUT/$D-i29-scale-before-1.csv" --json "$OUT/$D-i29-scale-before-1.json")
  load "bench --scale before 2"
  (cd "$BEFORE" && .venv/bin/rdma-kv bench --scale concurrency,producers --scale-backends rdma-kv --reps 5 \
    --csv "$OUT/$D-i29-scale-before-2.csv" --json "$OUT/$D-i29-scale-before-2.json")
  load "bench --scale after 2"
  (cd "$AFTER" && .venv/bin/rdma-kv bench --scale concurrency,producers --vs nixl --reps 5 \
    --csv "$OUT/$D-i29-scale-after-2.csv" --json "$OUT/$D-i29-scale-after-2.json") ;;
idle)  # 5. CPU an idle engine burns, as shipped, and NIXL with its progress thread
  load "idle_cpu after+nixl"
  "$AFTER/.venv/bin/python" "$AFTER/bench/idle_cpu.py" --idle-s 2 --rounds 3 --json "$OUT/$D-i29-idle-cpu-after.json"
  load "idle_cpu before"
  "$BEFORE/.venv/bin/python" "$AFTER/bench/idle_cpu.py" --idle-s 2 --rounds 3 --engines rdma-kv \
    --json "$OUT/$D-i29-idle-cpu-before.json" ;;
esac
done
load done
