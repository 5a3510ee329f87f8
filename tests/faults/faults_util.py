"""Shared pieces of the fault and soak tests: engine configs, the model
shape, prefill/settle helpers, resource snapshots for leak checks (a stop that
has taken effect: ``tests/procstop.py``), engines on a veth pair."""

from __future__ import annotations

import contextlib
import os

import pytest

from rdma_kv.harness import netns
from rdma_kv.harness.engine import ModelShape
from rdma_kv.harness.process import EngineProcess

SHAPE = ModelShape(num_layers=4, num_kv_heads=4, head_size=32, block_size=16, num_blocks=4096)
BS = SHAPE.block_size


def config(role, engine_id, policy="recompute", **extra):
    return {"kv_connector": "RdmaKVConnector", "kv_role": role, "engine_id": engine_id, "kv_port": 0,
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"read_timeout_s": 2.0, "load_timeout_s": 4.0, "rpc_timeout_s": 1.0,
                                          "connect_timeout_s": 1.0, **extra}}


@contextlib.contextmanager
def veth_link(prefix, subnet):
    """A veth pair between two namespaces of the test's own (``netns.VethLink``,
    named ``<prefix><pid>``), or the test skipped, saying why."""
    why = netns.unavailable()
    if why:
        pytest.skip(f"wire tests need network namespaces: {why}")
    with netns.VethLink(f"{prefix}{os.getpid() % 10**6}", subnet) as veth:
        yield veth


def wire_engine(link, side, name, role, **extra):
    """An engine in end ``side``'s namespace, UCX over TCP on its end of the pair."""
    cfg = config(role, name, **extra)
    cfg["kv_ip"] = link.addr[side]
    # A producer off loopback needs a secret or this flag; the namespaces are the test's own.
    cfg["kv_connector_extra_config"]["allow_unauthenticated"] = True
    cfg["kv_connector_extra_config"]["ucx_options"] = {"TLS": "tcp", "NET_DEVICES": link.dev[side]}
    return EngineProcess(name, cfg, SHAPE, netns=link.ns[side])


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


