#!/usr/bin/env bash
# The transport's rows against NIXL, before and after chained reads (the
# submit path took one more argument and a check per request), alternating
# run by run on one host: "before" = a worktree of 4aaf9d5 (its shim built in
# place), "after" = this tree.
# Usage: BASE=<worktree> OUT=<dir> bash docs/benchmarks/2026-12-02-chained-words/transport.sh
set -euo pipefail
BASE=${BASE:?set BASE to a worktree of the commit before, its shim built (setup.py build_ext --inplace)}
OUT=${OUT:?set OUT to a directory}
HERE=$(pwd)
mkdir -p "$OUT"
uptime
for i in 1 2; do
  (cd "$BASE" && PYTHONPATH=src "$HERE/.venv/bin/python" -c 'from rdma_kv.cli import main; main()' \
    bench --vs nixl --notify --reps 5 --rounds 1 --json "$OUT/before-$i.json" > "$OUT/before-$i.txt")
  uptime
  PYTHONPATH=src .venv/bin/python -c 'from rdma_kv.cli import main; main()' \
    bench --vs nixl --notify --reps 5 --rounds 1 --json "$OUT/after-$i.json" > "$OUT/after-$i.txt"
  uptime
done
