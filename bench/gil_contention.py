"""Transfers beside a GIL-hungry engine thread (progress="thread").

An engine's main thread runs Python almost all the time; an agent's own
threads compete with it for the interpreter lock. Two processes: a target,
and a reader whose poster thread reads 64 random 32 KiB blocks (one
Llama-3-8B-like block) back to back, waiting for each, while the main
thread counts in a pure-Python loop for ``--seconds``. Prints the main
loop's rate against its rate alone, and the GB/s the poster moved.
Run it on two trees to compare progress designs (PYTHONPATH=<tree>/src).

    .venv/bin/python bench/gil_contention.py [--seconds 3] [--label NAME]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time

import numpy as np

SLOT = 32768
SLOTS = 32 * 2 * 512


def target(conn) -> None:
    from rdma_kv.transport import Agent, AgentConfig

    agent = Agent("gil-target", AgentConfig(progress="thread"))
    buf = np.ones(SLOT * SLOTS, dtype=np.uint8)
    agent.register(buf)
    conn.send((buf.ctypes.data, agent.metadata()))
    conn.recv()
    agent.close()


def count(seconds: float) -> float:
    """Pure-Python loop iterations per second (holds the GIL)."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(1000):
            n += 1
    return n / seconds


def reader(conn, label: str, seconds: float) -> None:
    from rdma_kv.transport import Agent, AgentConfig, DescList

    addr, md = conn.recv()
    agent = Agent("gil-reader", AgentConfig(progress="thread"))
    peer = agent.add_peer(md)
    local = np.ones(SLOT * SLOTS, dtype=np.uint8)
    agent.register(local)

    def slots(base: int) -> DescList:
        return DescList.slots(base, SLOTS, SLOT)

    lp, rp = agent.prep_local(slots(local.ctypes.data)), agent.prep_remote(peer, slots(addr))
    rng = np.random.default_rng(0)
    plans = [(np.arange(64) * 512 + rng.integers(0, 512, 64)).astype(np.int64) for _ in range(64)]
    stop, moved = threading.Event(), [0]

    def poster() -> None:
        k = 0
        while not stop.is_set():
            idx = plans[k % len(plans)]
            moved[0] += agent.read_prepared(lp, idx, rp, idx).wait(10).nbytes
            k += 1

    alone = count(1.0)
    thread = threading.Thread(target=poster)
    t0 = time.perf_counter()
    thread.start()
    busy = count(seconds)
    stop.set()
    thread.join()
    elapsed = time.perf_counter() - t0
    print(f"{label}: main loop at {busy / alone * 100:.0f}% of its rate alone; "
          f"{moved[0] / elapsed / 1e9:.2f} GB/s moved beside it")
    conn.send("done")
    agent.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--label", default="rdma-kv")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    t_end, t_child = ctx.Pipe()
    r_end, r_child = ctx.Pipe()
    procs = [ctx.Process(target=target, args=(t_child,)),
             ctx.Process(target=reader, args=(r_child, args.label, args.seconds))]
    for p in procs:
        p.start()
    r_end.send(t_end.recv())
    t_end.send(r_end.recv())
    for p in procs:
        p.join(60)


if __name__ == "__main__":
    main()
