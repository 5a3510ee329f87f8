"""Are both workers of a striped transfer busy at once? Per-thread CPU and
run-queue time of 16,384 random 32 KiB reads (the ``kv-random`` shape).

The target runs in a child process (``progress="thread"``), the reader
polls with ``lanes`` workers, a notification on every transfer, as
``rdma-kv bench --notify``. Per transfer, from ``/proc/self/task/<tid>/schedstat``
of the polling thread and of every lane's pump: *run* (ms on a CPU) and
*queued* (ms runnable but waiting for a CPU), against the transfer's wall
time. Two workers copying in parallel show run ~= wall on both threads;
a lane starved of a CPU shows its queued time instead.

    .venv/bin/python bench/experiments/lane_busy.py [--reps 5] [--lanes 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import threading
import time
from typing import Any

import numpy as np

from rdma_kv.transport import Agent, AgentConfig, DescList

SLOTS, SLOT_BYTES, DESCS = 32768, 32768, 16384


def _slots(base: int) -> DescList:
    return DescList(np.uint64(base) + np.arange(SLOTS, dtype=np.uint64) * np.uint64(SLOT_BYTES), SLOT_BYTES)


def _target(conn: Any) -> None:
    with Agent("lb-target", AgentConfig(progress="thread", lanes=1)) as agent:
        buf = np.ones(SLOTS * SLOT_BYTES, dtype=np.uint8)
        agent.register(buf)
        conn.send((agent.metadata(), buf.ctypes.data))
        conn.recv()


def _schedstat(tid: int) -> tuple[int, int]:
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        run, queued, _ = f.read().split()
    return int(run), int(queued)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    parent, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=_target, args=(child,), daemon=True)
    proc.start()
    rows = []
    try:
        md, addr = parent.recv()
        with Agent("lb-reader", AgentConfig(progress="poll", lanes=args.lanes)) as reader:
            dst = np.zeros(SLOTS * SLOT_BYTES, dtype=np.uint8)
            reader.register(dst)
            peer = reader.add_peer(md)
            local, remote = reader.prep_local(_slots(dst.ctypes.data)), reader.prep_remote(peer, _slots(addr))
            tids = {"poller": threading.get_native_id()}
            tids.update({f"pump{i}": lane.pump.tid for i, lane in enumerate(reader._core.lanes, 1)
                         if lane.pump is not None})
            rng = np.random.default_rng(0)
            for rep in range(args.reps + 1):
                li = rng.permutation(SLOTS)[:DESCS]
                ri = rng.permutation(SLOTS)[:DESCS]
                before = {k: _schedstat(t) for k, t in tids.items()}
                t0 = time.perf_counter()
                xfer = reader.read_prepared(local, li, remote, ri, notify=b"r%d" % rep).wait(60)
                wall = time.perf_counter() - t0
                after = {k: _schedstat(t) for k, t in tids.items()}
                if rep == 0:
                    continue  # wire-up and first touch
                row: dict[str, Any] = {"wall_ms": wall * 1e3, "gbps": DESCS * SLOT_BYTES / wall / 1e9,
                                       "worker_ops": list(xfer.worker_ops or (xfer.ops_posted,)),
                                       "post_ms": xfer.post_s * 1e3}
                for k in tids:
                    row[f"{k}_run_ms"] = (after[k][0] - before[k][0]) / 1e6
                    row[f"{k}_queued_ms"] = (after[k][1] - before[k][1]) / 1e6
                rows.append(row)
            parent.send("stop")
    finally:
        proc.join(10)
    keys = [k for k in rows[0] if k != "worker_ops"]
    print(f"lanes={args.lanes}, loadavg {os.getloadavg()[0]:.2f}; worker_ops {rows[0]['worker_ops']}")
    for k in keys:
        vals = [r[k] for r in rows]
        print(f"  {k:18} median {statistics.median(vals):8.2f}  [{min(vals):.2f} - {max(vals):.2f}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f)


if __name__ == "__main__":
    main()
