"""CPU per thread of a pumped agent while one caller is blocked in wait()
on a TCP read its (polling, unprogressed) target never answers.

  .venv/bin/python bench/experiments/blocked_caller_cpu.py [seconds]
  NOWAIT=1: nobody waits (the read in flight only); WARM=1: the target
  answered a first read, then stops progressing (a hung peer).

Seen (2 CPUs, load ~7): the own pump at 35-55 % of a core, before and after
1b546e7 alike, and with nobody waiting: strace shows it looping poll(efd)
-> epoll_wait -> read(EAGAIN) ~8,600 times a second, the worker's event fd
always readable (UCX's TCP iface reports EPOLLOUT on the endpoint's socket).
WARM=1: ~1 % (the spin lasts only until the peer has progressed once). With
no read at all, b only add_peer()'d to the never-progressed a: 27 % of a
core -- UCX's TCP connection waits for the peer's side of its handshake.
Fixed since (csrc/pump.c, rk_pump_doze; quiet host): 1.73 s of the pump's
CPU in 2 s with NOWAIT=1 before, 0.12 s after, of it the 250 ms of wakes it waits out before dozing (tests/transport/test_pump_doze.py).
"""
import os
import sys
import threading
import time


sys.path.insert(0, "tests/transport")
from rdma_kv.transport import Agent, AgentConfig  # noqa: E402
from transport_helpers import TCP, link, prepare_slots  # noqa: E402


def ticks():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(tid)] = (comm, int(fields[11]) + int(fields[12]))
    return out


a = Agent("a", AgentConfig(progress="poll", ucx_options=dict(TCP), lanes=1))
b = Agent("b", AgentConfig(progress="thread", ucx_options=dict(TCP), lanes=1))
pair = link(a, b)
local, remote = prepare_slots(pair, 4096)
if os.environ.get("WARM"):  # the peer answered a first read (wired up), then stops progressing
    w = b.read_prepared(local, [1], remote, [1], timeout_s=60)
    while not w.done():
        a.progress()
    for _ in range(100):
        a.progress()
x = b.read_prepared(local, [0], remote, [0], timeout_s=60)
t = threading.Thread(target=lambda: x.wait(60), name="waiter", daemon=True)
WAIT = os.environ.get("NOWAIT") is None
if WAIT:
    t.start()
while WAIT and b._core.inflight.ctx.awaiting != 1:
    time.sleep(0.001)
time.sleep(0.2)
secs = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
t0, w0, c0 = ticks(), time.monotonic(), time.process_time()
time.sleep(secs)
t1, wall, cpu = ticks(), time.monotonic() - w0, time.process_time() - c0
hz = os.sysconf("SC_CLK_TCK")
print(f"process: {cpu:.3f} s CPU in {wall:.3f} s")
for tid, (comm, v) in sorted(t1.items()):
    d = (v - t0.get(tid, (comm, 0))[1]) / hz
    if d:
        print(f"  {tid} {comm:24s} {d:.3f} s")
end = time.monotonic() + 30
while not x.done() and time.monotonic() < end:
    a.progress()
t.join(10) if WAIT else None
b.close()
a.close()
