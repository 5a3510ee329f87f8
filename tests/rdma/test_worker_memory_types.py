"""The connector's worker registers every KV region with its memory type:
fake CUDA tensors (torch's storage and stride interfaces over host memory)
through ``register_kv_caches``, with a transport that records what it is
asked to register, and with the real agent, which must refuse them (UCX maps
host memory as host memory)."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import FakeCudaTensor
from fakes import FakeFabric

from rdma_kv.connector import KVTransferConfig
from rdma_kv.connector.rdma.connector import agent_transport
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.worker import RdmaWorker
from rdma_kv.connector.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from rdma_kv.errors import RegistrationError

pytestmark = pytest.mark.timeout(60)

LAYERS, BLOCKS, HEADS, BLOCK, HEAD = 3, 16, 2, 4, 8


def kv_cache(device: str):
    """All layers as views of one allocation (as vLLM allocates them), on
    ``device``: "cpu" (real tensors) or "cuda:N" (fake CUDA tensors)."""
    names = tuple(f"layer.{i}" for i in range(LAYERS))
    host = torch.zeros(LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD, dtype=torch.float16)
    whole = host if device == "cpu" else FakeCudaTensor(host, int(device.partition(":")[2]))
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype="float16")
    config = KVCacheConfig(BLOCKS, (KVCacheTensor(host.numel() * host.element_size(), names),),
                           (KVCacheGroupSpec(names, spec),))
    return {name: whole[i] for i, name in enumerate(names)}, config, host


def worker(kv_config, factory):
    config = KVTransferConfig(kv_connector="RdmaKVConnector", kv_role="kv_consumer", engine_id="D", kv_port=0)
    return RdmaWorker(config, RdmaSettings.from_config(config), kv_config, factory)


@pytest.mark.parametrize("device, memory_type", [("cuda:0", "cuda"), ("cuda:3", "cuda"), ("cpu", "host")])
def test_each_region_reaches_registration_with_its_memory_type(device, memory_type):
    fabric = FakeFabric()
    caches, kv_config, host = kv_cache(device)
    w = worker(kv_config, fabric.factory)
    try:
        w.register_kv_caches(caches)
        transport = fabric.agents[w.agent_name]
        # The KV cache as what it is; after it, the held words and the words' scratch, host memory.
        assert transport.regions[0] == (host.untyped_storage().data_ptr(), host.untyped_storage().nbytes())
        assert transport.memory_types[0] == memory_type
        assert transport.memory_types[1:] == ["host"] * (len(transport.regions) - 1)
    finally:
        w.shutdown()


@pytest.mark.ucx
def test_real_agent_refuses_cuda_kv_that_ucx_maps_as_host():
    caches, kv_config, _ = kv_cache("cuda:0")
    w = worker(kv_config, agent_transport)
    try:
        with pytest.raises(RegistrationError, match="declared cuda memory but UCX maps it as host"):
            w.register_kv_caches(caches)
    finally:
        w.shutdown()
