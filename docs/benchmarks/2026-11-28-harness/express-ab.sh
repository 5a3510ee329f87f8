#!/bin/bash
# bench/demo_shapes.py without and with express endpoints, alternating
# (off on on off), two rounds each; output and JSON per run.
#   bash docs/benchmarks/2026-11-28-harness/express-ab.sh OUT_DIR
set -euo pipefail
out=$1
mkdir -p "$out"
n=0
for side in off on on off; do
  n=$((n + 1))
  flag=""; [ "$side" = on ] && flag="--express"
  echo "== $side (run $n) $(date +%T) load=$(cut -d' ' -f1 /proc/loadavg)"
  .venv/bin/python bench/demo_shapes.py --rounds 2 $flag --json "$out/shapes-$side-$n.json" | tee "$out/shapes-$side-$n.txt"
done
