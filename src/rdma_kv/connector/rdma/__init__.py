"""The RDMA KV connector: disaggregated prefill -> decode over one-sided UCX reads.

Modules, by role (each docstring says what it owns and may import):

- entry: ``connector`` (``RdmaConnector``, registered as ``RdmaKVConnector``,
  and ``agent_transport``, the one place the real transport is built),
  ``scheduler`` (both roles' scheduler side), ``worker`` (registration, then
  routes each step to the producer and consumer parts and merges their
  reports).
- consumer (the read path): ``consumer`` (peers and handshakes, planning
  and posting the reads, completion, validate-after-read, renewals,
  releases: where a load fails), with its helpers ``loads`` (load and peer
  records, their stage enums), ``clients`` (side-channel clients per
  producer address), ``lease_rpc`` (RENEW/RELEASE batches and refusal
  reasons) and ``lograte`` (rate-limited warnings, also used by the side
  channel).
- producer: ``producer`` (the side-channel handler, starting and stopping
  the server, the lease table's owner) and ``leases`` (the lease table and
  its expiry: where a lease expires).
- shared records and plumbing: ``params`` (typed kv_transfer_params),
  ``settings`` (extra config), ``meta`` (step and handshake metadata),
  ``planning`` (block ids to descriptor indices, compatibility record),
  ``wire`` (side-channel messages), ``sidechannel`` (server and client),
  ``admission`` (the side channel's connection limits), ``auth`` (the
  shared secret), ``transport_api`` (the transport Protocol), ``stats``
  (per-load records and their summary) and ``metrics`` (histograms and
  Prometheus series from those records).

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
