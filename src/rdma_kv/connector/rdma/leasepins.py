"""The pins on the producer's live leases: what keeps a lease alive past the
ends its table would otherwise give it.

Read pins (PIN at post, protocol 7). A RENEW with ``pin`` is a renewal
that also *pins* each lease it answers HELD: until it is released or its
``pinned_until`` (at most ``pin_s`` after the answer, never past its expiry
and so never past the lifetime bound), neither reclaim nor sleep ends it
(``reclaim`` marks it, and it ends as RECLAIMED when its pin does,
whatever its renewals, and is not pinned again; ``RdmaProducer.suspend`` waits for it,
``pinned_for``), and expiry cannot (its expiry is at least as late). HELD
to a pin thus says the blocks were held from the grant until the answer
*and* will be until ``pinned_until``: a consumer that sent the pin before
posting its reads, and saw them land within the time granted from sending
it, read blocks no one reused and needs no CONFIRM.

Push pins (``LeaseTable.pin_for_push``). The producer writes from a lease's
blocks: no expiry, lifetime bound or reclaim ends the lease until the push
resolves (``unpin``); a release of its last reader meanwhile ends it at the
last unpin. They are counted: the decode ranks of a larger TP each push
from one lease at once, and with one pin per lease the first to resolve
left the others' writes unprotected (a reclaim or the lifetime bound ended
the lease and its blocks were reused under them: found by an adversarial
review). A push pin lasts at most one write's timeout (``pusher``).

:class:`Pins` keeps both for one ``leases.LeaseTable``, which owns it and
calls it under its lock (it is not thread-safe).

Imports the standard library and the connector's ``rdma.leaserecords``.
"""

from __future__ import annotations

import collections

from rdma_kv.connector.rdma.leaserecords import Lease

__all__ = ["Pins"]


class Pins:
    """The read pins' gate and deferred reclaims, and the push pins' counts,
    of one lease table's leases (by generation)."""

    def __init__(self) -> None:
        self.open = True
        """Whether read pins are granted (closed while the producer goes to sleep)."""
        self._reclaim_at_end: set[int] = set()  # reclaimed while a read pin held them
        self._pushes = collections.Counter[int]()  # generation -> pushes writing from it

    # --- read pins ------------------------------------------------------------------

    def read_pin(self, lease: Lease, now: float, pin_s: float) -> float | None:
        """Pin ``lease`` until ``min(now + pin_s, its expiry)``; the seconds
        granted from ``now``. None when it is not pinned now: pins are
        closed, or a reclaim waits for its earlier pin to end."""
        if not self.open or lease.ref.generation in self._reclaim_at_end:
            return None
        until = min(now + pin_s, lease.expires_at)  # the TTL, and the lifetime bound
        lease.pinned_until = max(lease.pinned_until, until)
        return max(0.0, until - now)

    def reclaim_after_pin(self, generation: int) -> bool:
        """Lease ``generation``, reclaimed while a read pin holds it, ends when
        the pin does; False if it was marked so already."""
        if generation in self._reclaim_at_end:
            return False
        self._reclaim_at_end.add(generation)
        return True

    def reclaim_due(self, lease: Lease, now: float) -> bool:
        """Whether ``lease`` was reclaimed under a read pin that has ended by ``now``."""
        return lease.ref.generation in self._reclaim_at_end and lease.pinned_until <= now

    def ended(self, generation: int) -> None:
        """Lease ``generation`` ended: no reclaim waits for its pin any more."""
        self._reclaim_at_end.discard(generation)

    # --- push pins --------------------------------------------------------------------

    def push(self, generation: int) -> None:
        """A push writes from lease ``generation``."""
        self._pushes[generation] += 1

    def unpush(self, generation: int) -> bool:
        """A push from lease ``generation`` resolved; True when it was the last."""
        left = self._pushes[generation] - 1
        if left > 0:
            self._pushes[generation] = left
            return False
        self._pushes.pop(generation, None)
        return True

    def pushing(self, generation: int) -> bool:
        """Whether a push writes from lease ``generation``."""
        return generation in self._pushes
