"""Authentication between two engine processes over UCX loopback: the right
secret loads bit-exact; a consumer with the wrong secret is refused, computes
nothing from the producer, and the producer's blocks still free (the lease
expires: an unauthenticated peer cannot release it either)."""

from __future__ import annotations

import os

import pytest

from rdma_kv.harness.engine import ModelShape
from rdma_kv.harness.process import EngineProcess

pytestmark = [pytest.mark.ucx, pytest.mark.multiprocess, pytest.mark.timeout(120)]

SHAPE = ModelShape(num_layers=4, num_kv_heads=4, head_size=32, block_size=16, num_blocks=512)
LEASE_TTL_S = 6.0  # (3 s left a loaded host little room between a prefill and its load's first renewal)


def config(role, engine_id, secret_file, policy="fail", **extra):
    return {"kv_connector": "RdmaKVConnector", "kv_role": role, "engine_id": engine_id, "kv_port": 0,
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"read_timeout_s": 2.0, "load_timeout_s": 4.0, "rpc_timeout_s": 1.0,
                                          "connect_timeout_s": 1.0, "lease_ttl_s": LEASE_TTL_S,
                                          "auth_secret_file": secret_file, **extra}}


def test_two_processes_with_and_without_the_secret(tmp_path, rng):
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.write_bytes(os.urandom(32).hex().encode())
    bad.write_bytes(os.urandom(32).hex().encode())
    for path in (good, bad):
        os.chmod(path, 0o600)
    prompts = {f"a{i}": rng.integers(1, 999, int(rng.integers(20, 200))).tolist() for i in range(6)}
    # Both decode engines start before the prefill: the leases' TTL runs
    # from the prefill, and an engine's start on a loaded machine can take longer.
    with EngineProcess("prefill-auth", config("kv_producer", "PA", str(good)), SHAPE) as p, \
            EngineProcess("decode-auth", config("kv_consumer", "DA", str(good), read_timeout_s=30.0,
                                                load_timeout_s=60.0), SHAPE) as d, \
            EngineProcess("decode-wrong", config("kv_consumer", "DW", str(bad)), SHAPE) as d2:
        for rid, prompt in prompts.items():
            p.add(rid, prompt, {"do_remote_decode": True})
        params = {rid: r["kv_transfer_params"] for rid, r in p.wait_results(prompts, timeout_s=30).items()}
        for value in params.values():
            assert good.read_text() not in repr(value)
        ids = list(prompts)
        for rid in ids[:4]:
            d.add(rid, prompts[rid], params[rid])
        results = d.wait_results(ids[:4], timeout_s=30)
        errors = [x.get("error") for x in (d.call("stats") or {}).get("requests", []) if x.get("error")]
        for rid, r in results.items():
            assert r["status"] == "finished" and not r["load_failed"] and r["bad_blocks"] == [], (rid, errors)
        for rid in ids[4:]:
            d2.add(rid, prompts[rid], params[rid])
        for rid, r in d2.wait_results(ids[4:], timeout_s=15).items():
            assert r["status"] == "failed" and r["load_failed"], (rid, r)
            assert "authentication" in (r["error"] or "") or r["error"], r
        # The refused consumer could not release its leases: they expire, nothing stranded.
        p.wait_status(lambda s: s["leases"] == 0 and s["held"] == 0 and s["free_blocks"] == SHAPE.num_blocks,
                      timeout_s=LEASE_TTL_S + 10)
