"""While a caller blocked in wait() holds the own worker taken, another
transfer's completion callback (a callback-only user: nobody waits on it)
runs only when the service thread's poll times out (HELP_STALE_NS, 20 ms
while transfers are in flight) or the taker's wait ends: the taker
publishes the completion but, unlike the pump, never wakes the service
thread. Prints the callback latency of reads posted to a progressed peer
with and without a taker.

  .venv/bin/python bench/experiments/taken_callback_latency.py
"""
import sys
import threading
import time

import numpy as np

sys.path.insert(0, "tests/transport")
from rdma_kv.transport import Agent, AgentConfig  # noqa: E402
from transport_helpers import TCP  # noqa: E402

BLOCK = 4096
N = 30


def agent(name, **kw):
    return Agent(name, AgentConfig(ucx_options=dict(TCP), **kw))


stuck = agent("stuck", progress="poll", lanes=1)        # nobody progresses it
peer = agent("peer", lanes=1)                            # progressed by its pump
b = agent("b", lanes=1, spin_s=30.0)                     # a taker keeps the worker while it waits
bufs = {n: np.zeros(1 << 20, dtype=np.uint8) for n in ("stuck", "peer", "b")}
for a, n in ((stuck, "stuck"), (peer, "peer"), (b, "b")):
    a.register(bufs[n])
for a in (stuck, peer):
    b.add_peer(a.metadata())
    a.add_peer(b.metadata())


def desc(agent_, name, off):
    from rdma_kv.transport import DescList
    return DescList([bufs[name].ctypes.data + off], BLOCK)


def latencies():
    out = []
    for i in range(N):
        ev = threading.Event()
        t0 = time.monotonic()
        x = b.read("peer", desc(b, "b", BLOCK * (1 + i)), desc(peer, "peer", 0))
        x.add_done_callback(lambda _: ev.set())
        assert ev.wait(10)
        out.append(time.monotonic() - t0)
        time.sleep(0.002)
    return sorted(out)


def show(what, lat):
    print(f"{what}: callback latency p50 {lat[len(lat) // 2] * 1e3:.2f} ms, max {lat[-1] * 1e3:.2f} ms")


show("no taker", latencies())
blocked = b.read("stuck", desc(b, "b", 0), desc(stuck, "stuck", 0), timeout_s=60)
waiter = threading.Thread(target=lambda: blocked.wait(60), daemon=True)
waiter.start()
while b._core.inflight.ctx.awaiting != 1:  # (the caller blocked in rk_await: it takes the worker at once)
    time.sleep(0.001)
time.sleep(0.05)
show("worker taken by a blocked caller", latencies())
end = time.monotonic() + 30
while not blocked.done() and time.monotonic() < end:
    stuck.progress()
waiter.join(10)
for a in (b, peer, stuck):
    a.close()
