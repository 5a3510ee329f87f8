"""How long a new prefill waits when leases hold most of the producer's KV cache.

    .venv/bin/python bench/lease_pressure.py [--reps 5] [--cap 60] [--out FILE.json]

A producer engine with 64 blocks (the harness model, UCX loopback) and a
decode engine whose reads are held (``gate_reads``), so its six loads of
10-block prompts keep renewing their leases (TTL 2 s): 60 of 64 blocks are
held. Then a 20-block (320-token) prefill is added to the producer, and the
time until it finishes is measured, capped at ``--cap`` seconds (without a
policy it waits for the leases, i.e. for as long as the decode renews).
The reference is the same prefill afterwards, with no lease held. Per repetition the
engines are fresh. Reported: the median and max wait with leases held and
without, and how many of the held loads ended as load errors (reclaimed)
or verified once the reads are let through.

Runs against an older tree too (``PYTHONPATH=<old>/src``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import time

import numpy as np

from rdma_kv.harness.engine import ModelShape
from rdma_kv.harness.process import EngineProcess, HarnessError

SHAPE = ModelShape(num_layers=4, num_kv_heads=4, head_size=32, block_size=16, num_blocks=4096)
SMALL = dataclasses.replace(SHAPE, num_blocks=64)


def config(role: str, engine_id: str, **extra: object) -> dict:
    return {"kv_connector": "RdmaKVConnector", "kv_role": role, "engine_id": engine_id, "kv_port": 0,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"load_timeout_s": 600.0, "read_timeout_s": 600.0, **extra}}


def prefill(p: EngineProcess, rid: str, prompt: list[int], cap_s: float) -> float | None:
    start = time.monotonic()
    p.add(rid, prompt, {"do_remote_decode": True})
    try:
        p.wait_results([rid], timeout_s=cap_s)
    except HarnessError:
        return None
    return time.monotonic() - start


def one(rep: int, cap_s: float) -> dict:
    rng = np.random.default_rng(rep)
    with EngineProcess(f"lp-prefill{rep}", config("kv_producer", f"LP{rep}", lease_ttl_s=2.0), SMALL) as p, \
            EngineProcess(f"lp-decode{rep}", config("kv_consumer", f"LD{rep}"), SHAPE,
                          faults={"gate_reads": True}) as d:
        held = {f"h{i}": rng.integers(1, 999, 10 * 16).tolist() for i in range(6)}
        params = {}
        for rid, prompt in held.items():
            p.add(rid, prompt, {"do_remote_decode": True})
            params[rid] = p.wait_results([rid], timeout_s=60)[rid]["kv_transfer_params"]
        d.close_gate()
        for rid, prompt in held.items():
            d.add(rid, prompt, params[rid])
        d.wait_status(lambda s: len(s["loading_ids"]) == len(held), timeout_s=60)
        waited = prefill(p, "new", rng.integers(1, 999, 20 * 16).tolist(), cap_s)
        d.open_gate()
        outcomes = {"verified": 0, "load_error": 0}
        for r in d.wait_results(list(held), timeout_s=120).values():
            outcomes["load_error" if r["load_failed"] else "verified"] += 1
        p.call("expire_leases")  # the new prefill's own lease: nobody reads it
        p.wait_status(lambda s: s["leases"] == 0 and s["held"] == 0, timeout_s=60)
        free = prefill(p, "alone", rng.integers(1, 999, 20 * 16).tolist(), cap_s)  # the reference
    row = {"rep": rep, "alone_s": free, "with_leases_s": waited, **outcomes}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cap", type=float, default=60.0, help="seconds a prefill may wait before it counts as starved")
    ap.add_argument("--label", default="")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = [one(rep, args.cap) for rep in range(args.reps)]
    waited = [r["with_leases_s"] for r in rows]
    done = [w for w in waited if w is not None]
    summary = {
        "alone_median_s": round(statistics.median(r["alone_s"] for r in rows if r["alone_s"] is not None), 3),
        "with_leases_median_s": round(statistics.median(done), 3) if done else None,
        "with_leases_max_s": round(max(done), 3) if done else None,
        "starved_past_cap": sum(w is None for w in waited),
        "held_loads_verified": sum(r["verified"] for r in rows),
        "held_loads_reclaimed": sum(r["load_error"] for r in rows),
    }
    print(json.dumps(summary))
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.out, "w") as f:
            json.dump({"bench": "lease_pressure", "label": args.label, "commit": commit, "args": vars(args),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "summary": summary,
                       "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
