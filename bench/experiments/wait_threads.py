"""One notified 2 MiB block (64 random 32 KiB slots) as shipped
(``progress="thread"``, ``read_prepared`` then ``wait()``), and per rep the
run time and run-queue time (``/proc/self/task/<tid>/schedstat``) of the
calling thread, the agent's own pump, each lane's pump and the service
thread, found by their thread names. Showed the own pump spinning on its
hold while the waiter helped (2026-11-30, docs/benchmarks.md, "The shipped
blocking path"). The caller's own figures are unreliable: a running thread's
schedstat is updated lazily.

    .venv/bin/python bench/experiments/wait_threads.py [REPS] [thread|poll]
"""

import multiprocessing as mp, os, statistics, sys, threading, time
import numpy as np
from rdma_kv.transport import Agent, AgentConfig, DescList
SLOTS, SB, N = 1024, 32768, 64

def _slots(base):
    return DescList(np.uint64(base) + np.arange(SLOTS, dtype=np.uint64) * np.uint64(SB), SB)

def _target(conn):
    with Agent("t", AgentConfig(progress="thread", lanes=1)) as a:
        buf = np.ones(SLOTS * SB, dtype=np.uint8); a.register(buf)
        conn.send((a.metadata(), buf.ctypes.data)); conn.recv()

def ss(tid):
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            r, q, _ = f.read().split(); return int(r), int(q)
    except OSError:
        return 0, 0

def main():
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    mode = sys.argv[2] if len(sys.argv) > 2 else "thread"
    parent, child = mp.Pipe()
    p = mp.get_context("fork").Process(target=_target, args=(child,), daemon=True); p.start()
    md, addr = parent.recv()
    with Agent("r", AgentConfig(progress=mode)) as r:
        dst = np.zeros(SLOTS * SB, dtype=np.uint8); r.register(dst)
        peer = r.add_peer(md)
        loc, rem = r.prep_local(_slots(dst.ctypes.data)), r.prep_remote(peer, _slots(addr))
        tids = {"caller": threading.get_native_id()}
        for t in threading.enumerate():
            if t.name.startswith("rdma-kv") and t.native_id:
                tids[t.name[-20:]] = t.native_id
        rng = np.random.default_rng(0)
        rows = []
        for rep in range(reps + 10):
            li = rng.permutation(SLOTS)[:N].astype(np.int64); ri = rng.permutation(SLOTS)[:N].astype(np.int64)
            time.sleep(0.002)
            b = {k: ss(t) for k, t in tids.items()}
            t0 = time.perf_counter()
            x = r.read_prepared(loc, li, rem, ri, notify=b"n%d" % rep)
            x.wait(10)
            w = time.perf_counter() - t0
            a = {k: ss(t) for k, t in tids.items()}
            if rep >= 10:
                row = {"wall_us": w * 1e6}
                for k in tids:
                    row[k + " run"] = (a[k][0] - b[k][0]) / 1e3
                    row[k + " q"] = (a[k][1] - b[k][1]) / 1e3
                rows.append(row)
        parent.send("stop")
    p.join(10)
    print(f"mode={mode} load {os.getloadavg()[0]:.2f} reps={reps}")
    for k in rows[0]:
        v = [x[k] for x in rows]
        print(f"  {k:34} p50 {statistics.median(v):8.1f}  p10 {np.percentile(v,10):8.1f} p90 {np.percentile(v,90):8.1f}")

main()
