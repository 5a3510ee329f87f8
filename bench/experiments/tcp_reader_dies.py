"""Argued-then-tried: a TCP target whose reader's process dies while the
target's answer to its read waits in the target's endpoint queue.

``a`` (this process, polling) answers a 64 MiB read of ``b`` (a spawned
process, polling) until its socket is full; then ``b`` is killed (SIGKILL)
and ``a`` progresses for a while (its endpoint to ``b`` fails), then closes.
UCX 1.22 purges the queued answer when the endpoint fails
(``ucp_ep_set_failed`` -> ``ucp_ep_discard_lanes`` -> purge with
``ucp_ep_err_pending_purge`` -> ``ucp_request_send_state_ff``), the same
unsafe purge as at ``ucp_worker_destroy``: the answer leaks (UCX warns
"was not returned to mpool ucp_requests" when the worker goes) or, its
request recycled, it crashes. Worker.close's drain cannot help here: the
purge happens before any close. Prints "ok" and a count of leak lines is
left to the reader of stdout.

    python bench/experiments/tcp_reader_dies.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time

import numpy as np

TCP = {"TLS": "tcp", "NET_DEVICES": "lo"}
NBYTES = 64 << 20


def reader(conn) -> None:
    from rdma_kv.transport import Agent, AgentConfig, DescList
    b = Agent("b", AgentConfig(ucx_options=TCP, progress="poll", lanes=1))
    dst = np.zeros(NBYTES, dtype=np.uint8)
    b.register(dst)
    conn.send(b.metadata())
    md, src_addr = conn.recv()
    b.add_peer(md)
    whole = np.array([0])

    def read(n: int):
        return b.read("a", DescList.from_regions(dst.ctypes.data, whole, n),
                      DescList.from_regions(src_addr, whole, n), timeout_s=300.0)
    first = read(4096)
    while not first.done():
        b.progress()
    conn.send(str(first.state))
    read(NBYTES)
    for _ in range(100):
        b.progress()
    conn.send("posted")
    time.sleep(600)


def main() -> None:
    from rdma_kv.transport import Agent, AgentConfig
    a = Agent("a", AgentConfig(ucx_options=TCP, progress="poll", lanes=1))
    src = np.random.default_rng(1).integers(0, 256, NBYTES, dtype=np.uint8)
    a.register(src)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=reader, args=(there,))
    proc.start()
    a.add_peer(here.recv())
    here.send((a.metadata(), src.ctypes.data))
    while not here.poll():
        a.progress()
    print("warm-up read:", here.recv(), flush=True)
    assert here.recv() == "posted"
    end = time.monotonic() + 0.5
    while time.monotonic() < end:  # a answers until its socket is full
        a.progress()
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    end = time.monotonic() + 3.0
    while time.monotonic() < end:  # a's endpoint to b fails
        a.progress()
    a.close()
    print("ok", flush=True)


if __name__ == "__main__":
    sys.exit(main())
