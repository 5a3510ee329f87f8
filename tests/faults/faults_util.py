"""Shared pieces of the fault and soak tests: engine configs, the model
shape, prefill/settle helpers, resource snapshots for leak checks (a stop that
has taken effect: ``tests/procstop.py``)."""

from __future__ import annotations

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


