"""Validate-after-read: the consumer's CONFIRM calls, queued, batched and retried.

Owns :class:`Confirmations`: a source whose reads landed is queued for its
peer; one CONFIRM (with ``release``) per peer carries every source queued
since the last one, on an RPC thread (cut into several where the producer's
limits on one call require it: ``wire.lease_chunks``). The producer's answer per source:

- HELD: the lease was held during the whole read (and this reader's share
  is released): the source is CONFIRMED; the load's ``on_confirmed`` runs
  once every source of it is.
- PENDING (the producer has not been shipped the lease yet): queued again
  for the next :meth:`Confirmations.retry` (the next ``get_finished``).
- GONE, CLAIMED, UNKNOWN or FORGED: the data read cannot be trusted; the
  load fails (``lease_rpc.refusal_reason``).

A call the producer did not answer in time (``PeerTimeout``: stalled or
starved of CPU a while, as a loaded host leaves a process) is made again
``CONFIRM_RETRY_S`` later, at a step, until the load's deadline
(``load_timeout_s``) fails it: the reads landed, and a CONFIRM is
idempotent (a retried CONFIRM of a lease its first attempt released still
reads HELD), so a producer that answers late loses nothing. Before, the
call's attempts (4 s) decided, and a producer stalled that long had every
load queued to it recompute. Any other failure fails every load the call
carried; a producer that is gone (``PeerError``) is failed in the peer
directory too, so its endpoint and keys do not outlive it.

Imports the standard library, ``rdma_kv.errors`` and the connector's
``rdma.stats`` and ``rdma.wire``, and the consumer's ``clients``, ``lease_rpc``,
``peers`` and ``records``.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.clients import ClientPool
from rdma_kv.connector.rdma.consumer.lease_rpc import LeaseCalls, refusal_reason, wired_id
from rdma_kv.connector.rdma.consumer.peers import PeerDirectory
from rdma_kv.connector.rdma.consumer.peerstate import PeerKey, PeerState
from rdma_kv.connector.rdma.consumer.records import LoadState, Source, SourceStage
from rdma_kv.connector.rdma.stats import ConsumerCounters, Tally
from rdma_kv.errors import PeerError, PeerTimeout

__all__ = ["CONFIRM_RETRY_S", "Confirmations"]

Queued = tuple[LoadState, Source]

CONFIRM_RETRY_S = 1.0
"""How long after a CONFIRM the producer did not answer it is made again
(the client fails fast this long after such a call: ``SideChannelClient.down_s``)."""


class Confirmations:
    """The CONFIRM calls of one consumer rank. Methods marked "lock held"
    expect the consumer's lock (``lock``) held by the caller."""

    def __init__(self, lock: threading.RLock, pool: ClientPool, peers: PeerDirectory, leases: LeaseCalls,
                 fail: Callable[[LoadState, str], None],
                 on_confirmed: Callable[[LoadState, float], None],
                 reading: Callable[[PeerKey], bool], counters: Tally[ConsumerCounters]) -> None:
        """``reading``: whether a read from a producer rank may still land
        (lock held); ``counters``: the consumer's (counted under ``lock``)."""
        self._lock = lock
        self._counters = counters
        self._reading = reading
        self._pool = pool
        self._peers = peers
        self._leases = leases
        self._fail = fail
        self._on_confirmed = on_confirmed
        self._queue: dict[PeerKey, list[Queued]] = collections.defaultdict(list)
        self._scheduled: set[PeerKey] = set()
        self._pending: list[tuple[float, PeerState, LoadState, Source]] = []
        """Sources to queue again once ``time.monotonic()`` passes their time:
        answered PENDING (at once), or not answered (``CONFIRM_RETRY_S`` on)."""

    def __len__(self) -> int:
        return sum(len(q) for q in self._queue.values())

    def queue(self, peer: PeerState, load: LoadState, src: Source) -> None:
        """``src``'s reads landed: confirm it with the next CONFIRM to ``peer``. Lock held."""
        self._queue[peer.key].append((load, src))
        if peer.key not in self._scheduled and self._pool.submit(self._confirm, peer,
                                                             to=peer.address.rank_address(peer.rank)):
            self._scheduled.add(peer.key)

    def retry(self) -> None:
        """Queue again the sources the producer answered PENDING, and those
        of a CONFIRM it did not answer once ``CONFIRM_RETRY_S`` passed. Lock held."""
        now = time.monotonic()
        pending, self._pending = self._pending, []
        for entry in pending:
            at, peer, load, src = entry
            if src.stage is not SourceStage.CONFIRMING or load.stage.terminal:
                continue
            if at > now:
                self._pending.append(entry)
            else:
                self.queue(peer, load, src)

    def clear(self) -> None:
        """Drop everything queued (the consumer is being suspended). Lock held."""
        self._queue.clear()
        self._pending.clear()

    def _confirm(self, peer: PeerState) -> None:
        """RPC thread: CONFIRM+RELEASE what is queued for ``peer``, in as
        few calls as the producer accepts (``wire.lease_chunks``: a queue
        that grew while a CONFIRM was in flight can pass its limits)."""
        with self._lock:
            self._scheduled.discard(peer.key)
            batch = [(ld, src) for ld, src in self._queue.pop(peer.key, [])
                     if src.stage is SourceStage.CONFIRMING and not ld.stage.terminal]
        wired = [(queued, self._leases.of(*queued)[1].to_wire()) for queued in batch]
        for chunk in wire.lease_chunks(wired, wired_id):
            self._confirm_chunk(peer, chunk)

    def _confirm_chunk(self, peer: PeerState, wired: list[tuple[Queued, wire.LeaseWire]]) -> None:
        """One CONFIRM+RELEASE call; a failed call fails its own loads."""
        batch = [queued for queued, _ in wired]
        request = wire.Confirm(wire.PROTOCOL_VERSION, [lease for _, lease in wired], release=True)
        try:
            statuses = self._pool.get(*peer.address.rank_address(peer.rank)).lease_call(request).statuses
        except PeerTimeout as exc:
            at = time.monotonic() + CONFIRM_RETRY_S
            with self._lock:
                self._counters.add("confirms_unanswered")
                for load, src in batch:
                    if not load.stage.terminal and src.stage is SourceStage.CONFIRMING:
                        load.waiting_on = f"the CONFIRM to {peer.address.engine_id!r} rank {peer.rank} is " \
                                          f"not answered: {exc}"
                        self._pending.append((at, peer, load, src))
            return
        except Exception as exc:
            with self._lock:
                for load, _ in batch:
                    self._fail(load, f"could not confirm the lease with {peer.address.engine_id!r} rank "
                                     f"{peer.rank}, so the data read cannot be trusted: {exc}")
                reading = self._reading(peer.key)
            if isinstance(exc, PeerError) and not reading:
                # The producer is gone: drop its endpoint and rkeys now, not
                # at the next load, or they outlive it.
                self._peers.failed(peer, str(exc))
            return
        now = time.perf_counter()
        with self._lock:
            for (load, src), status in zip(batch, statuses):
                if load.stage.terminal or src.stage is not SourceStage.CONFIRMING:
                    continue
                if status is wire.LeaseStatus.PENDING:
                    self._pending.append((0.0, peer, load, src))  # re-sent at the next step
                    continue
                src.released = True  # HELD released this reader's share; a refusal holds nothing
                if status is not wire.LeaseStatus.HELD:
                    reason = refusal_reason(status, peer.address.engine_id, load.spec.lease.generation)
                    self._fail(load, f"{reason}; the data read cannot be trusted, discarded")
                    continue
                src.stage = SourceStage.CONFIRMED
                if load.all_confirmed:
                    self._on_confirmed(load, now)
