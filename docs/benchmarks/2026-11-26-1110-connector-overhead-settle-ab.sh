#!/bin/bash
# Alternating before (8dec458: stages recorded, settled by the service thread only) / after (get_finished settles)
cd /work/wt-co
F="src/rdma_kv/transport/progress.py src/rdma_kv/transport/agent.py src/rdma_kv/connector/rdma/transport_api.py src/rdma_kv/connector/rdma/consumer/loads.py"
for i in 1 2; do
  for tree in before after; do
    for f in $F; do
      if [ $tree = before ]; then git show 8dec458:$f > $f; else cp /tmp/co-ab/after/$f $f; fi
    done
    echo "== $tree $i $(date +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    .venv/bin/python bench/connector_overhead.py --reps 30 --json /tmp/co-ab/$tree-$i.json
  done
done
for f in $F; do cp /tmp/co-ab/after/$f $f; done
