"""Consumer-side records: one load, one producer the consumer reads from.

Owns the stages of a load (:class:`LoadStage`: HANDSHAKE -> READING ->
CONFIRMING -> DONE, or FAILED from any stage), the states of a peer
(:class:`PeerStage`: CONNECTING -> READY or FAILED), and the two records
:class:`~rdma_kv.connector.rdma.consumer.RdmaConsumer` keeps under its
lock. Plain data: no I/O, no locking here.

Imports the standard library and the connector's ``rdma`` data modules
(``meta``, ``planning``, ``stats``, ``transport_api``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable
from typing import Any

from rdma_kv.connector.rdma.meta import LoadSpec, PeerAddress, RemoteLease
from rdma_kv.connector.rdma.planning import SlotTable
from rdma_kv.connector.rdma.stats import LoadMeasures
from rdma_kv.connector.rdma.transport_api import TransferHandle

__all__ = ["PEER_RETRY_S", "LoadStage", "LoadState", "PeerStage", "PeerState", "due_renewals"]

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
    read_resolved: bool = False
    """The transfer completed or failed (or was never posted): no read can land."""
    transfer: TransferHandle | None = None
    error: str | None = None
    renewed_at: float | None = None
    confirm_started: float | None = None
    """``perf_counter()`` when the load entered CONFIRMING (its ``confirm_s`` runs from here)."""
    measures: LoadMeasures = dataclasses.field(default_factory=LoadMeasures)


@dataclasses.dataclass(eq=False)
class PeerState:
    address: PeerAddress
    state: PeerStage = PeerStage.CONNECTING
    name: str | None = None
    slots: SlotTable | None = None
    prep: Any = None
    waiting: list[LoadState] = dataclasses.field(default_factory=list)
    error: str | None = None
    failed_at: float = 0.0
    handshake_s: float = 0.0


def due_renewals(loads: Iterable[LoadState], now: float,
                 interval_for: Callable[[float], float]) -> list[RemoteLease]:
    """Leases to renew now, marked renewed: a load's first renewal (which
    also claims its lease) goes out at the first step after it starts, later
    ones every ``interval_for(its lease TTL)``."""
    due = []
    for load in loads:
        if not load.stage.terminal and (
                load.renewed_at is None or now - load.renewed_at >= interval_for(load.spec.lease_ttl_s)):
            load.renewed_at = now
            due.append(load.spec.remote_lease)
    return due
