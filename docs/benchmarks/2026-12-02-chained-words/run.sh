#!/usr/bin/env bash
# The held words' read chained behind the data in the shim, against it posted
# from Python once the data landed, alternating pair by pair on one host:
# "before" = a worktree of the commit before (BASE, its shim built in place),
# "after" = this tree.
# Usage: BASE=<worktree of the parent commit> OUT=<dir> bash docs/benchmarks/2026-12-02-chained-words/run.sh
set -euo pipefail
BASE=${BASE:?set BASE to a worktree of the commit before, its shim built (setup.py build_ext --inplace)}
OUT=${OUT:?set OUT to a directory}
HERE=$(pwd)
mkdir -p "$OUT"
uptime
for i in 1 2 3 4 5; do
  (cd "$BASE" && PYTHONPATH=src "$HERE/.venv/bin/python" bench/connector_overhead.py --reps 60 --geometry tiny,8b \
    --tokens 128 --json "$OUT/before-$i.json" > /dev/null)
  PYTHONPATH=src .venv/bin/python bench/connector_overhead.py --reps 60 --geometry tiny,8b --tokens 128 \
    --json "$OUT/after-$i.json" > /dev/null
done
uptime
