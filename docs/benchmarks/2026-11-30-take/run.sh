#!/bin/bash
# 2026-11-30, 02:13-02:26: before (main with 1b546e7 reverted, its own .so built
# in place) against after (main), alternating; rdma-kv and NIXL alternate inside
# each bench run. BEFORE=<that checkout>/src AFTER=<main>/src.
set -u
OUT=${OUT:-.}
PY=${PY:-.venv/bin/python}
bench() { $PY -c "import sys; from rdma_kv.cli import main; sys.argv[0]='rdma-kv'; sys.exit(main())" bench "$@"; }
for pair in 1 2 3 4; do
  for t in before after; do       # pairs 3 and 4 ran after first
    src=$BEFORE; [ $t = after ] && src=$AFTER
    if [ $pair -le 2 ]; then
      PYTHONPATH=$src bench --vs nixl --notify --progress thread --workloads kv-one-block --reps 10 --rounds 3 \
          --json $OUT/oneblock-$t-$pair.json
      PYTHONPATH=$src $PY bench/lone_request.py --reps 600 --progress thread --json $OUT/lone-$t-$pair.json
      [ $pair = 1 ] && PYTHONPATH=$src $PY bench/idle_cpu.py --idle-s 2 --rounds 3 --json $OUT/idle-$t.json
    else
      PYTHONPATH=$src bench --vs nixl --notify --progress thread --workloads kv-one-block --reps 20 --rounds 4 \
          --json $OUT/oneblock-$t-$pair.json
      PYTHONPATH=$src $PY bench/experiments/wait_threads.py 300 thread
    fi
  done
done
