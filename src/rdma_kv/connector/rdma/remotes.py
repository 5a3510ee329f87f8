"""The RDMA connector's scheduler, consumer side: its record of a request
with remote-prefill params (``Remote``) from admission until it finishes,
its stage (``RemoteStage``), and the push-mode decode whose prefill runs at
the same time (``Concurrent``: no lease, a router's transfer id).

Imports the standard library and the connector's ``rdma.meta``,
``rdma.params`` and ``rdma.wire``.
"""

from __future__ import annotations

import dataclasses
import enum
import secrets

from rdma_kv.connector.rdma.meta import PeerAddress, RemoteLease
from rdma_kv.connector.rdma.params import RemotePrefillParams
from rdma_kv.connector.rdma.wire import CLAIM_BYTES

__all__ = ["Concurrent", "Remote", "RemoteStage"]


class RemoteStage(enum.Enum):
    """Where a consumer request with remote-prefill params is:
    WAITING -> PENDING -> SHIPPED -> LOADED, or RELEASED from WAITING or PENDING."""

    WAITING = "waiting"  # waits for admission (its lease renewed by the workers)
    PENDING = "pending"  # blocks allocated, its load queued for the next step's metadata
    SHIPPED = "shipped"  # its load handed to the workers
    LOADED = "loaded"  # the workers reported it in done_recving
    RELEASED = "released"  # nothing to load (full hit, bad params, abort): its lease released


@dataclasses.dataclass
class Concurrent:
    """Push mode, concurrent dispatch: a decode whose prefill runs at the
    same time (no lease: the producer pushes under ``transfer_id``)."""

    transfer_id: str
    peer: PeerAddress


@dataclasses.dataclass
class Remote:
    """A consumer request with remote-prefill params, until it finishes."""

    params: RemotePrefillParams | Concurrent
    num_computed: int = 0
    count: int = 0
    stage: RemoteStage = RemoteStage.WAITING
    claim: bytes = dataclasses.field(default_factory=lambda: secrets.token_bytes(CLAIM_BYTES), repr=False)
    """This request's claim on the producer's lease: the same in every lease
    call made for it, so the producer can tell this request from another
    load of the same params (``leases``)."""
    renewed_at: float | None = None
    """When its lease was last renewed while waiting (None: not yet; the first
    renewal, which also claims the lease, goes out with the next step)."""

    @property
    def concurrent(self) -> Concurrent | None:
        return self.params if isinstance(self.params, Concurrent) else None

    @property
    def lease(self) -> RemoteLease | None:
        """The lease to renew or release; None for a concurrent push (none exists)."""
        if isinstance(self.params, Concurrent):
            return None
        return RemoteLease(PeerAddress.of(self.params), self.params.lease, self.claim)
