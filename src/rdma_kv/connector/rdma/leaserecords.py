"""The records of the producer's lease table: a call naming a lease, a live lease, its owner's claim, how a lease ended, and what an ended one leaves behind.

Data only, with the small predicates that read them (whether a call is the
owner's, whether every reader released, whether a tombstone recognises a
retried CONFIRM); the state machine that changes them is ``leases``.

Imports the standard library and the connector's ``params``, ``types``
and ``rdma.wire`` (the reader bounds).
"""

from __future__ import annotations

import dataclasses
import enum

from rdma_kv.connector.rdma.params import LeaseRef
from rdma_kv.connector.rdma.wire import check_reader
from rdma_kv.connector.types import GroupBlockIds

__all__ = ["Claim", "Ending", "Lease", "LeaseCall", "Tombstone"]


@dataclasses.dataclass(frozen=True)
class LeaseCall:
    """One lease named in a RENEW, CONFIRM or RELEASE, with the caller's
    claim, the consumer rank making the call (``reader``) and how many
    consumer ranks read this producer rank under the lease (``readers``)."""

    ref: LeaseRef
    claim: bytes = dataclasses.field(repr=False)
    reader: int = 0
    readers: int = 1

    def __post_init__(self) -> None:
        check_reader(self.reader, self.readers)


class Ending(enum.Enum):
    RELEASED = "released"
    EXPIRED = "expired"
    EPOCH = "epoch"
    LIFETIME = "lifetime"
    """Reached ``max_s`` after its grant, renewed or not."""
    SLEEP = "sleep"
    """The producer's KV cache was unregistered (vLLM sleep mode)."""
    RECLAIMED = "reclaimed"
    """Ended by the producer's scheduler to free blocks for new prefills."""


@dataclasses.dataclass
class Claim:
    """A lease's owner: the first valid call's claim and reader count, and
    which of its readers released the lease. Also the whole record of a
    claim on a lease issued but not yet shipped here."""

    owner: bytes = dataclasses.field(repr=False)
    readers: int = 1
    released: set[int] = dataclasses.field(default_factory=set)
    """Readers that released (RELEASE, or CONFIRM with ``release``)."""
    confirmed: set[int] = dataclasses.field(default_factory=set)
    """Of those, the readers whose CONFIRM with ``release`` answered HELD."""

    def admits(self, call: LeaseCall) -> bool:
        return call.claim == self.owner and call.readers == self.readers

    def release(self, reader: int, confirmed: bool) -> None:
        self.released.add(reader)
        if confirmed:
            self.confirmed.add(reader)

    @property
    def all_released(self) -> bool:
        return len(self.released) >= self.readers

    def copy(self) -> Claim:
        return dataclasses.replace(self, released=set(self.released), confirmed=set(self.confirmed))


@dataclasses.dataclass
class Lease:
    ref: LeaseRef
    block_ids: GroupBlockIds
    """Per KV-cache group (one group: ``((ids...),)``)."""
    ttl_s: float
    expires_at: float
    granted_at: float
    ends_at: float
    """``granted_at + max_s``: no renewal reaches past it."""
    claim: Claim | None = None
    renewals: int = 0
    pinned_until: float = 0.0
    """A read pin's end (``LeaseTable.pin``): until then nothing but its
    release ends the lease."""

    @property
    def owner(self) -> bytes | None:
        return None if self.claim is None else self.claim.owner


@dataclasses.dataclass(frozen=True)
class Tombstone:
    how: Ending
    owner: bytes | None = dataclasses.field(default=None, repr=False)
    readers: int = 1
    confirmed: frozenset[int] = frozenset()
    """The owner's readers whose CONFIRM released the lease while it lived:
    their retries read HELD."""

    def recognises(self, call: LeaseCall) -> bool:
        return (self.owner is not None and call.claim == self.owner and call.readers == self.readers
                and call.reader in self.confirmed)
