import sys, time, numpy as np
from rdma_kv.transport import Agent, AgentConfig, DescList, XferState
o = {"NET_DEVICES": "lo"}
big, small = 48 << 20, 512 << 10
src = np.random.default_rng(1).integers(0, 256, big + small, dtype=np.uint8)
dst = np.zeros_like(src)
for express in (False, True, False, True):
  with Agent("t", AgentConfig(ucx_options=o, lanes=1)) as t, \
        Agent("r", AgentConfig(ucx_options=o, lanes=2, express=express)) as r:
    t.register(src); r.register(dst); r.add_peer(t.metadata())
    offs = np.arange(0, big, 1 << 20)
    res = {0: [], 1: []}
    for i in range(40):
        x1 = r.read("t", DescList.from_regions(dst.ctypes.data, offs, 512 << 10), DescList.from_regions(src.ctypes.data, offs, 512 << 10))
        t0 = time.perf_counter()
        x2 = r.read("t", DescList.from_regions(dst.ctypes.data + big, np.array([0]), small), DescList.from_regions(src.ctypes.data + big, np.array([0]), small))
        ts = tb = None
        while tb is None:
            r.settle()
            now = time.perf_counter()
            if ts is None and x2.state is not XferState.IN_PROGRESS: ts = now - t0
            if x1.state is not XferState.IN_PROGRESS: tb = now - t0
            time.sleep(0.0001)
        if ts is None: ts = tb
        res[x2.worker].append((ts * 1e6, tb * 1e6))
    for w, v in res.items():
        if v:
            v.sort()
            print("express" if express else "plain  ", f"small on worker {w} ({len(v)}): small p50 {v[len(v)//2][0]:.0f} us, big p50 {sorted(x[1] for x in v)[len(v)//2]:.0f} us")
