"""The RDMA connector's overhead on top of the raw transport, same run, same workload.

A 256-block request of a Llama-8B-like shape (32 layers, 8 KV heads x 128
head size, block 16, fp16: 64 KiB per layer per block in vLLM's CPU layout,
K and V 32 KiB each; 512 MiB per request) moves from a producer engine to a
consumer engine in this process over UCX loopback (two agents, the harness
engine driving the connector in the contract's call order). Each repetition
measures, on the same agents, memory and peer:

- ``raw``: ``Agent.read_prepared`` of the same block ids (post -> completion);
- ``connector transfer``: the connector's read of the request (post ->
  completion, from its per-request stats);
- ``connector load``: admission -> the worker reports the request finished
  (index planning, posting, the read, and the validate-after-read CONFIRM
  round trip on the side channel).

Prints medians and the ratio connector / raw GB/s (the bar: >= 0.9), and
descriptors posted per request vs contiguous block runs.

Usage: python bench/experiments/connector_overhead.py [--reps 7] [--blocks 256] [--layers 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from rdma_kv.connector import KVTransferConfig
from rdma_kv.harness.engine import Engine, ModelShape


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=0, help="pool size (default 2 x blocks + 8)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    shape = ModelShape(num_layers=args.layers, num_kv_heads=8, head_size=128, block_size=16,
                       num_blocks=args.num_blocks or 2 * args.blocks + 8, dtype="float16")

    def cfg(role, eid):
        return KVTransferConfig(kv_connector="RdmaKVConnector", kv_role=role, engine_id=eid, kv_port=0,
                                kv_connector_extra_config={"read_timeout_s": 30.0, "load_timeout_s": 60.0})

    P = Engine(cfg("kv_producer", "bench-P"), shape, fill=False, verify=False)
    D = Engine(cfg("kv_consumer", "bench-D"), shape, fill=False, verify=False)
    rng = np.random.default_rng(args.seed)
    tokens = args.blocks * shape.block_size
    nbytes = args.blocks * shape.block_nbytes
    print(f"workload: {args.blocks} blocks x {args.layers} layers x {shape.block_nbytes // args.layers // 1024} KiB "
          f"= {nbytes / 2**20:.0f} MiB per request; {args.reps} reps (+1 warm-up)")
    rows = []
    try:
        for rep in range(args.reps + 1):
            rid = f"b{rep}"
            prompt = rng.integers(1, 30000, tokens).tolist()
            P.add_request(rid, prompt, {"do_remote_decode": True})
            P.run(until=lambda: rid in P.results and P.results[rid].status.value == "finished", timeout_s=60)
            params = P.results[rid].kv_transfer_params
            P.step()  # ship the lease grant to the producer's worker, as its next step would
            D.add_request(rid, prompt, params)
            # The decode engine idles (sleeps 0.5 ms between steps) while the
            # load is in flight, as Engine.run does: on loopback the copy is
            # CPU work in this process, so a spinning loop would steal it.
            D.run(until=lambda: D.results[rid].status.value == "finished", timeout_s=60)
            load_s = D.results[rid].load_s
            rec = D.worker.get_kv_connector_stats()["requests"][-1]
            assert not D.results[rid].load_failed and rec["ok"], rec
            # raw: the same agents, peer and block ids, straight through read_prepared
            w = D.worker.worker._consumer  # the read path: its peers, slot tables and transport
            peer = next(iter(w.peers._peers.values()))
            remote_ids = np.asarray(params["remote_block_ids"], dtype=np.int64)
            local_ids = np.arange(len(remote_ids), dtype=np.int64) + 4
            plan = w.peers.plan(peer.address)
            (slots, local_prep), (remote, remote_prep) = w.peers.tables(plan, plan.reads[0], peer.connection)
            li, ri = slots.indices(local_ids, "local"), remote.indices(remote_ids, "remote")
            t1 = time.perf_counter()
            xfer = w._local.transport.read_prepared(local_prep, li, remote_prep, ri, timeout_s=30)
            xfer.wait(60)
            raw_s = time.perf_counter() - t1
            P.run(until=lambda: not P.held, timeout_s=30)
            if rep == 0:
                continue  # warm-up: handshake, first-touch of pages
            rows.append({"raw_s": raw_s, "raw_post_s": xfer.post_s, "raw_ops": xfer.ops_posted,
                         "conn_s": rec["transfer_s"], "conn_post_s": rec["post_s"], "plan_s": rec["plan_s"],
                         "confirm_s": rec.get("confirm_s", 0.0), "load_s": load_s,
                         "ops": rec["ops_posted"], "runs": rec["block_runs"], "descs": rec["num_descs"]})
    finally:
        P.shutdown()
        D.shutdown()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    gb = nbytes / 1e9
    print(f"raw Agent.read_prepared : {gb / med['raw_s']:6.2f} GB/s  ({med['raw_s'] * 1e3:7.2f} ms, "
          f"post {med['raw_post_s'] * 1e3:.2f} ms, {med['raw_ops']:.0f} ops)")
    print(f"connector transfer      : {gb / med['conn_s']:6.2f} GB/s  ({med['conn_s'] * 1e3:7.2f} ms, "
          f"post {med['conn_post_s'] * 1e3:.2f} ms, planning {med['plan_s'] * 1e3:.2f} ms)")
    print(f"connector load (admission -> done_recving, incl. CONFIRM {med['confirm_s'] * 1e3:.2f} ms): "
          f"{gb / med['load_s']:6.2f} GB/s  ({med['load_s'] * 1e3:7.2f} ms)")
    print(f"ratio connector/raw: transfer {med['raw_s'] / med['conn_s']:.2f}x, "
          f"end-to-end load {med['raw_s'] / med['load_s']:.2f}x")
    print(f"descriptors per request: {med['descs']:.0f} -> ops posted {med['ops']:.0f} "
          f"(contiguous runs {med['runs']:.0f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
