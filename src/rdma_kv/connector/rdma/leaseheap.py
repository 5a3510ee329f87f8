"""The lease table's reaper queue: a heap of (expiry, generation), soonest first.

The reaper re-checks the live expiry of each entry it pops, so renewals in
any order are handled: the heap never assumes sorted expiries (a renewed
lease's entry is pushed back with its new expiry). A lease that ends before
its entry's expiry leaves the entry behind; the heap is rebuilt from the
live leases whenever it holds more than twice as many entries as live
leases (plus :data:`HEAP_SLACK`), so its size stays O(live leases),
whatever the release rate.

:class:`ExpiryHeap` is owned by ``leases.LeaseTable`` and called under its
lock (it is not thread-safe).

Imports the standard library and the connector's ``rdma.leaserecords``.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from rdma_kv.connector.rdma.leaserecords import Lease

__all__ = ["HEAP_SLACK", "ExpiryHeap"]

HEAP_SLACK = 64
"""Stale heap entries tolerated beyond the live leases before a rebuild."""


class ExpiryHeap:
    """When to look at each lease again, by generation (stale entries included)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []

    def push(self, at: float, generation: int) -> None:
        """Look at lease ``generation`` again at ``at``."""
        heapq.heappush(self._heap, (at, generation))

    def pop_due(self, now: float) -> int | None:
        """The generation of the soonest entry due by ``now``, removed; None when none is due."""
        if not self._heap or self._heap[0][0] > now:
            return None
        return heapq.heappop(self._heap)[1]

    def compact(self, live: Mapping[int, Lease]) -> None:
        """Drop the entries of leases that ended before their expiry, once
        there are too many of them (``live``: the live leases by generation)."""
        if len(self._heap) > 2 * len(live) + HEAP_SLACK:
            self._heap = [(lease.expires_at, gen) for gen, lease in live.items()]
            heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)
