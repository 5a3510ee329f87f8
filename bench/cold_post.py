"""Per-transfer cost of ``Agent.read_prepared`` with the CPU caches cold.

An engine posts a request's reads right after a model step has swept the
caches; this measures that situation in one process. Two agents (a reader
polling, a target with a progress thread), 32,768 slots of 32 KiB per side;
before every rep a 1 GiB buffer is overwritten (``--warm`` skips it), then
one ``read_prepared`` of 64 random slot pairs (one block of a
Llama-3-8B-like request) is timed from the call to its return, i.e. the
Python work plus the C post (``post``). Prints medians in microseconds.

    .venv/bin/python bench/cold_post.py [--reps 30] [--descs 64] [--warm]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from rdma_kv.transport import Agent, AgentConfig, DescList

SLOTS, SLOT_BYTES = 64 * 512, 32768


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--descs", type=int, default=64)
    ap.add_argument("--warm", action="store_true", help="do not sweep the caches between reps")
    args = ap.parse_args()

    with Agent("cold-reader", AgentConfig(progress="poll")) as reader, \
            Agent("cold-target", AgentConfig(progress="thread")) as target:
        src = np.ones(SLOTS * SLOT_BYTES // 8, dtype=np.uint64)
        dst = np.zeros_like(src)
        target.register(src)
        reader.register(dst)
        peer = reader.add_peer(target.metadata())

        def slots(arr: np.ndarray) -> DescList:
            return DescList.slots(arr.ctypes.data, SLOTS, SLOT_BYTES)

        local, remote = reader.prep_local(slots(dst)), reader.prep_remote(peer, slots(src))
        one = np.zeros(1, dtype=np.int64)
        reader.read_prepared(local, one, remote, one).wait(10)  # wire-up, untimed
        sweep = np.zeros(1 << 27, dtype=np.uint64)  # 1 GiB
        rng = np.random.default_rng(0)
        total, post = [], []
        for rep in range(args.reps):
            li = rng.choice(SLOTS, args.descs, replace=False).astype(np.int64)
            ri = rng.choice(SLOTS, args.descs, replace=False).astype(np.int64)
            if not args.warm:
                sweep.fill(rep)
            t0 = time.perf_counter()
            xfer = reader.read_prepared(local, li, remote, ri)
            t1 = time.perf_counter()
            xfer.wait(10)
            total.append((t1 - t0) * 1e6)
            post.append(xfer.post_s * 1e6)
        print(f"read_prepared of {args.descs} descriptors, {'warm' if args.warm else 'cold'} caches, "
              f"{args.reps} reps: median {statistics.median(total):.1f} us "
              f"(C post {statistics.median(post):.1f} us, Python {statistics.median(total) - statistics.median(post):.1f} us)")


if __name__ == "__main__":
    main()
