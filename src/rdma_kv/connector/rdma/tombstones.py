"""The lease table's memory of ended leases: one tombstone per generation,
bounded.

A tombstone remembers how a lease ended, its owner's claim and reader count,
and the readers whose CONFIRM released it while it lived (their retries read
HELD: ``leaserecords.Tombstone.recognises``). The memory is bounded twice:
at most :data:`MAX_TOMBSTONES` leases, and :data:`MAX_TOMBSTONE_READERS`
releasing readers across them; past either, the oldest are forgotten. A
forgotten lease is GONE to everyone, as one never remembered would be (the
table answers GONE to any generation it has seen and holds no more).

:class:`Tombstones` is owned by ``leases.LeaseTable`` and called under its
lock (it is not thread-safe).

Imports the standard library and the connector's ``rdma.leaserecords``.
"""

from __future__ import annotations

import collections
from collections.abc import ItemsView

from rdma_kv.connector.rdma.leaserecords import Claim, Ending, Tombstone

__all__ = ["MAX_TOMBSTONES", "MAX_TOMBSTONE_READERS", "Tombstones"]

MAX_TOMBSTONES = 1 << 16
"""Ended leases remembered (a few hundred bytes each). A forgotten one is GONE
to everyone, its owner's retried CONFIRM included: a load error, never a lie."""
MAX_TOMBSTONE_READERS = 1 << 18
"""Releasing readers remembered across all tombstones: with many readers per
lease, fewer leases are remembered (``readers`` may reach 1024)."""


class Tombstones:
    """Ended leases by generation, oldest first."""

    def __init__(self) -> None:
        self._ended = collections.OrderedDict[int, Tombstone]()
        self._readers = 0  # sum of len(tombstone.confirmed)

    def bury(self, generation: int, how: Ending, claim: Claim | None) -> None:
        """Remember that lease ``generation`` ended ``how``, owned by ``claim``
        (None: no one claimed it); forget the oldest past the bounds."""
        if claim is None:
            tomb = Tombstone(how)
        else:
            tomb = Tombstone(how, claim.owner, claim.readers, frozenset(claim.confirmed))
        self._ended[generation] = tomb
        self._readers += len(tomb.confirmed)
        while len(self._ended) > MAX_TOMBSTONES or self._readers > MAX_TOMBSTONE_READERS:
            _, old = self._ended.popitem(last=False)
            self._readers -= len(old.confirmed)

    def get(self, generation: int) -> Tombstone | None:
        return self._ended.get(generation)

    def __contains__(self, generation: int) -> bool:
        return generation in self._ended

    def items(self) -> ItemsView[int, Tombstone]:
        return self._ended.items()

    def clear(self) -> None:
        self._ended.clear()
        self._readers = 0
