"""Consumer-side lease RPCs to producers: RENEW while a load waits, RELEASE
when it is done or abandoned.

A helper of :class:`~rdma_kv.connector.rdma.consumer.RdmaConsumer`. Owns
batching (per producer, at most ``wire.MAX_LEASES_PER_MESSAGE`` leases a
message), submission to the consumer's RPC thread pool, the call itself,
and the wording of a producer's refusal (:func:`refusal_reason`).
A failed RPC is logged at DEBUG and dropped: the producer's lease then
expires on its own, which is the design, not an error. What to do with a
lease the producer no longer holds for this consumer is the consumer's
decision (it is told each refused lease and the producer's answer).

Imports the standard library and the connector's ``rdma`` modules
``wire``, ``meta`` and ``sidechannel``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from collections.abc import Callable, Iterable

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.meta import PeerAddress, RemoteLease
from rdma_kv.connector.rdma.sideclient import SideChannelClient

__all__ = ["REFUSALS", "call_lease_rpc", "refusal_reason", "submit_lease_rpcs"]

logger = logging.getLogger(__name__)


def submit_lease_rpcs(executor: concurrent.futures.Executor,
                      call: Callable[[type, PeerAddress, int, list[RemoteLease]], None],
                      kind: type, leases: Iterable[tuple[int, RemoteLease]]) -> None:
    """Group (producer rank, lease) pairs by producer rank and submit
    ``call(kind, address, rank, chunk)``."""
    by_peer: dict[tuple[PeerAddress, int], list[RemoteLease]] = collections.defaultdict(list)
    for rank, item in leases:
        by_peer[item.peer, rank].append(item)
    for (address, rank), refs in by_peer.items():
        for start in range(0, len(refs), wire.MAX_LEASES_PER_MESSAGE):
            try:
                executor.submit(call, kind, address, rank, refs[start:start + wire.MAX_LEASES_PER_MESSAGE])
            except RuntimeError:  # executor shut down: the worker is closing
                return


REFUSALS = frozenset({wire.LeaseStatus.GONE, wire.LeaseStatus.CLAIMED, wire.LeaseStatus.UNKNOWN,
                      wire.LeaseStatus.FORGED})
"""Answers that mean the producer holds nothing for this consumer under the lease."""


def call_lease_rpc(client: SideChannelClient, kind: type, address: PeerAddress,
                   leases: list[RemoteLease]) -> list[tuple[RemoteLease, wire.LeaseStatus]] | None:
    """One RENEW or RELEASE; the leases the producer refused (GONE, CLAIMED,
    UNKNOWN, FORGED) with its answers, or None if the call failed (logged at DEBUG:
    the leases expire on their own)."""
    try:
        reply = client.lease_call(kind(wire.PROTOCOL_VERSION, [r.to_wire() for r in leases]))
    except Exception as exc:
        logger.debug("%s of %d lease(s) with %r failed (the leases expire on their own): %s",
                     kind.__name__, len(leases), address.engine_id, exc)
        return None
    return [(r, s) for r, s in zip(leases, reply.statuses) if s in REFUSALS]


def refusal_reason(status: wire.LeaseStatus, producer: str, generation: int) -> str:
    """Why a load cannot trust (or start) its reads, for a producer's refusal."""
    if status is wire.LeaseStatus.CLAIMED:
        return (f"producer {producer!r} refused lease {generation}: another consumer claimed it first "
                "(the same kv_transfer_params were loaded twice, e.g. a router retry or a duplicate "
                "request); the blocks belong to that load")
    if status is wire.LeaseStatus.FORGED:
        return (f"producer {producer!r} refused lease {generation}: its token is genuine but the "
                "kv_transfer_params name other blocks (or another request id, token count, engine or "
                "TP size) "
                "than the producer granted: the params were altered after the prefill returned them")
    if status is wire.LeaseStatus.UNKNOWN:
        return (f"producer {producer!r} never granted lease {generation} (its token does not verify): "
                "the kv_transfer_params were altered or come from another producer")
    return (f"producer {producer!r} no longer holds lease {generation} (released or expired): the "
            "blocks may have been reused")
