"""Fixed cost per request: ``Agent.read_prepared`` + ``wait``, stage by stage,
against NIXL's request build, caches cold and warm.

One 2 MiB block as the ``kv-one-block`` workload reads it: 64 descriptors of
32 KiB, random slots, a notification on every transfer. The target runs in
a child process (rdma-kv ``progress="thread"``, as ``rdma-kv bench``'s
target; NIXL with its progress thread). The reader is a second child:
rdma-kv polling (``progress="poll"``, as the bench's reader) or, with
``--progress thread``, as shipped (pump + ``wait()``); NIXL polling
``check_xfer_state``. Before every rep of a *cold* run a 1 GiB buffer is
overwritten, as the bench's ``local.fill(0)`` does, so that every stage
runs with the caches cold; a *warm* run skips it.

Stages, in microseconds (medians and p90 of every rep):

- rdma-kv, from the shim's own clock reads (CLOCK_MONOTONIC, the clock of
  ``perf_counter``): ``enter`` (call -> the shim entered: the Python side
  of the request), ``check`` (route, endpoints, every pair, a slot),
  ``post`` (the post loop), ``return`` (post loop -> returned: the
  ``Transfer``); ``build`` = enter + check, the request up to its first
  operation, what NIXL's ``make_prepped_xfer`` does. A tree without these
  clocks (before issue 29) reports ``call`` and ``post`` (its ``post_s``).
- NIXL: ``build`` (``make_prepped_xfer``), ``post`` (``transfer()``).
- both: ``call`` (call -> returned: build + post + return for rdma-kv,
  build + transfer for NIXL), ``wait`` (returned -> completion seen: by
  ``wait()``, or with ``--signal callback`` when ``add_done_callback``'s
  callback runs, as the connector learns of it), ``total``.

``--vs PYTHON`` also runs this script under another interpreter (another
checkout's venv: the code before a change) as ``before``, and ``--nixl``
adds NIXL; the configurations take turns ``--rounds`` times (before,
after, NIXL, before, ...) so that drift on a shared host falls on each.

    .venv/bin/python bench/experiments/fixed_cost.py [--reps 100] [--rounds 2] [--lanes 2]
        [--modes cold,warm] [--nixl] [--vs OTHER/.venv/bin/python] [--progress poll|thread]
        [--help-ab] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from rdma_kv.bench.cma import page_aligned_buffer

SLOTS, SLOT_BYTES, DESCS = 64 * 512, 32768, 64
STAGES = ("enter", "check", "build", "post", "return", "call", "wait", "total")


def _addrs(base: int) -> np.ndarray:
    return np.uint64(base) + np.arange(SLOTS, dtype=np.uint64) * np.uint64(SLOT_BYTES)


# --- rdma-kv -----------------------------------------------------------------------------------


def _rdmakv_target(conn: Any) -> None:
    from rdma_kv.transport import Agent, AgentConfig

    with Agent("fc-target", AgentConfig(progress="thread", lanes=1)) as agent:
        buf = np.ones(SLOTS * SLOT_BYTES, dtype=np.uint8)  # (written: faulted in)
        agent.register(buf)
        conn.send((agent.metadata(), buf.ctypes.data))
        conn.recv()  # stop
        conn.send(len(agent.get_notifications()))


def _requests(opts: dict[str, Any]) -> Iterator[tuple[np.ndarray, np.ndarray, bytes]]:
    """Each rep's (local slots, remote slots, notification), the same for
    every engine; with the caches swept just before it is handed out."""
    sweep = np.zeros(1 << 30, dtype=np.uint8) if opts["cold"] else None
    rng = np.random.default_rng(0)
    for rep in range(opts["reps"]):
        li = rng.choice(SLOTS, DESCS, replace=False).astype(np.int64)
        ri = rng.choice(SLOTS, DESCS, replace=False).astype(np.int64)
        if sweep is not None:
            sweep.fill(rep & 0xFF)
        yield li, ri, b"rep%d" % rep


@contextlib.contextmanager
def _target(body: Callable[[Any], None]) -> Iterator[Any]:
    """``body(conn)`` in a forked child; yields our end of the pipe."""
    parent, child = mp.Pipe()
    proc = mp.get_context("fork").Process(target=body, args=(child,), daemon=True)
    proc.start()
    try:
        yield parent
    finally:
        proc.join(10)


def _rdmakv_reps(opts: dict[str, Any]) -> list[dict[str, float]]:
    from rdma_kv.transport import Agent, AgentConfig, DescList

    rows: list[dict[str, float]] = []
    with _target(_rdmakv_target) as parent:
        md, addr = parent.recv()
        config = AgentConfig(progress=opts["progress"], lanes=opts["lanes"])
        with Agent("fc-reader", config) as reader:
            dst = page_aligned_buffer(SLOTS * SLOT_BYTES)  # pre-faulted: a fault costs ~20 us on this VM
            reader.register(dst)
            peer = reader.add_peer(md)
            core = getattr(reader, "_core", None)
            if not opts["help"]:  # the poller waits for the lanes' pumps (as before rk_pump_help)
                if core is not None:
                    core.driver.helpers = ()
                else:
                    reader._completions.helpers = ()
            # The shim's clock reads of the last request (rk_submit's out), where there are any.
            out = core.inflight.out if core is not None and hasattr(core, "inflight") else None
            local = reader.prep_local(DescList(_addrs(dst.ctypes.data), SLOT_BYTES))
            remote = reader.prep_remote(peer, DescList(_addrs(addr), SLOT_BYTES))
            one = np.zeros(1, dtype=np.int64)
            reader.read_prepared(local, one, remote, one, notify=b"w").wait(10)  # wire-up, untimed
            for li, ri, msg in _requests(opts):
                t0 = time.perf_counter_ns()
                xfer = reader.read_prepared(local, li, remote, ri, notify=msg)
                t1 = time.perf_counter_ns()
                if opts.get("signal") == "callback":
                    t2 = _callback_time(xfer)
                else:
                    xfer.wait(10)
                    t2 = time.perf_counter_ns()
                row = {"call": t1 - t0, "wait": t2 - t1, "total": t2 - t0, "post": xfer.post_s * 1e9}
                if out is not None:
                    entered, p0, p1 = int(out[5]), int(out[6]), int(out[7])
                    row.update(enter=entered - t0, check=p0 - entered, build=p0 - t0, post=p1 - p0,
                               **{"return": t1 - p1})
                rows.append(row)
                first = dst[li[0] * SLOT_BYTES:(li[0] + 1) * SLOT_BYTES]
                if not (first == 1).all():  # spot check: the target's bytes are all ones
                    raise SystemExit("data check failed")
                first[:] = 0
            parent.send("stop")
            got = parent.recv()
            if got < opts["reps"]:  # (the wire-up's notification counts too)
                raise SystemExit(f"target got {got} notifications for {opts['reps']} reps")
    return rows


def _callback_time(xfer: Any) -> int:
    """When a completion callback ran (the connector's way: it reads no
    handle, it is called back on the agent's thread)."""
    when: list[int] = []
    ran = threading.Event()

    def done(_: Any) -> None:
        when.append(time.perf_counter_ns())
        ran.set()

    xfer.add_done_callback(done)
    if not ran.wait(10):
        raise SystemExit("no completion callback within 10 s")
    xfer.wait(0)
    return when[0]


# --- NIXL ---------------------------------------------------------------------------------------


def _nixl_list(base: int) -> np.ndarray:
    arr = np.zeros((SLOTS, 3), dtype=np.uint64)
    arr[:, 0] = _addrs(base)
    arr[:, 1] = SLOT_BYTES
    return arr


def _nixl_agent(name: str, progress_thread: bool) -> Any:
    from rdma_kv.bench.nixl_peer import DEFAULT_OPTIONS, _agent

    return _agent(name, dict(DEFAULT_OPTIONS, progress_thread=progress_thread, telemetry=False, num_threads=0))


def _nixl_target(conn: Any) -> None:
    agent = _nixl_agent("fc-nixl-target", True)
    buf = np.ones(SLOTS * SLOT_BYTES, dtype=np.uint8)
    reg = agent.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    conn.recv()
    got = sum(len(v) for v in agent.get_new_notifs().values())
    agent.deregister_memory(reg)
    conn.send(got)


def _nixl_reps(opts: dict[str, Any]) -> list[dict[str, float]]:
    from rdma_kv.bench.nixl_peer import _warm_up

    rows: list[dict[str, float]] = []
    with _target(_nixl_target) as parent:
        md, addr = parent.recv()
        agent = _nixl_agent("fc-nixl-reader", False)
        dst = page_aligned_buffer(SLOTS * SLOT_BYTES)
        reg = agent.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
        name = agent.add_remote_agent(md)
        local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _nixl_list(dst.ctypes.data), "DRAM")
        remote_h = agent.prep_xfer_dlist(name, _nixl_list(addr), "DRAM")
        agent.make_connection(name)
        _warm_up(agent, local_h, remote_h)
        for li, ri, msg in _requests(opts):
            t0 = time.perf_counter_ns()
            handle = agent.make_prepped_xfer("READ", local_h, li, remote_h, ri, notif_msg=msg)
            t1 = time.perf_counter_ns()
            state = agent.transfer(handle)
            t2 = time.perf_counter_ns()
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            t3 = time.perf_counter_ns()
            if state != "DONE":
                raise SystemExit(f"NIXL READ ended in state {state!r}")
            handle.release()
            rows.append({"build": t1 - t0, "post": t2 - t1, "call": t2 - t0, "wait": t3 - t2, "total": t3 - t0})
            if not (dst[li[0] * SLOT_BYTES:(li[0] + 1) * SLOT_BYTES] == 1).all():
                raise SystemExit("NIXL data check failed")
            dst[li[0] * SLOT_BYTES:(li[0] + 1) * SLOT_BYTES] = 0
        local_h.release()
        remote_h.release()
        agent.remove_remote_agent(name)
        agent.deregister_memory(reg)
        parent.send("stop")
        parent.recv()
    return rows


