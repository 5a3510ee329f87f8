"""rdma_kv.ray without Ray: importing it loads neither Ray nor vLLM, and the
per-replica rule (``replica_kv_transfer_config``) gives every replica and
every TP rank its own side-channel port and each replica its own engine id.
The backend inside Ray Serve runs in tests/vllm/test_vllm_ray.py (slow)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rdma_kv.ray import replica_kv_transfer_config

CONFIG = {"kv_connector": "RdmaKVConnector", "kv_connector_module_path": "rdma_kv.vllm",
          "kv_role": "kv_producer", "kv_port": 5600,
          "kv_connector_extra_config": {"auth_secret_file": "/run/secrets/rdma-kv/secret"}}


def test_importing_rdma_kv_ray_imports_neither_ray_nor_vllm():
    code = ("import sys, rdma_kv.ray; assert callable(rdma_kv.ray.register_backend); "
            "print(sorted(m for m in ('ray', 'vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out


def ports(tp: int, replicas: int) -> list[int]:
    """Every port the producers' TP ranks listen on (kv_port + tp_rank)."""
    out = []
    for k in range(replicas):
        c = replica_kv_transfer_config(CONFIG, replica_rank=k, num_devices=tp, dp_rank=None,
                                       node_ip="10.0.0.7", suffix="abc")
        out += [c["kv_port"] + r for r in range(tp)]
    return out


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_replicas_and_tp_ranks_never_share_a_port(tp):
    got = ports(tp, replicas=4)
    assert len(got) == len(set(got)) == 4 * tp and min(got) == 5600


def test_each_replica_has_its_own_engine_id_and_the_node_address():
    a, b = (replica_kv_transfer_config(CONFIG, replica_rank=k, num_devices=1, dp_rank=None,
                                       node_ip="10.0.0.7", suffix=s) for k, s in ((0, "x1"), (1, "y2")))
    assert a["engine_id"] != b["engine_id"] and a["engine_id"].startswith("rdma-kv-r0-")
    assert a["kv_connector_extra_config"]["side_channel_host"] == "10.0.0.7"
    assert a["kv_connector_extra_config"]["auth_secret_file"] == "/run/secrets/rdma-kv/secret"
    assert CONFIG["kv_connector_extra_config"] == {"auth_secret_file": "/run/secrets/rdma-kv/secret"}  # not mutated


def test_what_the_config_names_is_kept():
    named = {**CONFIG, "engine_id": "p", "kv_connector_extra_config": {"side_channel_host": "0.0.0.0"}}
    c = replica_kv_transfer_config(named, replica_rank=2, num_devices=1, dp_rank=None,
                                   node_ip="10.0.0.7", suffix="z")
    assert c["engine_id"] == "p-r2-z" and c["kv_connector_extra_config"] == {
        "side_channel_host": "0.0.0.0", "advertise_host": "10.0.0.7"}
    # data parallel: the connector adds dp_rank * tp_size itself; kv_port 0 stays "any free port"
    assert replica_kv_transfer_config(CONFIG, replica_rank=0, num_devices=2, dp_rank=3, node_ip="h",
                                      suffix="z")["kv_port"] == 5600
    assert replica_kv_transfer_config({**CONFIG, "kv_port": 0}, replica_rank=5, num_devices=1, dp_rank=None,
                                      node_ip="h", suffix="z")["kv_port"] == 0
