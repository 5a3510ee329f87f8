#!/usr/bin/env bash
# The scale curves of 2026-11-30 (docs/benchmarks.md, "Scale curves"): three
# polling runs with both axes (poll-N, the plot is run 3's), then two runs of
# the concurrency axis as shipped (progress="thread", thread-N). Nothing else
# ran on the host; `uptime` before and after each is in load.txt.
set -euo pipefail
OUT=${OUT:-/tmp/scale}
mkdir -p "$OUT"
for i in 1 2 3; do
  uptime >> "$OUT/load.txt"
  .venv/bin/rdma-kv bench --scale concurrency,producers --vs nixl --concurrency 1,8,64,256 --reps 10 \
      --plot "$OUT/poll-$i.png" --csv "$OUT/poll-$i.csv" --json "$OUT/poll-$i.json" > "$OUT/poll-$i.txt" 2>&1
done
for i in 1 2; do
  uptime >> "$OUT/load.txt"
  .venv/bin/rdma-kv bench --scale concurrency --vs nixl --concurrency 1,8,64,256 --reps 10 --progress thread \
      --json "$OUT/thread-$i.json" > "$OUT/thread-$i.txt" 2>&1
done
uptime >> "$OUT/load.txt"
