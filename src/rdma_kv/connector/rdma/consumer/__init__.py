"""The consumer part of a worker: reading a prompt's KV blocks from producers.

Modules, each owning one concern (their docstrings say what they own and
may import):

- ``loads``: :class:`RdmaConsumer`, the load state machine (HANDSHAKE ->
  READING -> CONFIRMING -> DONE, or FAILED), aborts, deadlines and where a
  load fails.
- ``peers``: the peer directory: :class:`LocalKV` (what reads land in),
  the rank plan per producer, one peer per producer rank (handshake,
  failure, retry, the registration check) and every slot table.
- ``confirms``: validate-after-read, CONFIRM calls queued, batched per
  peer and retried.
- ``pins``: PIN at post: a source's lease pinned as its reads are posted
  (reads that land within the pin need no CONFIRM), and the RELEASEs
  that follow, batched per peer.
- ``lease_rpc``: RENEW and RELEASE calls, whom they go to, which are due.
- ``records``: a load and its sources, and the :class:`LoadBook` of loads
  the worker reports (it outlives a consumer put to sleep).
- ``clients``: side-channel clients per producer address, and the RPC threads.

Every logger here is under ``rdma_kv.connector.rdma.consumer``: operators
filter the consumer's lines on that name. Nothing here imports the
producer's modules (``producer``, ``leases``, ``leaserecords``, ``sidechannel``,
``sideconn``, ``admission``), nor they these (``tests/test_layering.py``).

Imports only its own modules (re-exporting what the worker builds).
"""

from rdma_kv.connector.rdma.consumer.clients import ClientPool
from rdma_kv.connector.rdma.consumer.loads import RdmaConsumer
from rdma_kv.connector.rdma.consumer.peers import LocalKV
from rdma_kv.connector.rdma.consumer.records import LoadBook

__all__ = ["ClientPool", "LoadBook", "LocalKV", "RdmaConsumer"]
