#!/usr/bin/env bash
# Read pins off (a CONFIRM after every read, as before protocol 7) and on
# (the default), alternating pair by pair, in one run on one host.
set -euo pipefail
out=docs/benchmarks
for i in 1 2 3; do
  for pin in off on; do
    .venv/bin/python bench/connector_overhead.py --reps 30 --geometry tiny,8b --tokens 128 \
      --read-pin "$pin" --json "$out/2026-11-26-read-pin-$pin-$i.json"
  done
done
