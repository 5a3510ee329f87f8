"""Trust earned by a lease, for a side channel without a shared secret.

A helper of :class:`~rdma_kv.connector.rdma.sidechannel.SideChannelServer`.
Without a secret, a connection is trusted only while it has proven that it
holds a live lease: a lease call answered HELD for a lease the producer's
table holds (never PENDING). Owns, per connection, the leases it proved
and the one its trust counts against (its *voucher*), and per lease how many
connections it vouches for: at most ``LEASE_VOUCHES``, so a holder of one
params set gets no more than that many trusted connections. When the
voucher ends, another proven live lease with vouches left takes over, or
the connection's trust lapses (the server then gives it a new opening
deadline).

Single-threaded: only the side channel's event loop calls it. Imports the
standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Generic, TypeVar

__all__ = ["LEASE_VOUCHES", "MAX_PROOFS", "LeaseTrust"]

LeaseKey = tuple[int, int]  # (epoch, generation)
Conn = TypeVar("Conn", bound=Hashable)

LEASE_VOUCHES = 32
"""Connections one lease can make trusted: a consumer engine's ranks that
read this producer rank under it, with room to spare."""
MAX_PROOFS = 4096
"""Leases remembered per connection (past it, only the ones just proven)."""


class LeaseTrust(Generic[Conn]):
    """``holds(leases)``: whether any of these leases is live (the lease table)."""

    def __init__(self, holds: Callable[[Iterable[LeaseKey]], bool], vouches: int = LEASE_VOUCHES) -> None:
        self._holds = holds
        self._max_vouches = vouches
        self._proofs: dict[Conn, set[LeaseKey]] = {}
        self._voucher: dict[Conn, LeaseKey] = {}  # the trusted connections, and their voucher
        self._vouches: dict[LeaseKey, int] = {}

    def __contains__(self, conn: Conn) -> bool:
        """Whether ``conn`` is trusted through a lease."""
        return conn in self._voucher

    def prove(self, conn: Conn, held: set[LeaseKey]) -> bool:
        """``conn``'s lease call was answered HELD for ``held``; True when
        that makes it trusted now (a live one of them has vouches left)."""
        proofs = self._proofs.setdefault(conn, set())
        proofs |= held
        if len(proofs) > MAX_PROOFS:
            self._proofs[conn] = set(held)
        return conn not in self._voucher and self._vouch(conn)

    def lapsed(self) -> list[Conn]:
        """The connections whose voucher ended and that proved no other live
        lease with vouches left: no longer trusted (forgotten here)."""
        out = []
        for conn, lease in list(self._voucher.items()):
            if self._holds((lease,)):
                continue
            self._proofs.get(conn, set()).discard(lease)
            if not self._vouch(conn):
                self.forget(conn)
                out.append(conn)
        return out

    def forget(self, conn: Conn) -> None:
        """``conn`` closed, or its trust lapsed."""
        self._proofs.pop(conn, None)
        self._unvouch(conn)

    def _vouch(self, conn: Conn) -> bool:
        for lease in self._proofs.get(conn, ()):
            if self._vouches.get(lease, 0) < self._max_vouches and self._holds((lease,)):
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
