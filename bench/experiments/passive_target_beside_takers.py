"""Latency of a peer's TCP reads from agent b (b a passive target: over TCP
b's worker must answer them) while b's own caller loops read + wait()
(taking b's worker each wait, giving it back with no wake-up when its read
was b's only one in flight), against b's caller idle.

  .venv/bin/python bench/experiments/passive_target_beside_takers.py [pre-1b546e7 src dir on PYTHONPATH to compare]
"""
import sys
import threading
import time

import numpy as np

sys.path.insert(0, "tests/transport")
from rdma_kv.transport import Agent, AgentConfig, DescList  # noqa: E402
from transport_helpers import TCP  # noqa: E402

N = 300
BLOCK = 4096


def agent(name, **kw):
    return Agent(name, AgentConfig(ucx_options=dict(TCP), lanes=1, **kw))


a, b, c = agent("a"), agent("b"), agent("c")
bufs = {n: np.zeros(1 << 20, dtype=np.uint8) for n in "abc"}
for ag, n in ((a, "a"), (b, "b"), (c, "c")):
    ag.register(bufs[n])
for x, y in ((a, b), (b, a), (b, c), (c, b)):
    x.add_peer(y.metadata())


def d(n, off):
    return DescList([bufs[n].ctypes.data + off], BLOCK)


def c_reads():
    out = []
    for i in range(N):
        t0 = time.perf_counter()
        c.read("b", d("c", 0), d("b", BLOCK * (i % 64)), timeout_s=30).wait(30)
        out.append(time.perf_counter() - t0)
        time.sleep(0.0005)
    out.sort()
    return f"p50 {out[N // 2] * 1e3:.3f} ms  p90 {out[N * 9 // 10] * 1e3:.3f} ms  max {out[-1] * 1e3:.2f} ms"


for _ in range(20):  # wire up
    b.read("a", d("b", 0), d("a", 0), timeout_s=30).wait(30)
    c.read("b", d("c", 0), d("b", 0), timeout_s=30).wait(30)
print("b's caller idle:            c's reads from b", c_reads())
stop = threading.Event()
waits = [0]


def loop():
    while not stop.is_set():
        b.read("a", d("b", BLOCK * 100), d("a", 0), timeout_s=30).wait(30)
        waits[0] += 1


t = threading.Thread(target=loop, daemon=True)
t.start()
print("b's caller in wait() loops: c's reads from b", c_reads(), f"({waits[0]} waits by b)")
stop.set()
t.join(30)
for ag in (c, b, a):
    ag.close()
