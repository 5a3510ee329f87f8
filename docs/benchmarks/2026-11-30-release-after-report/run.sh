#!/bin/bash
# Connector overhead, before/after the post-pin RELEASE moved after the load's report.
# BEFORE: the src/ of a checkout of 9f74bac (its .so built or copied); AFTER: this tree's src/.
# Usage: BEFORE=<checkout>/src AFTER=src OUT=<dir> bash docs/benchmarks/2026-11-30-release-after-report/run.sh
set -eu
OUT=${OUT:-.}
for i in 1 2 3; do
  for t in before after; do
    if [ $t = before ]; then src=$BEFORE; else src=$AFTER; fi
    echo "== pair $i $t $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    PYTHONPATH=$src .venv/bin/python bench/connector_overhead.py --reps 60 --geometry tiny,8b --tokens 128 \
        --json "$OUT/$t-$i.json" 2>&1 | grep -v "^$"
  done
done
