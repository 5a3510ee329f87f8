"""Consumer-side state of one load and of one producer the worker reads from.

Owns the stage names of a load (HANDSHAKE -> READING -> CONFIRMING -> DONE,
or FAILED from any stage) and the two records ``RdmaWorker`` keeps under
its lock. Plain data: no I/O, no locking here.

Imports the standard library and the connector's ``rdma`` data modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from rdma_kv.connector.rdma.meta import LoadSpec, PeerAddress, RemoteLease
from rdma_kv.connector.rdma.planning import SlotTable
from rdma_kv.connector.rdma.transport_api import TransferHandle

__all__ = ["CONFIRMING", "DONE", "FAILED", "HANDSHAKE", "PEER_RETRY_S", "READING", "LoadState", "PeerState",
           "due_renewals"]

HANDSHAKE, READING, CONFIRMING, DONE, FAILED = "handshake", "reading", "confirming", "done", "failed"
PEER_RETRY_S = 1.0  # a peer whose handshake or reads failed is not dialled again for this long


@dataclasses.dataclass(eq=False)
class LoadState:
    spec: LoadSpec
    deadline: float
    created: float
    stage: str = HANDSHAKE
    aborted: bool = False
    read_resolved: bool = False
    """The transfer completed or failed (or was never posted): no read can land."""
    transfer: TransferHandle | None = None
    error: str | None = None
    renewed_at: float | None = None
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(eq=False)
class PeerState:
    address: PeerAddress
    state: str = "connecting"  # connecting -> ready | failed
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
        if load.stage in (HANDSHAKE, READING, CONFIRMING) and (
                load.renewed_at is None or now - load.renewed_at >= interval_for(load.spec.lease_ttl_s)):
            load.renewed_at = now
            due.append(load.spec.remote_lease)
    return due
