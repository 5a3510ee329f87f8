#!/usr/bin/env bash
# The engine thread's time in the connector per load (bench/step_cost.py) and
# the connector's overhead per request (bench/connector_overhead.py), before
# and after, alternating pair by pair on one host: "before" = a worktree of
# the commit before (BASE, its shim built in place), "after" = this tree.
# step_cost.py runs from this tree against both: it drives the connector
# through the engine harness's public API only.
# Usage: BASE=<worktree of the commit before> OUT=<dir> bash docs/benchmarks/2026-12-02-step-cost/run.sh
set -euo pipefail
BASE=${BASE:?set BASE to a worktree of the commit before, its shim built (setup.py build_ext --inplace)}
OUT=${OUT:?set OUT to a directory}
PAIRS=${PAIRS:-4}
HERE=$(pwd)
mkdir -p "$OUT"
uptime | tee "$OUT/uptime.txt"
for i in $(seq 1 "$PAIRS"); do
  for side in before after; do
    src=$([ "$side" = before ] && echo "$BASE/src" || echo "$HERE/src")
    PYTHONPATH="$src" .venv/bin/python bench/step_cost.py --batch 1,16,64 --geometry tiny,8b --reps 8 \
      --json "$OUT/step-$side-$i.json" > "$OUT/step-$side-$i.txt"
    (cd "$([ "$side" = before ] && echo "$BASE" || echo "$HERE")" && PYTHONPATH=src "$HERE/.venv/bin/python" \
      bench/connector_overhead.py --reps 60 --geometry tiny,8b --tokens 128 --json "$OUT/ovh-$side-$i.json" \
      > "$OUT/ovh-$side-$i.txt")
  done
done
uptime | tee -a "$OUT/uptime.txt"
