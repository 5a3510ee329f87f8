"""The engine-neutral KV-transfer v1 surface.

Config (``KVTransferConfig``), KV-cache specs, block geometry, the
connector contract (``KVConnectorBase``), the request / blocks /
scheduler-output types, the process's transfer group, the factory, and two
connectors: ``MultiConnector`` and ``StorageConnector``. The RDMA connector
(``rdma_kv.connector.rdma``) is registered by name and imported only when
asked for.

Importing this package imports numpy, never torch, vLLM, safetensors or
the transport. Layering: may import ``rdma_kv.errors`` (and, in the RDMA
connector only, ``rdma_kv.transport``); never ``rdma_kv.vllm``.
"""

from rdma_kv.connector.base import (
    KVConnectorBase,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from rdma_kv.connector.config import (
    KVBufferDevice,
    KVLoadFailurePolicy,
    KVRole,
    KVTransferConfig,
)
from rdma_kv.connector.factory import KVConnectorFactory
from rdma_kv.connector.geometry import (
    KVCacheGeometry,
    LayerGeometry,
    Layout,
    Region,
    Segment,
    derive_geometry,
    derive_layer_geometry,
    region_bytes,
    storage_address,
)
from rdma_kv.connector.multi import MultiConnector, MultiKVConnectorMetadata
from rdma_kv.connector.specs import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from rdma_kv.connector.state import (
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
    has_kv_transfer_group,
    is_v1_kv_transfer_group,
    reset_kv_transfer_state,
)
from rdma_kv.connector.storage import StorageConnector
from rdma_kv.connector.types import (
    BlockId,
    CachedRequestData,
    EngineId,
    KVCacheBlocks,
    KVConnectorOutput,
    NewRequestData,
    Request,
    RequestId,
    SchedulerOutput,
)

__all__ = [
    "AttentionSpec",
    "BlockId",
    "CachedRequestData",
    "EngineId",
    "FullAttentionSpec",
    "KVBufferDevice",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheGeometry",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "KVConnectorBase",
    "KVConnectorFactory",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVLoadFailurePolicy",
    "KVRole",
    "KVTransferConfig",
    "LayerGeometry",
    "Layout",
    "MLAAttentionSpec",
    "MultiConnector",
    "MultiKVConnectorMetadata",
    "NewRequestData",
    "Region",
    "Request",
    "RequestId",
    "SchedulerOutput",
    "Segment",
    "SlidingWindowSpec",
    "StorageConnector",
    "derive_geometry",
    "derive_layer_geometry",
    "ensure_kv_transfer_initialized",
    "ensure_kv_transfer_shutdown",
    "get_kv_transfer_group",
    "has_kv_transfer_group",
    "is_v1_kv_transfer_group",
    "region_bytes",
    "reset_kv_transfer_state",
    "storage_address",
]
