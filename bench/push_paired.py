"""What push mode's ``paired`` imports cost a producer's writes.

Push mode imports the decode ``paired`` (``Agent.add_peer(..., paired=True)``):
one endpoint on the producer's own worker, none on its lanes, so that the
decode's fence reaches every write (docs/rdma-connector.md, "Never silent,
in push"). Unpaired, a write of at least ``2 * lane_min_bytes`` is striped
over every worker, and writes in flight together are spread over them.
This measures both on the same buffers, taking turns rep by rep: one
producer process imports one decode process twice (once each way, under
two names) and writes a request's KV into it, ``--blocks`` random 32 KiB
slots of a 4096-slot pool, notified, as ``--inflight`` writes posted at
once (layer-wise pushes: one per layer group); a rep is timed from the
first post to the last ``wait()``. Every rep's bytes are checked in the
decode's buffer (shared memory) outside the timed region. Both agents run
as shipped (``progress="thread"``, default lanes). Prints the median GB/s
per shape and the ratio paired / unpaired.

    .venv/bin/python bench/push_paired.py [--blocks 16,64,640] [--inflight 1,4] [--reps 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np

POOL_BLOCKS = 4096
BLOCK_BYTES = 32768
WARM_UP = 3
WAIT_S = 30.0


def _decode(conn: Any, shm_name: str) -> None:
    """The decode: its KV pool (shared memory) registered; serves until told to stop."""
    from rdma_kv.transport import Agent, AgentConfig

    shm = shared_memory.SharedMemory(shm_name)
    try:
        with Agent("push-decode", AgentConfig(progress="thread")) as agent:
            pool = np.ndarray(POOL_BLOCKS * BLOCK_BYTES, np.uint8, shm.buf)
            agent.register(pool)
            conn.send((agent.metadata(), pool.ctypes.data))  # (the segment's address in this process)
            # A decode takes its notifications as it goes (the connector does,
            # every step): left in the ring, the notified writes would fill it.
            while not conn.poll(0.05):
                agent.get_notifications()
            conn.recv()  # stop
            agent.get_notifications()
    finally:
        shm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="16,64,640", help="blocks per request, comma list")
    ap.add_argument("--inflight", default="1,4", help="writes a request is cut into, posted at once, comma list")
    ap.add_argument("--reps", type=int, default=40, help="timed reps per shape and import (taking turns)")
    ap.add_argument("--json", type=Path, help="write the medians and every rep here")
    args = ap.parse_args()

    from rdma_kv.transport import Agent, AgentConfig, DescList

    shm = shared_memory.SharedMemory(create=True, size=POOL_BLOCKS * BLOCK_BYTES)
    theirs = np.ndarray(POOL_BLOCKS * BLOCK_BYTES, np.uint8, shm.buf)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_decode, args=(child, shm.name), daemon=True)
    proc.start()
    results: dict[str, Any] = {"rows": []}
    try:
        blob, base = parent.recv()
        with Agent("push-producer", AgentConfig(progress="thread")) as producer:
            mine = np.random.default_rng(1).integers(0, 256, POOL_BLOCKS * BLOCK_BYTES, dtype=np.uint8)
            producer.register(mine)
            names = {"paired": producer.add_peer(blob, name="decode-paired", paired=True),
                     "unpaired": producer.add_peer(blob, name="decode-unpaired")}
            slots = DescList.slots
            local = producer.prep_local(slots(mine.ctypes.data, POOL_BLOCKS, BLOCK_BYTES))
            remote = {k: producer.prep_remote(n, slots(base, POOL_BLOCKS, BLOCK_BYTES))
                      for k, n in names.items()}
            rng = np.random.default_rng(2)
            results["lanes"] = producer.config.lanes
            print(f"producer lanes: {producer.config.lanes}; {args.reps} reps per row, paired and unpaired "
                  "taking turns")
            print(f"{'blocks':>6} {'inflight':>8} {'paired GB/s':>12} {'unpaired GB/s':>14} {'ratio':>6}")
            for nblocks in [int(b) for b in args.blocks.split(",")]:
                for inflight in [int(n) for n in args.inflight.split(",")]:
                    times: dict[str, list[float]] = {"paired": [], "unpaired": []}
                    for rep in range(WARM_UP + args.reps):
                        for kind in (("paired", "unpaired") if rep % 2 else ("unpaired", "paired")):
                            src = rng.choice(POOL_BLOCKS, nblocks, replace=False).astype(np.int64)
                            dst = rng.choice(POOL_BLOCKS, nblocks, replace=False).astype(np.int64)
                            theirs.reshape(POOL_BLOCKS, BLOCK_BYTES)[dst] = 0
                            parts = [(s, d) for s, d in zip(np.array_split(src, inflight),
                                                            np.array_split(dst, inflight)) if len(s)]
                            t0 = time.perf_counter()
                            xfers = [producer.write_prepared(local, s, remote[kind], d, notify=b"push")
                                     for s, d in parts]
                            for x in xfers:
                                x.wait(WAIT_S)
                            elapsed = time.perf_counter() - t0
                            check(mine, theirs, src, dst)
                            if rep >= WARM_UP:
                                times[kind].append(elapsed)
                    nbytes = nblocks * BLOCK_BYTES
                    gbs = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
                    print(f"{nblocks:>6} {inflight:>8} {gbs['paired']:>12.2f} {gbs['unpaired']:>14.2f} "
                          f"{gbs['paired'] / gbs['unpaired']:>6.2f}")
                    results["rows"].append({"blocks": nblocks, "inflight": inflight, "gbs": gbs, "times_s": times})
    finally:
        parent.send("stop")
        proc.join(30)
        shm.close()
        shm.unlink()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def check(mine: np.ndarray, theirs: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
    a = mine.reshape(POOL_BLOCKS, BLOCK_BYTES)
    b = theirs.reshape(POOL_BLOCKS, BLOCK_BYTES)
    if not np.array_equal(a[src], b[dst]):
        raise SystemExit("a rep's bytes differ at the decode: the benchmark is wrong")


if __name__ == "__main__":
    main()
