"""Trust earned by a lease, for a side channel without a shared secret.

A helper of :class:`~rdma_kv.connector.rdma.sidechannel.SideChannelServer`.
Without a secret, a connection is trusted only while it has proven that it
holds a live lease: a lease call answered HELD for a lease the producer's
table holds (never PENDING). Owns, per connection, the last leases it
proved (at most ``MAX_PROOFS``) and the one its trust counts against (its
*voucher*), and per lease how many connections it vouches for: at most
``LEASE_VOUCHES``, so a holder of one params set gets no more than that
many trusted connections. When the voucher ends, another proven live lease
with vouches left takes over, or the connection's trust lapses (the server
then gives it a new opening deadline; its next lease call answered HELD
makes it trusted again).

Every look at the lease table is one call of ``live`` for a batch (the
table's lock taken once): one for every voucher at a check, one per
connection whose voucher ended. A proof found dead is forgotten at once,
so no check looks at it again.

Single-threaded: only the side channel's event loop calls it. Imports the
standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable
from typing import Generic, TypeVar

__all__ = ["LEASE_VOUCHES", "MAX_PROOFS", "LeaseTrust"]

LeaseKey = tuple[int, int]  # (epoch, generation)
Conn = TypeVar("Conn", bound=Hashable)

LEASE_VOUCHES = 32
"""Connections one lease can make trusted: a consumer engine's ranks that
read this producer rank under it, with room to spare."""
MAX_PROOFS = 16
"""Leases remembered per connection: the last it proved (past it, the oldest
are forgotten). Only a successor to the voucher is looked for among them,
and a consumer proves its live leases again at every renewal; a connection
whose voucher ended with none of them live has lost nothing it cannot
prove again at its next lease call."""


class LeaseTrust(Generic[Conn]):
    """``live(leases)``: which of these leases are live (the lease table, one
    look for the batch)."""

    def __init__(self, live: Callable[[Iterable[LeaseKey]], Collection[LeaseKey]],
                 vouches: int = LEASE_VOUCHES) -> None:
        self._live = live
        self._max_vouches = vouches
        self._proofs: dict[Conn, dict[LeaseKey, None]] = {}  # an ordered set each: last proven last
        self._voucher: dict[Conn, LeaseKey] = {}  # the trusted connections, and their voucher
        self._vouches: dict[LeaseKey, int] = {}

    def __contains__(self, conn: Conn) -> bool:
        """Whether ``conn`` is trusted through a lease."""
        return conn in self._voucher

    def proofs(self, conn: Conn) -> int:
        """How many leases ``conn`` proved are remembered."""
        return len(self._proofs.get(conn, ()))

    def prove(self, conn: Conn, held: set[LeaseKey]) -> bool:
        """``conn``'s lease call was answered HELD for ``held``; True when
        that makes it trusted now (a live one of them has vouches left)."""
        proofs = self._proofs.setdefault(conn, {})
        for lease in held:
            proofs.pop(lease, None)
            proofs[lease] = None
        made = conn not in self._voucher and self._vouch(conn)  # among all of them, before the cut
        for lease in list(proofs)[:max(0, len(proofs) - MAX_PROOFS)]:
            del proofs[lease]
        return made

    def lapsed(self) -> list[Conn]:
        """The connections whose voucher ended and that proved no other live
        lease with vouches left: no longer trusted (forgotten here)."""
        if not self._voucher:
            return []
        live = self._live(set(self._voucher.values()))
        out = []
        for conn, lease in list(self._voucher.items()):
            if lease in live:
                continue
            self._proofs.get(conn, {}).pop(lease, None)
            if not self._vouch(conn):
                self.forget(conn)
                out.append(conn)
        return out

    def forget(self, conn: Conn) -> None:
        """``conn`` closed, or its trust lapsed."""
        self._proofs.pop(conn, None)
        self._unvouch(conn)

    def _vouch(self, conn: Conn) -> bool:
        """Make the last proven live lease of ``conn`` with vouches left its
        voucher; forget the proofs found dead."""
        proofs = self._proofs.get(conn)
        if not proofs:
            return False
        candidates = [lease for lease in proofs if self._vouches.get(lease, 0) < self._max_vouches]
        if not candidates:
            return False
        live = self._live(candidates)
        for lease in candidates:
            if lease not in live:
                del proofs[lease]  # dead for good: never looked at again
        for lease in reversed(candidates):
            if lease in live:
                self._unvouch(conn)
                self._voucher[conn] = lease
                self._vouches[lease] = self._vouches.get(lease, 0) + 1
                return True
        return False

    def _unvouch(self, conn: Conn) -> None:
        lease = self._voucher.pop(conn, None)
        if lease is not None:
            self._vouches[lease] -= 1
            if not self._vouches[lease]:
                del self._vouches[lease]
