"""rdma-kv inside vLLM: ``RdmaKVConnector`` for ``kv_connector_module_path``.

    kv_transfer_config={"kv_connector": "RdmaKVConnector",
                        "kv_connector_module_path": "rdma_kv.vllm",
                        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                        "kv_connector_extra_config": {...}}

The only package of rdma-kv that imports vLLM (``import rdma_kv`` never
does). Importing it is cheap and side-effect free, as vLLM needs: it
imports vLLM's KV-connector base classes and rdma-kv's engine-neutral
types; UCX, threads and sockets appear only when vLLM creates a connector
instance in an engine. Modules: ``connector`` (the adapter class),
``translate`` (vLLM objects <-> engine-neutral ones, no vLLM import),
``stats`` (``RdmaKVConnectorStats``). See ``docs/vllm.md``.
"""

from rdma_kv.vllm.connector import (
    RdmaKVConnector,
    RdmaKVConnectorMetadata,
    RdmaKVHandshakeMetadata,
)
from rdma_kv.vllm.stats import RdmaKVConnectorStats

__all__ = [
    "RdmaKVConnector",
    "RdmaKVConnectorMetadata",
    "RdmaKVConnectorStats",
    "RdmaKVHandshakeMetadata",
]
