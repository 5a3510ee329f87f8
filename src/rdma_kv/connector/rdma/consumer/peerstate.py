"""The consumer's records of its peers: this rank's registered KV cache
(:class:`LocalKV`), what a handshake with one producer rank gave
(:class:`Connection`) and one dialling of a producer rank
(:class:`PeerState`), which ``peers.PeerDirectory`` owns and changes under
the consumer's lock.

Imports the standard library and the connector's ``geometry`` and ``rdma``
modules ``wire``, ``meta``, ``slots``, ``transport_api`` and the consumer's
``records``.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import Any

from rdma_kv.connector.geometry import KVCacheGeometry
from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.records import LoadState, Source
from rdma_kv.connector.rdma.meta import PeerAddress, agent_name
from rdma_kv.connector.rdma.slots import HeadSlice, SlotTable
from rdma_kv.connector.rdma.transport_api import Transport

__all__ = ["Connection", "LocalKV", "PeerKey", "PeerStage", "PeerState", "Table", "Waiter"]

Table = tuple[SlotTable, Any]
"""A slot table and its prepared descriptor list (the transport's handle)."""
Waiter = tuple[LoadState, Source]
PeerKey = tuple[str, str, int]  # engine id, side-channel host, the producer rank's port
_SERIALS = itertools.count(1)  # PeerState.serial (next() on a count is atomic under the GIL)


@dataclasses.dataclass(frozen=True, eq=False)
class LocalKV:
    """This rank's KV cache, registered with ``transport``: what reads land in."""

    transport: Transport
    geometry: KVCacheGeometry
    slots: SlotTable
    """Whole blocks, every layer."""
    prepared: Any
    """``slots.descs`` prepared with ``transport`` (``prep_local``)."""
    compat: wire.CompatInfo
    rank: wire.RankInfo
    group_heads: tuple[int, ...] = ()
    """KV heads per rank of each KV-cache group (1 for MLA): ``plan`` checks them."""


class PeerStage(enum.Enum):
    CONNECTING = "connecting"  # handshake in flight; loads wait in PeerState.waiting
    READY = "ready"  # agent metadata imported
    FAILED = "failed"  # not dialled again for peers.PEER_RETRY_S
    STALLED = "stalled"  # handshake not answered by a producer known live: loads wait, dialled again (redial)


@dataclasses.dataclass(eq=False)
class Connection:
    """What a handshake with one producer rank gave this consumer rank."""

    name: str
    """The peer's name in the transport (its agent metadata imported)."""
    geometry: KVCacheGeometry
    registration: int
    """The producer's KV-cache registration its metadata is of."""
    handshake_s: float
    tables: dict[HeadSlice | None, Table] = dataclasses.field(default_factory=dict)
    """Its slot tables, per head slice read (None: whole blocks); the directory's."""
    words: wire.RegionWire | None = None
    """The producer rank's held words (``heldwords``), None when it publishes none."""
    words_table: Any = None
    """``words`` prepared with the transport (``words.WordChecks``, on first use)."""
    life: bytes = b""
    """The life of the producer rank's transport it answered from (``wire.PushReply.life``)."""

    def stale_for(self, registration: int, peer: PeerState) -> str | None:
        """Why a load of params issued under ``registration`` must not read
        through this connection (None: it may): the producer re-registered its
        KV cache since the params were issued, or (a registration past this
        one, which a handshake checked: ``PeerDirectory.peer_for``) the params
        name one the producer never had."""
        if registration == self.registration:
            return None
        if registration > self.registration:
            return (f"these kv_transfer_params name registration {registration} of producer "
                    f"{peer.address.engine_id!r} rank {peer.rank}, whose KV cache is at registration "
                    f"{self.registration} (its handshake says so): they are not this producer's params "
                    "(made up, or of another engine at that address); nothing was read")
        return (f"producer {peer.address.engine_id!r} rank {peer.rank} re-registered its KV cache (sleep "
                f"mode: registration {self.registration}) since these kv_transfer_params were issued "
                f"(registration {registration}): the blocks they name are gone; nothing was read")


@dataclasses.dataclass(eq=False)
class PeerState:
    """Producer rank ``rank`` of the engine at ``address``."""

    address: PeerAddress
    rank: int
    state: PeerStage = PeerStage.CONNECTING
    connection: Connection | None = None
    """Set when it became READY (kept once it FAILED after that)."""
    waiting: list[Waiter] = dataclasses.field(default_factory=list)
    error: str | None = None
    failed_at: float = 0.0
    used_at: float = 0.0
    """When a load last found it (or a preconnect asked for it): ``prune``'s idle clock."""
    serial: int = dataclasses.field(default_factory=lambda: next(_SERIALS))
    """This dialling's number: a producer rank dialled again is a new ``PeerState``."""
    stalled_since: float | None = None
    """When the first HANDSHAKE it did not answer began (the directory's
    clock), kept by the dialling after it (:meth:`PeerDirectory.redial`)
    until one is answered; None: none went unanswered."""
    unanswered: int = 0
    """HANDSHAKE calls not answered since ``stalled_since``."""
    replaces: PeerState | None = None
    """The READY peer this dialling checks (``PeerDirectory.peer_for``): a
    load's params named a newer registration than that peer's connection, a
    client's word until this handshake's reply says so. Not in the
    directory until the reply shows the producer re-registered."""
    checking: PeerState | None = None
    """That check of this peer, while in flight: loads naming the newer
    registration wait on it, the others read through this peer meanwhile."""

    @property
    def key(self) -> PeerKey:
        return self.address.rank_key(self.rank)

    @property
    def transport_name(self) -> str:
        """Its name in the transport: the side channel this consumer dialled,
        never the name its metadata gives. Two producers that claim one
        engine id (an operator gave two engines the same ``engine_id``)
        each answer their own handshake; under the metadata's name the
        second replaced the first in the transport, and the first's loads
        then read the second's memory at the first's block ids while the
        first confirmed its leases: wrong KV, accepted.

        Each dialling has its own (``#serial``): a failed peer's transport
        peer is removed after the lock is released, and a thread stalled
        there while a new load dialled the producer again would otherwise
        remove the new handshake's transport peer under the shared name."""
        engine_id, host, port = self.key
        return f"{agent_name(engine_id, self.rank)}@{host}:{port}#{self.serial}"

    def forgotten(self, now: float, retry_s: float) -> bool:
        """FAILED at least ``retry_s`` ago (``peers.PEER_RETRY_S``): the next
        load dials it again (the one retry rule)."""
        return self.state is PeerStage.FAILED and now - self.failed_at >= retry_s
