"""The RDMA KV connector: disaggregated prefill -> decode over one-sided UCX reads.

Modules, each owning one responsibility (see their docstrings):
``params`` (typed kv_transfer_params), ``settings`` (extra config),
``wire`` (side-channel messages), ``sidechannel`` (server and client),
``admission`` (the side channel's connection limits), ``auth`` (the
shared secret), ``lograte`` (rate-limited warnings),
``leases`` (the producer's lease table), ``planning`` (block ids to
descriptor indices, compatibility record), ``meta`` (step metadata),
``transport_api`` (the transport Protocol), ``scheduler``, ``worker`` and
``connector`` (``RdmaConnector``, registered as ``RdmaKVConnector``).

Importing this package does not load UCX: the transport's ``Agent`` is
created when a worker registers its KV caches. Never imports vLLM.
"""

from rdma_kv.connector.rdma.connector import RdmaConnector, agent_transport
from rdma_kv.connector.rdma.meta import RdmaConnectorMetadata, RdmaHandshakeMetadata
from rdma_kv.connector.rdma.params import (
    RemoteDecodeRequest,
    RemotePrefillParams,
    parse_kv_transfer_params,
)
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.transport_api import TransferHandle, Transport

__all__ = [
    "RdmaConnector",
    "RdmaConnectorMetadata",
    "RdmaHandshakeMetadata",
    "RdmaSettings",
    "RemoteDecodeRequest",
    "RemotePrefillParams",
    "TransferHandle",
    "Transport",
    "agent_transport",
    "parse_kv_transfer_params",
]
