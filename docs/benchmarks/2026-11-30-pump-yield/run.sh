#!/bin/bash
# Connector overhead with and without a sched_yield() after each pump round
# (and each taken round of rk_await) that had events: an experiment, not landed.
# MAIN: this tree's src/; YIELD: a checkout of 391c7a9 with yield.patch applied and its .so built
# (.venv/bin/python setup.py -q build_ext --inplace in that checkout).
# Usage: MAIN=src YIELD=<checkout>/src N=5 bash docs/benchmarks/2026-11-30-pump-yield/run.sh
set -eu
OUT=${OUT:-.}
for i in $(seq 1 "${N:-5}"); do
  for t in main yield; do
    if [ $t = main ]; then src=$MAIN; else src=$YIELD; fi
    PYTHONPATH=$src .venv/bin/python bench/connector_overhead.py --reps 60 --geometry tiny,8b --tokens 128 \
        --json "$OUT/$t-$i.json"
  done
done
