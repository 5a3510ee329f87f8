#!/bin/bash
# `rdma-kv demo --seed 1` on two trees, alternating run by run (the order
# swapped every second pair), with one interpreter: each tree's src/ first
# on PYTHONPATH (a tree needs its shim built in place:
# `python setup.py -q build_ext --inplace`). Prints each run's summary line
# and keeps its output, with the run's wall and CPU seconds (all processes).
#   bash demo-ab.sh BEFORE_TREE AFTER_TREE OUT_DIR PAIRS [PYTHON]
set -euo pipefail
before=$1 after=$2 out=$3 pairs=${4:-3} py=${5:-.venv/bin/python}
mkdir -p "$out"
for i in $(seq 1 "$pairs"); do
  order="before after"; [ $((i % 2)) = 0 ] && order="after before"
  for side in $order; do
    tree=$before; [ "$side" = after ] && tree=$after
    f="$out/demo-$side-$i.txt"
    /usr/bin/env time -f "wall %e s, cpu %U user + %S sys s" -o "$f.time" \
      env PYTHONPATH="$tree/src" "$py" -m rdma_kv demo --seed 1 > "$f" 2>&1
    cat "$f.time" >> "$f"; rm -f "$f.time"
    echo "$side $i $(date +%T) load=$(cut -d' ' -f1 /proc/loadavg): $(grep -E 'load latency|per request|wall' "$f" | tr '\n' ' ')"
  done
done
