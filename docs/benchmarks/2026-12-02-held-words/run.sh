#!/usr/bin/env bash
# Held words (protocol 12) against read pins, alternating pair by pair:
# "pins" = --held-words off (the producer publishes no words: the decode pins
# its reads, as before 2026-12-02), "words" = the default.
# Usage: OUT=<dir> bash docs/benchmarks/2026-12-02-held-words/run.sh
set -euo pipefail
OUT=${OUT:?set OUT to a directory}
mkdir -p "$OUT"
uptime
for i in 1 2 3 4 5; do
  PYTHONPATH=src .venv/bin/python bench/connector_overhead.py --reps 60 --geometry tiny,8b --tokens 128 \
    --held-words off --json "$OUT/pins-$i.json" > /dev/null
  PYTHONPATH=src .venv/bin/python bench/connector_overhead.py --reps 60 --geometry tiny,8b --tokens 128 \
    --json "$OUT/words-$i.json" > /dev/null
done
uptime
