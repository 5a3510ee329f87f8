"""CPU time an idle engine burns: rdma-kv as shipped against NIXL.

Two processes per engine, a target and a reader, connected, one transfer
made (so that every thread is up and wired), then left idle: each child
reports the CPU time its whole process used (user + system, every thread)
over ``--idle-s`` seconds of doing nothing, as CPU seconds per idle
second (1.0 = one core busy all the time).

- ``rdma-kv``: ``Agent(name)`` as shipped (``progress="thread"``, lanes
  as ``AgentConfig`` gives them on the host): a pump per worker and a
  service thread, all asleep on their event fds once ``spin_s`` passed.
- ``nixl``: NIXL 1.5.1's agent with its progress thread
  (``enable_prog_thread=True``), as NixlConnector runs it.
- ``nixl-poll`` (on request): the same without the progress thread, the
  configuration ``rdma-kv bench --vs nixl`` times NIXL's reader in; its
  owner must then drive progress itself (``check_xfer_state``,
  ``get_new_notifs``), as rdma-kv's ``progress="poll"`` does.

    .venv/bin/python bench/idle_cpu.py [--idle-s 2] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import time
from typing import Any

import numpy as np

NBYTES = 1 << 20


def _cpu_s() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _idle(conn: Any, idle_s: float) -> None:
    """Measure this process idle for ``idle_s`` and report it."""
    time.sleep(0.05)  # past every spin window
    cpu0, wall0 = _cpu_s(), time.monotonic()
    time.sleep(idle_s)
    conn.send((_cpu_s() - cpu0) / (time.monotonic() - wall0))


def _rdmakv(role: str, conn: Any, idle_s: float) -> None:
    from rdma_kv.transport import Agent, DescList

    with Agent(f"idle-{role}") as agent:
        buf = np.ones(NBYTES, dtype=np.uint8)
        agent.register(buf)
        conn.send((agent.metadata(), buf.ctypes.data))
        md, addr = conn.recv()
        peer = agent.add_peer(md)
        if role == "reader":
            agent.read(peer, DescList([buf.ctypes.data], NBYTES), DescList([addr], NBYTES)).wait(10)
        conn.send("wired")
        conn.recv()
        _idle(conn, idle_s)
        conn.recv()


def _nixl(role: str, conn: Any, idle_s: float, progress_thread: bool = True) -> None:
    from rdma_kv.bench.nixl_peer import DEFAULT_OPTIONS, _agent

    agent = _agent(f"idle-{role}", dict(DEFAULT_OPTIONS, progress_thread=progress_thread, telemetry=False,
                                        num_threads=0))
    buf = np.ones(NBYTES, dtype=np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    md, addr = conn.recv()
    peer = agent.add_remote_agent(md)
    if role == "reader":
        one = np.array([[buf.ctypes.data, NBYTES, 0]], dtype=np.uint64)
        other = np.array([[addr, NBYTES, 0]], dtype=np.uint64)
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(one, "DRAM"), agent.get_xfer_descs(other, "DRAM"),
                                       peer)
        state = agent.transfer(handle)
        end = time.monotonic() + 10
        while state == "PROC" and time.monotonic() < end:
            state = agent.check_xfer_state(handle)
        handle.release()
    conn.send("wired")
    if not progress_thread:  # the peer's wire-up needs this side's progress until both are wired
        while not conn.poll(0.001):
            agent.get_new_notifs()
    conn.recv()
    _idle(conn, idle_s)
    conn.recv()
    agent.deregister_memory(reg)


def _nixl_poll(role: str, conn: Any, idle_s: float) -> None:
    _nixl(role, conn, idle_s, progress_thread=False)


def run(engine: str, idle_s: float) -> tuple[float, float]:
    """(target, reader) CPU seconds per idle second."""
    ctx = mp.get_context("spawn")
    body = {"rdma-kv": _rdmakv, "nixl": _nixl, "nixl-poll": _nixl_poll}[engine]
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=body, args=(role, child, idle_s), daemon=True)
             for role, (_, child) in zip(("target", "reader"), pipes)]
    for p in procs:
        p.start()
    (t, _), (r, _) = pipes
    t_md, r_md = t.recv(), r.recv()
    t.send(r_md)
    r.send(t_md)
    for c in (t, r):
        c.recv()  # wired
    for c in (t, r):
        c.send("idle")
    out = (t.recv(), r.recv())
    for c in (t, r):
        c.send("stop")
    for p in procs:
        p.join(30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle-s", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default="rdma-kv,nixl", help="comma list of rdma-kv, nixl, nixl-poll")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows: dict[str, list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for engine in args.engines.split(","):
            rows.setdefault(engine, []).append(run(engine, args.idle_s))
    print(f"{'engine':10} {'target':>8} {'reader':>8}   CPU seconds per idle second, median of {args.rounds} "
          f"({args.idle_s} s each; 1.0 = one core busy)")
    for engine, vals in rows.items():
        print(f"{engine:10} {statistics.median(v[0] for v in vals):8.3f} {statistics.median(v[1] for v in vals):8.3f}")
    print(f"load average {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f)


if __name__ == "__main__":
    main()
