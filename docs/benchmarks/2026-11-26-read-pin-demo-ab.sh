#!/usr/bin/env bash
# The demo (two engine processes, UCX loopback), read pins off and on,
# alternating, one request in flight and eight, seed 1.
set -euo pipefail
for c in 1 8; do
  for i in 1 2 3; do
    for pin in false true; do
      echo "== concurrency $c pair $i read_pin $pin $(date +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
      .venv/bin/rdma-kv demo --seed 1 --concurrency "$c" --extra-config "{\"read_pin\": $pin}" | tail -6
    done
  done
done
