"""One NIC per rank: ``ucx_net_devices`` gives each TP rank's UCX context
its own ``NET_DEVICES``. Eight ranks of one 8-GPU node, each with its KV
cache on its own (fake) GPU, through the worker with a transport factory
that records the settings it is handed."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import FakeCudaTensor
from fakes import FakeFabric

from rdma_kv.connector import KVTransferConfig
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.worker import RdmaWorker
from rdma_kv.connector.specs import FullAttentionSpec, KVCacheConfig
from rdma_kv.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

TP = 8
SPEC = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float16")


def settings(rank, **extra):
    config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_consumer", engine_id="D",
                              kv_port=0, kv_connector_extra_config={"tp_rank": rank, "tp_size": TP,
                                                                    "side_channel_port": 15000, **extra})
    return config, RdmaSettings.from_config(config)


def net_devices_of_rank(rank, gpu, **extra):
    """NET_DEVICES of the UCX context rank ``rank`` creates, its KV cache on
    ``cuda:gpu`` (None: host memory)."""
    config, s = settings(rank, **extra)
    fabric, seen = FakeFabric(), []

    def factory(name, rank_settings):
        seen.append(rank_settings)
        return fabric.factory(name, rank_settings)

    host = torch.zeros(16, 2, 4, 16, dtype=torch.float16)
    kv = host if gpu is None else FakeCudaTensor(host, gpu)
    w = RdmaWorker(config, s, KVCacheConfig.uniform(16, ["layer.0"], SPEC), factory)
    try:
        w.register_kv_caches({"layer.0": kv})
    finally:
        w.shutdown()
    (got,) = seen
    return got.ucx_options.get("NET_DEVICES")


@pytest.mark.parametrize("rank", range(TP))
def test_each_rank_gets_the_nic_of_its_gpu(rank):
    assert net_devices_of_rank(rank, gpu=rank, ucx_net_devices="mlx5_{local_rank}:1") == f"mlx5_{rank}:1"
    # The GPU decides, not the rank (a rank on GPU 7 - rank):
    assert net_devices_of_rank(rank, gpu=TP - 1 - rank, ucx_net_devices="mlx5_{local_rank}:1") == \
        f"mlx5_{TP - 1 - rank}:1"
    assert net_devices_of_rank(rank, gpu=None, ucx_net_devices="mlx5_{rank}:1,mlx5_{rank}:2") == \
        f"mlx5_{rank}:1,mlx5_{rank}:2"
    table = {str(r): f"mlx5_{(r * 3) % TP}:1" for r in range(TP)}
    assert net_devices_of_rank(rank, gpu=rank, ucx_net_devices=table) == table[str(rank)]


def test_unset_leaves_ucx_default_and_keeps_other_options():
    assert net_devices_of_rank(3, gpu=3) is None
    _, s = settings(2, ucx_net_devices="mlx5_{rank}:1", ucx_options={"TLS": "rc,cuda_copy"})
    assert s.for_device("cuda:2").ucx_options == {"TLS": "rc,cuda_copy", "NET_DEVICES": "mlx5_2:1"}
    assert s.ucx_options == {"TLS": "rc,cuda_copy"}


@pytest.mark.parametrize("value, message", [
    ("mlx5_{gpu}:1", "may name only {rank} and {local_rank}"),
    ("mlx5_{rank:1", "malformed"),
    ({str(r): "mlx5_0:1" for r in range(TP - 1)}, "name every rank 0..7"),
    ({"x": "mlx5_0:1"}, "map each TP rank to its devices"),
    ({"0": ""}, "map each TP rank to its devices"),
    (["mlx5_0:1"], "must be a template string or a map"),
])
def test_bad_values_are_rejected_saying_what_to_write(value, message):
    with pytest.raises(ConfigError, match=message.replace("{", r"\{").replace("}", r"\}").replace("(", r"\(")):
        settings(0, ucx_net_devices=value)


def test_net_devices_set_twice_is_rejected():
    with pytest.raises(ConfigError, match="both ucx_net_devices and ucx_options"):
        settings(0, ucx_net_devices="mlx5_{rank}:1", ucx_options={"NET_DEVICES": "mlx5_0:1"})
