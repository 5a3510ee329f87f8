"""The RDMA KV connector: disaggregated prefill -> decode over one-sided UCX reads.

Modules, by role (each docstring says what it owns and may import):

- entry: ``connector`` (``RdmaConnector``, registered as ``RdmaKVConnector``,
  and ``agent_transport``, the one place the real transport is built),
  ``scheduler`` (both roles' scheduler side), ``worker`` (registration, then
  routes each step to the producer and consumer parts and merges their
  reports).
- consumer (the read path): the package ``consumer`` (``loads``: the load
  state machine, where a load fails; ``peers``: the peer directory,
  handshakes and every slot table; ``confirms``: validate-after-read;
  ``lease_rpc``: RENEW and RELEASE; ``records``: a load's records and the
  book the worker reports from; ``clients``: side-channel clients and the
  RPC threads). Its loggers are all under ``rdma_kv.connector.rdma.consumer``.
- producer: ``producer`` (the side-channel handler, starting and stopping
  the server, the lease table's owner), ``leases`` (the lease table and its
  expiry: where a lease expires; its records are ``leaserecords``, its pins
  ``leasepins``, its memory of ended leases ``tombstones``, its reaper's heap
  ``leaseheap``), ``sidechannel`` (the server),
  ``sidehandler`` (the Protocols it dispatches to, and what a lease answer
  means to it), ``sideconn`` (an accepted connection's record, the server's
  counters), ``sidetrust`` (trust earned by a lease) and ``admission`` (its
  connection limits). The consumer's modules and these
  never import each other (``tests/test_layering.py``).
- shared records and plumbing: ``params`` (typed kv_transfer_params),
  ``settings`` (extra config), ``meta`` (step and handshake metadata),
  ``slots`` (block ids to slot indices), ``compat`` (what two engines must
  agree on), ``topology`` (the rank plan), ``wire`` (side-channel messages),
  ``wiregeom`` (their compatibility record and geometry), ``framing``
  (length-prefixed frames), ``sideclient`` (the side channel's client),
  ``auth`` (the shared secret), ``lograte`` (rate-limited warnings), ``transport_api`` (the transport
  Protocol), ``stats`` (per-load records, each part's counters and their
  summary; ``statsparse`` reads its dict form back) and ``metrics`` (histograms and Prometheus series from those
  records).

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