# --- driver -------------------------------------------------------------------------------------


def _summary(rows: list[dict[str, float]]) -> dict[str, tuple[float, float]]:
    out = {}
    for s in STAGES:
        vals = sorted(r[s] / 1000 for r in rows if s in r)
        if vals:
            out[s] = (statistics.median(vals), vals[int(0.9 * (len(vals) - 1))])
    return out


def _child(opts: dict[str, Any]) -> list[dict[str, float]]:
    return _nixl_reps(opts) if opts["backend"] == "nixl" else _rdmakv_reps(opts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lanes", default="2", help="comma list of the rdma-kv reader's lanes (default 2)")
    ap.add_argument("--modes", default="cold,warm", help="cold (caches swept before every rep), warm, or both")
    ap.add_argument("--progress", default="poll", choices=("poll", "thread"), help="the rdma-kv reader's")
    ap.add_argument("--signal", default="wait", choices=("wait", "callback"),
                    help="rdma-kv: completion seen by wait() (default) or when add_done_callback's callback runs "
                         "(the connector's way; with --progress thread)")
    ap.add_argument("--nixl", action="store_true", help="add NIXL (its request build and transfer)")
    ap.add_argument("--vs", metavar="PYTHON", help="another checkout's interpreter, run as 'before'")
    ap.add_argument("--help-ab", action="store_true",
                    help="lanes > 1 twice: the poller helping idle lanes (help) and not (nohelp)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: one run, JSON rows on stdout
    args = ap.parse_args()
    if args.child:
        json.dump(_child(json.loads(args.child)), sys.stdout)
        return
    configs: list[tuple[str, str | None, dict[str, Any]]] = []
    for mode in args.modes.split(","):
        for lanes in (int(x) for x in args.lanes.split(",")):
            for help_ in ((True, False) if args.help_ab and lanes > 1 else (True,)):
                tag = f"{mode} lanes={lanes}" + ("" if not args.help_ab or lanes == 1 else "/help" if help_ else "/nohelp")
                opts = {"backend": "rdma-kv", "reps": args.reps, "cold": mode == "cold", "lanes": lanes,
                        "progress": args.progress, "help": help_, "signal": args.signal}
                if args.vs:
                    configs.append((f"before {tag}", args.vs, opts))
                configs.append((f"after {tag}" if args.vs else tag, None, opts))
        if args.nixl:
            configs.append((f"{mode} nixl", None, {"backend": "nixl", "reps": args.reps, "cold": mode == "cold"}))
    results: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for key, python, opts in configs:
            cmd = [python or sys.executable, __file__, "--child", json.dumps(opts)]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            results.setdefault(key, []).extend(json.loads(done.stdout))
            print(f"  {key}: {len(results[key])} reps", file=sys.stderr)
    width = max(len(k) for k in results) + 1
    print(f"{'config':{width}} " + " ".join(f"{s:>13}" for s in STAGES))
    for key, rows in results.items():
        summ = _summary(rows)
        print(f"{key:{width}} " + " ".join(
            f"{summ[s][0]:>6.1f}/{summ[s][1]:<6.1f}" if s in summ else f"{'-':>13}" for s in STAGES))
    print("us, median/p90 per stage; cold: caches swept (1 GiB) before every rep")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": results}, f)


if __name__ == "__main__":
    main()
