"""The producer worker's side-channel handler: what a consumer may ask of it.

HANDSHAKE answers with the agent metadata (worker address, packed remote
keys) and the block geometry -- or a refusal naming both sides' values when
the KV caches are incompatible (model shape, dtype, block size, layout,
tensor parallelism) or the consumer dialled the wrong rank. RENEW, CONFIRM
and RELEASE act on the worker's lease table. Runs on the side channel's
threads; the lease table does its own locking. Authentication happens
before any of this, in ``sidechannel``.

Imports the standard library and the connector's ``rdma`` wire/leases
modules and ``geometry``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rdma_kv.connector.geometry import KVCacheGeometry
from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.leases import LeaseCall, LeaseTable
from rdma_kv.connector.types import EngineId

__all__ = ["ProducerHandler"]

logger = logging.getLogger(__name__)


class ProducerHandler:
    """Implements :class:`~rdma_kv.connector.rdma.sidechannel.Handler`."""

    def __init__(self, engine_id: EngineId, tp_rank: int, lease_ttl_s: float, leases: LeaseTable,
                 compat: wire.CompatInfo, agent_metadata: Callable[[], bytes],
                 geometry: KVCacheGeometry) -> None:
        self._engine_id = engine_id
        self._tp_rank = tp_rank
        self._lease_ttl_s = lease_ttl_s
        self._leases = leases
        self._compat = compat
        self._agent_metadata = agent_metadata
        self._geometry = geometry

    def on_handshake(self, request: wire.Handshake) -> wire.HandshakeReply | wire.Refused:
        compat = self._compat
        if request.compat != compat:
            diff = "; ".join(compat.mismatches(request.compat, mine="producer", theirs="consumer"))
            logger.warning("refused handshake from consumer %r: %s", request.engine_id, diff)
            return wire.Refused(f"incompatible KV caches ({diff}); both engines must run the same "
                                "model, dtype, block size, layout and tensor-parallel size")
        if request.tp_rank != self._tp_rank:
            return wire.Refused(f"consumer rank {request.tp_rank} dialled producer rank "
                                f"{self._tp_rank}; rank r must dial port + r")
        return wire.HandshakeReply(
            wire.PROTOCOL_VERSION, self._engine_id, self._tp_rank, compat, compat.compat_hash(),
            self._agent_metadata(), wire.GeometryWire.from_geometry(self._geometry))

    def on_renew(self, request: wire.Renew) -> wire.LeaseReply:
        return wire.LeaseReply(self._leases.renew(_calls(request)), self._lease_ttl_s)

    def on_confirm(self, request: wire.Confirm) -> wire.LeaseReply:
        return wire.LeaseReply(self._leases.confirm(_calls(request), request.release), self._lease_ttl_s)

    def on_release(self, request: wire.Release) -> wire.LeaseReply:
        return wire.LeaseReply(self._leases.release(_calls(request)), self._lease_ttl_s)


def _calls(request: wire.Renew | wire.Confirm | wire.Release) -> list[LeaseCall]:
    return [LeaseCall(w.ref(), w.claim) for w in request.leases]
