"""What the side-channel server dispatches to, and what it does with a lease answer.

A helper of :class:`~rdma_kv.connector.rdma.sidechannel.SideChannelServer`.
Owns :class:`Handler` and :class:`PushHandler` (the Protocols the producer's
``ProducerHandler`` implements: handshake, lease calls, push mode's requests)
and :class:`LeaseReplies`, the server's reading of a handler's answer to a
lease call (RENEW, CONFIRM, RELEASE): leases answered FORGED or UNKNOWN are
counted and logged, rate-limited; without a shared secret, a lease answered
HELD is the proof by which a connection earns trust (``sidetrust``).

Single-threaded: only the side channel's event loop calls
:class:`LeaseReplies`. Imports the standard library and the connector's
``rdma.lograte``, ``rdma.sideconn`` (a connection's record, the server's
counters), ``rdma.sidetrust``, ``rdma.stats`` and ``rdma.wire``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Protocol

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.lograte import EventSummary
from rdma_kv.connector.rdma.sideconn import Accepted, SideChannelCounters
from rdma_kv.connector.rdma.sidetrust import LeaseTrust
from rdma_kv.connector.rdma.stats import Tally

__all__ = ["Handler", "LeaseReplies", "PushHandler"]


class Handler(Protocol):
    """What the server dispatches to (the worker implements it)."""

    def on_handshake(self, request: wire.Handshake) -> wire.HandshakeReply | wire.Refused: ...

    def on_renew(self, request: wire.Renew) -> wire.LeaseReply: ...

    def on_confirm(self, request: wire.Confirm) -> wire.LeaseReply: ...

    def on_release(self, request: wire.Release) -> wire.LeaseReply: ...

    def live(self, leases: Iterable[tuple[int, int]]) -> Collection[tuple[int, int]]:
        """Which of these (epoch, generation) leases are live: one look at the
        lease table for the batch (its lock taken once)."""
        ...


class PushHandler(Handler, Protocol):
    """A handler that also takes push mode's requests (``producer.ProducerHandler``)."""

    def on_push_hello(self, request: wire.PushHello) -> wire.PushReply: ...

    def on_push(self, request: wire.Push) -> wire.PushReply: ...

    def on_push_reg(self, request: wire.PushReg) -> wire.PushReply: ...

    def on_push_query(self, request: wire.PushQuery) -> wire.PushReply: ...


class LeaseReplies:
    """The server ``name``'s reading of lease answers, counted into
    ``counts`` and logged through ``events`` (the server's own, so its
    lines keep the server's logger and rate limit). ``lease_trust`` is the
    server's table of trust earned by a lease; ``None`` with a shared
    secret, where trust comes from AUTH only."""

    def __init__(self, name: str, counts: Tally[SideChannelCounters], events: EventSummary,
                 lease_trust: LeaseTrust[Accepted] | None) -> None:
        self._name = name
        self._counts = counts
        self._events = events
        self._lease_trust = lease_trust

    def earns_trust(self, conn: Accepted, request: wire.Renew | wire.Confirm | wire.Release,
                    reply: wire.LeaseReply) -> bool:
        """Count and log what ``reply`` refused; whether ``conn``, not yet
        trusted, has just earned trust by it."""
        forged = sum(status is wire.LeaseStatus.FORGED for status in reply.statuses)
        unknown = sum(status is wire.LeaseStatus.UNKNOWN for status in reply.statuses)
        if forged:
            self._counts.add("forged", forged)
            self._events.event("forged", conn.source, "side channel %s: %s presented %d lease(s) with "
                               "kv_transfer_params altered to name blocks the lease does not cover "
                               "(answered FORGED; nothing was read under them that will be used)",
                               self._name, conn.addr, forged)
        if unknown:
            self._counts.add("unknown", unknown)
            self._events.event("unknown", conn.source, "side channel %s: %s presented %d lease(s) whose "
                               "token does not verify: kv_transfer_params altered (other blocks, or a "
                               "lease not yet shipped to this worker), or another producer's (answered "
                               "UNKNOWN; nothing recorded)", self._name, conn.addr, unknown)
        if self._lease_trust is None:
            return False
        # Without a secret, trust is earned by proof only: a lease this
        # producer granted and still holds (never PENDING), and only while it lives.
        held = {(lease.epoch, lease.generation) for lease, status in zip(request.leases, reply.statuses)
                if status is wire.LeaseStatus.HELD}
        return bool(held) and self._lease_trust.prove(conn, held) and not conn.trusted
