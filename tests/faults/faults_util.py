"""Shared pieces of the fault and soak tests: engine configs, the model
shape, prefill/settle helpers, resource snapshots for leak checks, and a
stop that has taken effect."""

from __future__ import annotations

import os
import signal
import time

from rdma_kv.harness.engine import ModelShape

SHAPE = ModelShape(num_layers=4, num_kv_heads=4, head_size=32, block_size=16, num_blocks=4096)
BS = SHAPE.block_size


def config(role, engine_id, policy="recompute", **extra):
    return {"kv_connector": "RdmaKVConnector", "kv_role": role, "engine_id": engine_id, "kv_port": 0,
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"read_timeout_s": 2.0, "load_timeout_s": 4.0, "rpc_timeout_s": 1.0,
                                          "connect_timeout_s": 1.0, **extra}}


def prefill(p, prompts, timeout_s=60.0):
    for rid, prompt in prompts.items():
        p.add(rid, prompt, {"do_remote_decode": True})
    results = p.wait_results(prompts, timeout_s=timeout_s)
    return {rid: results[rid]["kv_transfer_params"] for rid in prompts}


def idle(shape=SHAPE):
    return lambda s: (s["held"] == 0 and s["leases"] == 0 and s["inflight_loads"] == 0
                      and s["requests"] == 0 and s["free_blocks"] == shape.num_blocks)


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def check_loaded(rid, r):
    """A decode result: verified bit-exact, or a load error recomputed from
    the first block it tried to load (kv_load_failure_policy=recompute)."""
    assert r["status"] == "finished", (rid, r["status"], r["error"])
    if r["load_failed"]:
        assert r["recomputed_from_block"] == r["local_hit_tokens"] // BS, (rid, r)
        return "load_error"
    assert r["bad_blocks"] == [], f"{rid}: blocks {r['bad_blocks']} differ from the producer's"
    return "verified"


def stop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP process ``pid`` and return once every thread of it is
    stopped. ``kill`` returns with the stop only queued: the group stop
    begins when one thread of the process takes the signal, and until then
    its other threads run on. On a loaded host that is milliseconds: a
    producer answered a HANDSHAKE sent 2 ms after the kill (the test pinned
    to one CPU beside a busy loop; its threads all reached state T 2.6 ms
    after it), and the loads meant to meet a stopped producer read and
    waited on their CONFIRM instead."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        running = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except FileNotFoundError:
                continue  # the thread ended meanwhile
            if state not in ("T", "t", "Z", "X"):
                running.append((tid, state))
        if not running:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid}: threads {running} not stopped {timeout_s} s after SIGSTOP")
        time.sleep(0.0005)
