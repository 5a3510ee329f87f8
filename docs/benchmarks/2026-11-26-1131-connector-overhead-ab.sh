#!/bin/bash
# Alternating before (8dec458: stages recorded; completions settled by the service thread only)
# and after (HEAD: get_finished settles on the engine thread, idle steps wait for their loads);
# the library's Python files of the two trees swapped in place (no C change between them).
cd /work/wt-co
OUT=${OUT:-/tmp/co-ab2}; mkdir -p $OUT
F=$(git diff --name-only 8dec458 HEAD -- src)
for i in 1 2 3; do
  for tree in before after; do
    rev=$([ $tree = before ] && echo 8dec458 || echo HEAD)
    for f in $F; do git show $rev:$f > $f; done
    echo "== $tree $i $(date +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)"
    .venv/bin/python bench/connector_overhead.py --reps 30 --json $OUT/$tree-$i.json
  done
done
git checkout -- src
