"""Consumer-side records: one load, its sources, one producer rank the consumer reads from.

Owns the stages of a load (:class:`LoadStage`: HANDSHAKE -> READING ->
CONFIRMING -> DONE, or FAILED from any stage), of each of its sources (one
per producer rank it reads, :class:`SourceStage`: WAITING -> READING ->
CONFIRMING -> CONFIRMED), the states of a peer (:class:`PeerStage`:
CONNECTING -> READY or FAILED), and the records
:class:`~rdma_kv.connector.rdma.consumer.RdmaConsumer` keeps under its
lock. Plain data: no I/O, no locking here.

A load with equal tensor-parallel sizes on both sides has one source; a
consumer rank that owns heads held by several producer ranks has one per
rank (``topology``). A load is CONFIRMING once every source's reads
landed, and DONE once every source was confirmed HELD.

Imports the standard library and the connector's ``rdma`` data modules
(``meta``, ``planning``, ``stats``, ``topology``, ``transport_api``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable
from typing import Any

from rdma_kv.connector.geometry import KVCacheGeometry
from rdma_kv.connector.rdma.meta import LoadSpec, PeerAddress, RemoteLease
from rdma_kv.connector.rdma.planning import HeadSlice, SlotTable
from rdma_kv.connector.rdma.stats import LoadMeasures
from rdma_kv.connector.rdma.topology import Read
from rdma_kv.connector.rdma.transport_api import TransferHandle

__all__ = ["PEER_RETRY_S", "LoadStage", "LoadState", "PeerStage", "PeerState", "Source", "SourceStage",
           "due_renewals"]

PEER_RETRY_S = 1.0  # a peer whose handshake or reads failed is not dialled again for this long


class LoadStage(enum.Enum):
    """Where one load is. A load holds its producer's lease (and renews
    it) in every stage that is not ``terminal``."""

    HANDSHAKE = "handshake"  # waiting for its peer to become ready
    READING = "reading"  # reads posted, the transfer not yet resolved
    CONFIRMING = "confirming"  # reads landed; waiting for the producer's CONFIRM
    DONE = "done"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (LoadStage.DONE, LoadStage.FAILED)


class SourceStage(enum.Enum):
    """Where the part of a load read from one producer rank is."""

    WAITING = "waiting"  # its peer's handshake is in flight
    READING = "reading"  # reads posted, the transfer not yet resolved
    CONFIRMING = "confirming"  # reads landed; CONFIRM(release) queued or sent
    CONFIRMED = "confirmed"  # the producer answered HELD (and released the lease for this reader)


@dataclasses.dataclass(eq=False)
class Source:
    """The part of one load read from producer rank ``read.rank``."""

    read: Read
    readers: int
    """Consumer ranks that call this producer rank for this lease (``topology``)."""
    stage: SourceStage = SourceStage.WAITING
    transfer: TransferHandle | None = None
    resolved: bool = True
    """No read of this source can still land (never posted, completed or failed)."""
    released: bool = False
    """This reader's share of the lease needs no RELEASE any more (sent, confirmed
    with release, or refused by the producer)."""


class PeerStage(enum.Enum):
    CONNECTING = "connecting"  # handshake in flight; loads wait in PeerState.waiting
    READY = "ready"  # agent metadata imported, slot table prepared
    FAILED = "failed"  # not dialled again for PEER_RETRY_S


@dataclasses.dataclass(eq=False)
class LoadState:
    spec: LoadSpec
    deadline: float
    created: float
    stage: LoadStage = LoadStage.HANDSHAKE
    aborted: bool = False
    sources: list[Source] = dataclasses.field(default_factory=list)
    error: str | None = None
    renewed_at: float | None = None
    confirm_started: float | None = None
    """``perf_counter()`` when the load entered CONFIRMING (its ``confirm_s`` runs from here)."""
    measures: LoadMeasures = dataclasses.field(default_factory=LoadMeasures)

    @property
    def read_resolved(self) -> bool:
        """No read of any source can still land in this load's blocks."""
        return all(src.resolved for src in self.sources)

    def on_the_wire(self) -> bool:
        """A posted transfer of this load is not yet resolved by the transport."""
        return any(src.transfer is not None and not src.transfer.done() for src in self.sources)


@dataclasses.dataclass(eq=False)
class PeerState:
    """Producer rank ``rank`` of the engine at ``address``."""

    address: PeerAddress
    rank: int
    state: PeerStage = PeerStage.CONNECTING
    name: str | None = None
    geometry: KVCacheGeometry | None = None
    tables: dict[HeadSlice | None, tuple[SlotTable, Any]] = dataclasses.field(default_factory=dict)
    """Its slot tables, prepared with the transport, per head slice read (None: whole blocks)."""
    waiting: list[tuple[LoadState, Source]] = dataclasses.field(default_factory=list)
    error: str | None = None
    failed_at: float = 0.0
    handshake_s: float = 0.0
    registration: int = 0
    """The producer's KV-cache registration its metadata is of (0: not yet)."""


def due_renewals(loads: Iterable[LoadState], now: float, interval_for: Callable[[float], float],
                 reader: int) -> list[tuple[int, RemoteLease]]:
    """(producer rank, lease) to renew now, the loads marked renewed: a
    load's first renewal (which also claims its lease) goes out at the first
    step after it starts, later ones every ``interval_for(its lease TTL)``;
    to every source not yet released."""
    due: list[tuple[int, RemoteLease]] = []
    for load in loads:
        if not load.stage.terminal and (
                load.renewed_at is None or now - load.renewed_at >= interval_for(load.spec.lease_ttl_s)):
            load.renewed_at = now
            due.extend((src.read.rank, dataclasses.replace(load.spec.remote_lease, reader=reader,
                                                           readers=src.readers))
                       for src in load.sources if not src.released)
    return due
