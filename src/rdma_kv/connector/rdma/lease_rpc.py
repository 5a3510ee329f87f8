"""Consumer-side lease RPCs to producers: RENEW while a load waits, RELEASE
when it is done or abandoned.

Owns batching (per producer, at most ``wire.MAX_LEASES_PER_MESSAGE`` leases
a message), submission to the worker's RPC thread pool, and the call itself.
A failed RPC is logged at DEBUG and dropped: the producer's lease then
expires on its own, which is the design, not an error. What to do with a
lease the producer no longer holds is the worker's decision (it is told
which requests' leases are gone).

Imports the standard library and the connector's ``rdma`` wire/meta/params
modules.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from collections.abc import Callable, Iterable

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.meta import PeerAddress, RemoteLease
from rdma_kv.connector.rdma.params import LeaseRef
from rdma_kv.connector.rdma.sidechannel import SideChannelClient

__all__ = ["call_lease_rpc", "submit_lease_rpcs"]

logger = logging.getLogger(__name__)


def submit_lease_rpcs(executor: concurrent.futures.Executor,
                      call: Callable[[type, PeerAddress, list[LeaseRef]], None],
                      kind: type, leases: Iterable[RemoteLease]) -> None:
    """Group ``leases`` by producer and submit ``call(kind, address, chunk)``."""
    by_peer: dict[PeerAddress, list[LeaseRef]] = collections.defaultdict(list)
    for item in leases:
        by_peer[item.peer].append(item.lease)
    for address, refs in by_peer.items():
        for start in range(0, len(refs), wire.MAX_LEASES_PER_MESSAGE):
            try:
                executor.submit(call, kind, address, refs[start:start + wire.MAX_LEASES_PER_MESSAGE])
            except RuntimeError:  # executor shut down: the worker is closing
                return


def call_lease_rpc(client: SideChannelClient, kind: type, address: PeerAddress,
                   refs: list[LeaseRef]) -> set[str] | None:
    """One RENEW or RELEASE; the request ids whose lease is gone (RENEW), or
    None if the call failed (logged; the leases expire on their own)."""
    try:
        reply = client.lease_call(kind(wire.PROTOCOL_VERSION, [wire.LeaseWire.of(r) for r in refs]))
    except Exception as exc:
        logger.debug("%s of %d lease(s) with %r failed (the leases expire on their own): %s",
                     kind.__name__, len(refs), address.engine_id, exc)
        return None
    if kind is not wire.Renew:
        return set()
    return {r.request_id for r, s in zip(refs, reply.statuses) if s is wire.LeaseStatus.GONE}
