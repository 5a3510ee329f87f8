#!/bin/bash
# rdma-kv demo (seed 1, 48 requests, concurrency 8) on 8dec458 (before) and HEAD (after), alternating.
cd /work/wt-co
F=$(git diff --name-only 8dec458 HEAD -- src)
for i in 1 2; do
  for tree in before after; do
    rev=$([ $tree = before ] && echo 8dec458 || echo HEAD)
    for f in $F; do git show $rev:$f > $f; done
    echo "== $tree $i $(date +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    .venv/bin/rdma-kv demo --seed 1 2>&1 | sed 's/\r/\n/g' | grep -E "^(requests:|load latency|transfer GB/s|VERIFIED)"
  done
done
git checkout -- src
