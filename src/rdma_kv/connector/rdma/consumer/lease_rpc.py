"""A consumer rank's lease calls to producers: RENEW while a load runs or
waits for admission, RELEASE when it ends or is abandoned.

Owns :class:`LeaseCalls`: whom a call goes to (as reader ``tp_rank``, to
every producer rank this rank calls for the lease, each with the number of
consumer ranks that call it, so a producer rank read by several consumer
ranks keeps the blocks until each released), which renewals are due
(``RdmaSettings.renewal_due``, the scheduler's rule too), batching (per
producer rank, in calls the producer accepts: ``wire.lease_chunks``),
the call on the RPC threads, and the wording of a producer's refusal
(:func:`refusal_reason`). A RENEW never waits behind another call: it runs
on the pool's renewal threads, and is ``urgent`` on the client (a second
connection when the first is busy); a slow call holding the producer's
connection would otherwise delay it past its lease's TTL. A failed call is logged at DEBUG and dropped: the
producer's lease then expires on its own, which is the design, not an
error. A refused RENEW fails a load not yet reading at once (one whose
reads are in flight learns the same from its CONFIRM, once no read can land).

Imports the standard library, ``rdma_kv.errors``, the connector's ``rdma``
modules ``meta``, ``settings``, ``sideclient``, ``topology`` and ``wire``, and
the consumer's ``clients`` and ``records``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Collection, Iterable

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.clients import ClientPool
from rdma_kv.connector.rdma.consumer.records import LoadBook, LoadStage, LoadState, Source
from rdma_kv.connector.rdma.meta import PeerAddress, RemoteLease
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.sideclient import SideChannelClient
from rdma_kv.connector.rdma.topology import RankPlan
from rdma_kv.errors import ConfigError, PeerError, PeerTimeout

__all__ = ["MAX_UNPLANNED_RANKS", "REFUSALS", "LeaseCalls", "LeaseKind", "Refused", "Targeted", "call_lease_rpc",
           "refusal_reason"]

logger = logging.getLogger(__name__)

Targeted = tuple[int, RemoteLease]
"""(producer rank, the lease as this reader names it)."""
Refused = list[tuple[RemoteLease, wire.LeaseStatus]]
"""The leases a producer rank refused in one call, with its answers."""
LeaseKind = type[wire.Renew] | type[wire.Release]

MAX_UNPLANNED_RANKS = 8
"""The most producer ranks one consumer rank releases for a lease it has no
rank plan for (the two TP sizes cannot share the model's heads)."""

REFUSALS = frozenset({wire.LeaseStatus.GONE, wire.LeaseStatus.CLAIMED, wire.LeaseStatus.UNKNOWN,
                      wire.LeaseStatus.FORGED})
"""Answers that mean the producer holds nothing for this consumer under the lease."""


TTL_WARNINGS = 256
"""Producer engines warned of a TTL too short for a stalled RENEW: the most
this consumer warns of (the engine id and TTL come from a request's params,
before any handshake, so a client naming engines at will grew the set, and
the log, by one per request)."""


class LeaseCalls:
    """The RENEW and RELEASE calls of consumer rank ``settings.tp_rank``."""

    def __init__(self, settings: RdmaSettings, plan: Callable[[PeerAddress], RankPlan], pool: ClientPool,
                 book: LoadBook, fail: Callable[[LoadState, str], None],
                 confirmed: Callable[[PeerAddress, Collection[int]], bool] | None = None) -> None:
        """``confirmed(address, ranks)``: whether a handshake with one of
        ``ranks`` of the producer at ``address`` confirmed its TP size
        (``PeerDirectory.confirmed``; None: never)."""
        self._settings = settings
        self._reader, self._tp_size = settings.tp_rank, settings.tp_size
        self._plan = plan
        self._confirmed = confirmed or (lambda address, ranks: False)
        self._pool = pool
        self._book = book
        self._fail = fail
        self._ttl_warned: set[str] = set()  # producer engines whose TTL was found too short for a RENEW
        self._renew_worst_s = SideChannelClient.urgent_worst_case_s(
            settings.connect_timeout_s, settings.rpc_timeout_s, settings.rpc_retries)
        """The longest a RENEW to a stalled producer can take (``check_ttl``): fixed by the settings."""

    def check_ttl(self, load: LoadState) -> None:
        """Warn, once per producer engine, when a RENEW that meets a stalled
        producer could still be retrying when the lease expires: its worst
        case (``SideChannelClient.urgent_worst_case_s`` of this consumer's
        ``connect_timeout_s``, ``rpc_timeout_s`` and ``rpc_retries``) is more
        than the lease's margin past the renewal (the TTL the producer set,
        in the params, less ``renew_interval_for`` it). Lock held."""
        ttl, engine = load.spec.lease_ttl_s, load.spec.peer.engine_id
        if load.spec.concurrent or engine in self._ttl_warned or ttl <= 0 or len(self._ttl_warned) >= TTL_WARNINGS:
            return
        s, worst = self._settings, self._renew_worst_s
        margin = ttl - s.renew_interval_for(ttl)
        if worst > margin:
            self._ttl_warned.add(engine)
            logger.warning(
                "producer %r grants leases of %.3g s, renewed every %.3g s: a RENEW to a stalled producer "
                "may take %.3g s (connect_timeout_s=%g + rpc_timeout_s=%g per attempt, rpc_retries=%d), "
                "more than the %.3g s left before expiry, so a lease can lapse under a load that is still "
                "renewing it. Raise the producer's lease_ttl_s, or lower this consumer's rpc_timeout_s, "
                "connect_timeout_s or rpc_retries", engine, ttl, s.renew_interval_for(ttl), worst,
                s.connect_timeout_s, s.rpc_timeout_s, s.rpc_retries, margin)

    def targets(self, lease: RemoteLease) -> list[Targeted]:
        """Where this rank sends a RENEW or RELEASE made for a whole request:
        the producer ranks it reads, and those it only releases once a
        handshake confirmed the producer's TP size (``confirmed``). The TP
        size comes from the request's ``kv_transfer_params``, which any
        client of the decode server writes: with 8 KV heads, ``tp_size`` 1024
        made this rank call 1,016 ports of a host the client chose, one
        RELEASE each on the RPC threads. The ranks it reads are no more than
        the load's own handshakes dial; a load holds the others
        (``LoadState.release_only``) until its handshake confirms."""
        try:
            plan = self._plan(lease.peer)
        except ConfigError:
            # No load can run (and no handshake confirms the TP size): each producer
            # rank is released by one consumer rank, at most MAX_UNPLANNED_RANKS by this one.
            ranks = [p for p in range(lease.peer.tp_size) if p % self._tp_size == self._reader]
            return [(p, dataclasses.replace(lease, reader=self._reader, readers=1))
                    for p in ranks[:MAX_UNPLANNED_RANKS]]
        read = {r.rank for r in plan.reads}
        everyone = self._confirmed(lease.peer, read)
        return [(p, dataclasses.replace(lease, reader=self._reader, readers=n))
                for p, n in plan.readers.items() if everyone or p in read]

    def release_only(self, lease: RemoteLease, plan: RankPlan) -> list[Targeted]:
        """The RELEASEs of the producer ranks this rank releases without
        reading under ``plan``, whether or not the TP size is confirmed (the
        caller holds them until it is)."""
        return [(p, dataclasses.replace(lease, reader=self._reader, readers=plan.readers[p]))
                for p in plan.release_only]

    def of(self, load: LoadState, src: Source) -> Targeted:
        """The lease call of ``load`` to its source ``src``."""
        return src.read.rank, dataclasses.replace(load.spec.remote_lease, reader=self._reader,
                                                  readers=src.readers)

    def due(self, loads: Iterable[LoadState], now: float) -> list[Targeted]:
        """The renewals due now, the loads marked renewed: every running
        load's, to each source not yet released (``RdmaSettings.renewal_due``)."""
        due: list[Targeted] = []
        for load in loads:
            if load.spec.concurrent:
                continue  # a concurrent push holds no lease (the producer pins its own while it writes)
            if not load.stage.terminal and self._settings.renewal_due(load.renewed_at, now, load.spec.lease_ttl_s):
                load.renewed_at = now
                due.extend(self.of(load, src) for src in load.sources if not src.released)
        return due

    def release_load(self, load: LoadState) -> None:
        """RELEASE this reader's share of every source of ``load`` not yet
        released (a load that failed before it had sources: every producer
        rank this rank calls, as for a request released by the scheduler).
        Lock held."""
        if load.spec.concurrent:
            return  # no lease to release (the producer releases its own when the push resolves)
        if load.sources:
            targets = [self.of(load, src) for src in load.sources if not src.released]
            for src in load.sources:
                src.released = True
        else:
            targets = self.targets(load.spec.remote_lease)
        self.release(targets)

    def renew(self, targets: Iterable[Targeted]) -> None:
        self._send(wire.Renew, targets)

    def release(self, targets: Iterable[Targeted]) -> None:
        self._send(wire.Release, targets)

    def _send(self, kind: LeaseKind, targets: Iterable[Targeted]) -> None:
        """Group the calls by producer rank and submit them to the RPC threads."""
        by_peer: dict[tuple[PeerAddress, int], list[RemoteLease]] = collections.defaultdict(list)
        for rank, lease in targets:
            by_peer[lease.peer, rank].append(lease)
        submit = self._pool.submit_renewal if kind is wire.Renew else self._pool.submit
        for (address, rank), leases in by_peer.items():
            for chunk in wire.lease_chunks(leases, lease_id):
                if not submit(self._call, kind, address, rank, chunk, to=address.rank_address(rank)):
                    return  # the pool is closed: the worker is shutting down

    def _call(self, kind: LeaseKind, address: PeerAddress, rank: int, leases: list[RemoteLease]) -> None:
        """RPC thread: one call; a refused RENEW fails its load if it is not reading yet."""
        refused = call_lease_rpc(self._pool.get(*address.rank_address(rank)), kind, address, leases)
        if refused is None:
            return
        with self._book.lock:
            self._book.counters.add("renew_rpcs" if kind is wire.Renew else "release_rpcs")
            if not refused or kind is not wire.Renew:
                return
            by_claim = {ld.spec.claim: ld for ld in self._book.loads.values()}
            for lease, status in refused:
                load = by_claim.get(lease.claim)
                if load is not None and load.stage is LoadStage.HANDSHAKE:
                    for src in load.sources:
                        if src.read.rank == rank:
                            src.released = True  # the producer holds nothing for it
                    self._fail(load, refusal_reason(status, address.engine_id, lease.lease.generation))


def lease_id(lease: RemoteLease) -> str:
    """The request id a lease call carries for ``lease`` (``wire.lease_chunks``)."""
    return lease.lease.request_id


def wired_id(item: tuple[object, wire.LeaseWire]) -> str:
    """The request id of a source paired with its lease on the wire (``wire.lease_chunks``)."""
    return item[1].request_id


def call_lease_rpc(client: SideChannelClient, kind: LeaseKind, address: PeerAddress,
                   leases: list[RemoteLease], gone: Callable[[str], None] | None = None) -> Refused | None:
    """One RENEW or RELEASE; the leases the producer refused (GONE, CLAIMED,
    UNKNOWN, FORGED) with its answers, or None if the call failed (logged at DEBUG:
    the leases expire on their own). ``gone``: called with the reason when the
    producer was found gone (a ``PeerError``: its connection refused or reset;
    not a ``PeerTimeout``, which a producer stalled a while, on a loaded host,
    gives as well: failing it would drop its endpoint and keys, and the next
    load would have to handshake with it while it still does not answer)."""
    try:
        reply = client.lease_call(kind(wire.PROTOCOL_VERSION, [r.to_wire() for r in leases]),
                                  urgent=kind is wire.Renew)
    except Exception as exc:
        logger.debug("%s of %d lease(s) with %r failed (the leases expire on their own): %s",
                     kind.__name__, len(leases), address.engine_id, exc)
        if gone is not None and isinstance(exc, PeerError) and not isinstance(exc, PeerTimeout):
            gone(str(exc))
        return None
    return [(r, s) for r, s in zip(leases, reply.statuses) if s in REFUSALS]


def refusal_reason(status: wire.LeaseStatus, producer: str, generation: int) -> str:
    """Why a load cannot trust (or start) its reads, for a producer's refusal."""
    if status is wire.LeaseStatus.CLAIMED:
        return (f"producer {producer!r} refused lease {generation}: another consumer claimed it first "
                "(the same kv_transfer_params were loaded twice, e.g. a router retry or a duplicate "
                "request); the blocks belong to that load")
    if status is wire.LeaseStatus.FORGED:
        return (f"producer {producer!r} refused lease {generation}: its token is genuine but the "
                "kv_transfer_params name other blocks (or another request id, token count, engine or "
                "TP size) "
                "than the producer granted: the params were altered after the prefill returned them")
    if status is wire.LeaseStatus.UNKNOWN:
        return (f"producer {producer!r} never granted lease {generation} (its token does not verify): "
                "the kv_transfer_params were altered or come from another producer")
    return (f"producer {producer!r} no longer holds lease {generation} (released or expired): the "
            "blocks may have been reused")
