#!/bin/bash
# Interleaved A/B of Worker.drain (bench/experiments/tcp_target_drain_ab.py): RUNS runs
# per stream, alternating on/off, each the child's 30 rounds with a fresh
# seed; one line per run in OUT: arm seed rc leaks waited. Start busy loops
# beside it yourself (the crash needs a loaded host).
#   bash bench/experiments/tcp_target_drain_ab.sh OUT RUNS FIRST_ARM
out=$1; runs=$2; arm=${3:-on}
cd "$(dirname "$0")/../../tests/transport" || exit 1
py=../../.venv/bin/python
for i in $(seq 1 "$runs"); do
  for a in $arm $([ "$arm" = on ] && echo off || echo on); do
    seed=$RANDOM$RANDOM
    log=$(mktemp)
    timeout 300 $py -X faulthandler ../../bench/experiments/tcp_target_drain_ab.py $a 30 $seed thread 1 >"$log" 2>&1
    rc=$?
    leaks=$(grep -c "not returned to mpool" "$log")
    waited=$(grep -o "'waited': [0-9]*" "$log" | grep -o "[0-9]*$")
    gave=$(grep -o "'gave_up': [0-9]*" "$log" | grep -o "[0-9]*$")
    echo "$a $seed $rc ${leaks:-0} ${waited:--} ${gave:--}" >> "$out"
    if [ "$rc" != 0 ] || [ "${leaks:-0}" != 0 ]; then cp "$log" "$out.$a.$seed.log"; fi
    rm -f "$log"
  done
done
