"""One request alone, stage by stage: rdma-kv against NIXL, alternating.

The scale curves' one-request point (``rdma-kv bench --scale concurrency
--concurrency 1``) times a request from its post to its completion as
each reader sees it, one rep per backend at a time: its spread between
reps is wider than the difference it is asked to show. Here one process
reads with both engines from one target process (the same registered
buffers, the same block ids), the two engines taking turns rep by rep, and
each rep is cut into stages:

- rdma-kv: ``call`` (``read_prepared`` returned), ``done`` (the shim's
  completion stamp, ``Transfer.finished``), ``settled`` (the agent
  settled it, ``Transfer.settled``) and ``return`` (``wait()`` returned);
- NIXL: ``build`` (``make_prepped_xfer``), ``transfer`` (``transfer()``
  returned: on this host NIXL copies inline there) and ``return``
  (``check_xfer_state`` says DONE).

All from the rep's start, in µs; every rep's bytes are checked outside
the timed region. With ``--progress thread`` the rdma-kv reader runs as
shipped (its pump copies, ``wait()`` sleeps in C) instead of polling.

    .venv/bin/python bench/lone_request.py [--reps 600] [--blocks 16] [--block-bytes 32768]
        [--progress poll|thread] [--no-nixl] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

POOL_BLOCKS = 4096
SEED = 1
WARM_UP = 20  # reps of each engine left out of the figures
WAIT_S = 30.0


def _pattern(nbytes: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, 256, nbytes, dtype=np.uint8)


def _target(conn: Any, block_bytes: int, with_nixl: bool) -> None:
    """The producer: one buffer registered with both engines; it serves
    until the reader says stop (NIXL's worker progressed while it waits)."""
    from rdma_kv.bench.cma import page_aligned_buffer
    from rdma_kv.transport import Agent, AgentConfig

    agent = Agent("lone-target", AgentConfig(progress="thread"))
    buf = page_aligned_buffer(POOL_BLOCKS * block_bytes)
    buf[:] = _pattern(buf.size)
    agent.register(buf)
    nixl_meta = None
    if with_nixl:
        from rdma_kv.bench.scale_peers import _nixl_agent

        nixl = _nixl_agent("lone-nixl-target", False)
        nixl.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
        nixl_meta = nixl.get_agent_metadata()
    conn.send((buf.ctypes.data, agent.metadata(), nixl_meta))
    while not conn.poll(0.001):
        if with_nixl:
            nixl.get_new_notifs()
    conn.recv()
    agent.close()


def _summary(values: list[float]) -> dict[str, float]:
    v = np.asarray(values[WARM_UP:]) * 1e6
    return {"p50_us": float(np.median(v)), "p10_us": float(np.percentile(v, 10)),
            "p90_us": float(np.percentile(v, 90))}


def run(reps: int, blocks: int, block_bytes: int, progress: str, with_nixl: bool) -> dict[str, Any]:
    from rdma_kv.bench.cma import page_aligned_buffer
    from rdma_kv.transport import Agent, AgentConfig, DescList

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    target = ctx.Process(target=_target, args=(there, block_bytes, with_nixl), daemon=True)
    target.start()
    try:
        if not here.poll(60):
            raise SystemExit("lone_request: the target did not start within 60 s")
        address, meta, nixl_meta = here.recv()
        pool = _pattern(POOL_BLOCKS * block_bytes).reshape(POOL_BLOCKS, block_bytes)
        local = page_aligned_buffer(blocks * block_bytes)
        view = local.reshape(blocks, block_bytes)
        agent = Agent("lone-reader", AgentConfig(progress=progress))
        agent.register(local)
        local_prep = agent.prep_local(DescList.from_regions(local.ctypes.data, np.arange(blocks) * block_bytes,
                                                            block_bytes))
        peer = agent.add_peer(meta)
        remote_prep = agent.prep_remote(peer, DescList.from_regions(address, np.arange(POOL_BLOCKS) * block_bytes,
                                                                    block_bytes))
        zero = np.zeros(1, dtype=np.int64)
        agent.read_prepared(local_prep, zero, remote_prep, zero).wait(WAIT_S)  # wire-up, untimed
        nixl = None
        if with_nixl:
            from rdma_kv.bench.nixl_peer import _warm_up
            from rdma_kv.bench.scale_peers import _nixl_agent, _nixl_list

            nixl = _nixl_agent("lone-nixl-reader", False)
            nixl.register_memory([(local.ctypes.data, local.nbytes, 0, "")], "DRAM")
            local_h = nixl.prep_xfer_dlist("NIXL_INIT_AGENT", _nixl_list(local.ctypes.data, blocks, block_bytes),
                                           "DRAM")
            nixl_peer = nixl.add_remote_agent(nixl_meta)
            remote_h = nixl.prep_xfer_dlist(nixl_peer, _nixl_list(address, POOL_BLOCKS, block_bytes), "DRAM")
            nixl.make_connection(nixl_peer)
            _warm_up(nixl, local_h, remote_h)
        rng = np.random.default_rng(7)
        local_ids = np.arange(blocks, dtype=np.int64)
        rk: dict[str, list[float]] = {"call": [], "done": [], "settled": [], "return": []}
        nx: dict[str, list[float]] = {"build": [], "transfer": [], "return": []}
        turns = ("rdma-kv", "nixl") if nixl is not None else ("rdma-kv",)
        for rep in range(reps * len(turns)):
            remote_ids = rng.choice(POOL_BLOCKS, blocks, replace=False).astype(np.int64)
            local.fill(0)
            if turns[rep % len(turns)] == "rdma-kv":
                t0 = time.perf_counter()
                x = agent.read_prepared(local_prep, local_ids, remote_prep, remote_ids)
                t1 = time.perf_counter()
                x.wait(WAIT_S)
                t2 = time.perf_counter()
                assert x.finished is not None and x.settled is not None
                for key, t in (("call", t1), ("done", x.finished), ("settled", x.settled), ("return", t2)):
                    rk[key].append(t - t0)
            else:
                assert nixl is not None
                lids, rids = local_ids.astype(np.int32), remote_ids.astype(np.int32)
                t0 = time.perf_counter()
                h = nixl.make_prepped_xfer("READ", local_h, lids, remote_h, rids)
                t1 = time.perf_counter()
                state = nixl.transfer(h)
                t2 = time.perf_counter()
                end = t2 + WAIT_S
                while state == "PROC" and time.perf_counter() < end:
                    state = nixl.check_xfer_state(h)
                t3 = time.perf_counter()
                h.release()
                if state != "DONE":
                    raise SystemExit(f"lone_request: NIXL's read ended in state {state!r}")
                for key, t in (("build", t1), ("transfer", t2), ("return", t3)):
                    nx[key].append(t - t0)
            if not np.array_equal(view, pool[remote_ids]):
                raise SystemExit(f"lone_request: rep {rep} ({turns[rep % len(turns)]}) read wrong bytes")
        agent.close()
        out: dict[str, Any] = {"reps": reps, "blocks": blocks, "block_bytes": block_bytes, "progress": progress,
                               "rdma_kv": {k: _summary(v) for k, v in rk.items()}}
        if nixl is not None:
            out["nixl"] = {k: _summary(v) for k, v in nx.items()}
            out["return_ratio"] = out["rdma_kv"]["return"]["p50_us"] / out["nixl"]["return"]["p50_us"]
        return out
    finally:
        here.send("stop")
        target.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=600, help="reps per engine (the first 20 of each left out)")
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--block-bytes", type=int, default=32768)
    ap.add_argument("--progress", choices=("poll", "thread"), default="poll")
    ap.add_argument("--no-nixl", action="store_true", help="rdma-kv alone")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.reps <= WARM_UP:
        ap.error(f"--reps must be more than {WARM_UP} (the warm-up reps are left out)")
    with_nixl = not args.no_nixl
    if with_nixl:
        from rdma_kv.bench.nixl_peer import nixl_available

        why = nixl_available()
        if why is not None:
            print(f"NIXL left out: {why}", file=sys.stderr)
            with_nixl = False
    out = run(args.reps, args.blocks, args.block_bytes, args.progress, with_nixl)
    print(f"one request of {args.blocks} x {args.block_bytes} B, {args.reps} reps each, rdma-kv progress="
          f"{args.progress}; µs from the rep's start, p50 [p10 - p90]")
    for engine in ("rdma_kv", "nixl"):
        for stage, s in out.get(engine, {}).items():
            print(f"  {engine:8s} {stage:9s} {s['p50_us']:8.1f}  [{s['p10_us']:.1f} - {s['p90_us']:.1f}]")
    if "return_ratio" in out:
        print(f"rdma-kv / NIXL, time to return (p50): {out['return_ratio']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
