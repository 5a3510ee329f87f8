"""PIN at post: the consumer's read pins and the RELEASEs that follow them, batched per producer rank.

Owns :class:`Pins`. When a source's reads are posted (pull mode,
``RdmaSettings.read_pin``), its lease is queued for a PIN: a RENEW with
``pin`` (protocol 7), which the producer answers while the reads run. HELD
with ``pinned_s`` means the blocks were held from the grant until the
answer and stay held, whatever else happens to the producer, for
``pinned_s`` from it (``leases``, "Read pins"). So reads that land before
``pin_sent + pinned_s`` (less :data:`PIN_MARGIN_S`) read blocks nobody
reused, and need no CONFIRM round trip after them: the CONFIRM's wait
becomes the part of the pin's round trip the reads did not hide.

The source's reader is then done with the lease: its RELEASE is queued
here too and sent with the peer's next pins, or once the consumer's
``get_finished`` has reported the load (:meth:`Pins.send_releases`: off
the load's critical path), batched, and nobody waits for its answer (a
lost RELEASE leaves the lease to expire, as any lost RELEASE does). One
task per producer rank at a time drains both queues, pins first, on the
pool's renewal threads (``urgent`` on the client: a pin never waits
behind a slow CONFIRM or handshake).

What the answers mean to the load (``loads`` applies them):

- HELD with time granted: the source may be trusted on its pin.
- GONE, CLAIMED, UNKNOWN, FORGED: the producer holds nothing for this
  reader; the load fails once no read can land.
- PENDING (the grant has not reached that producer worker yet), HELD
  with no time granted (the producer is going to sleep), or the call
  failed: not pinned; the source is CONFIRMed after its reads, as
  without pins.

A producer found gone by a RELEASE (``PeerError``, not ``PeerTimeout``:
``lease_rpc.call_lease_rpc``) is failed in the peer directory (``failed``),
as a CONFIRM's would be: a load trusted on its
pin needs no more calls, so its RELEASE may be the only one to learn it,
and the endpoint and keys must not outlive the producer. Not while reads
from it are on the wire, and a failed PIN fails nothing: failing the peer
cancels those reads (a 0.5 s link flap failed the loads in flight when
it did), and their deadline or their CONFIRM tells a producer that is
gone.

Imports the standard library, the connector's
``rdma.meta`` and ``rdma.wire`` and the consumer's ``clients``,
``lease_rpc``, ``peers`` and ``records``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.clients import ClientPool
from rdma_kv.connector.rdma.consumer.lease_rpc import LeaseCalls, call_lease_rpc, lease_id, wired_id
from rdma_kv.connector.rdma.consumer.peerstate import PeerKey, PeerState
from rdma_kv.connector.rdma.consumer.records import LoadBook, LoadState, PinStage, Source
from rdma_kv.connector.rdma.meta import RemoteLease

__all__ = ["PIN_MARGIN_S", "Pins"]

logger = logging.getLogger(__name__)

PIN_MARGIN_S = 0.05
"""Taken off every pin: the two hosts' monotonic clocks may run at slightly
different rates (parts per million: well under a millisecond over a 10 s
pin), and the callback that sees reads land runs after they did."""

Answer = Callable[[LoadState, Source, PeerState, "wire.LeaseStatus | None", float], None]
"""``(load, source, peer, status or None if the call failed, seconds pinned)``, lock held."""


class Pins:
    """The PIN and post-pin RELEASE calls of one consumer rank. Methods
    marked "lock held" expect the book's lock held by the caller."""

    def __init__(self, book: LoadBook, pool: ClientPool, leases: LeaseCalls, on_answer: Answer,
                 failed: Callable[[PeerState, str], None]) -> None:
        self._book = book
        self._failed = failed
        self._lock: threading.RLock = book.lock
        self._pool = pool
        self._leases = leases
        self._on_answer = on_answer
        self._pins: dict[PeerKey, list[tuple[LoadState, Source]]] = collections.defaultdict(list)
        self._releases: dict[PeerKey, tuple[PeerState, list[RemoteLease]]] = {}  # the peer, its RELEASEs queued
        self._scheduled: set[PeerKey] = set()

    def __len__(self) -> int:
        """Pins and post-pin RELEASEs queued, not yet sent (``resources()["pin_queue"]``)."""
        return sum(len(q) for q in self._pins.values()) + sum(len(q) for _, q in self._releases.values())

    def pin(self, peer: PeerState, load: LoadState, src: Source) -> None:
        """``src``'s reads are about to be posted: queue a pin of its lease,
        sent by :meth:`flush` (once they are posted). Lock held."""
        src.pin, src.pin_sent = PinStage.SENT, time.perf_counter()
        self._pins[peer.key].append((load, src))

    def flush(self, peer: PeerState) -> None:
        """Send what is queued for ``peer`` (on a renewal thread). Takes the lock."""
        with self._lock:
            if self._schedule(peer):
                return
            # The pool is closed (the worker is closing): nothing goes out; CONFIRM decides (and fails).
            pins = self._pins.pop(peer.key, [])
            for load, src in pins:
                if src.pin is PinStage.SENT:
                    self._on_answer(load, src, peer, None, 0.0)

    def release(self, peer: PeerState, load: LoadState, src: Source) -> None:
        """``src`` was trusted on its pin: release this reader's share of
        the lease, with the peer's next pins or at :meth:`send_releases`.
        Lock held."""
        src.released = True
        self._releases.setdefault(peer.key, (peer, []))[1].append(self._leases.of(load, src)[1])

    def send_releases(self) -> None:
        """Send the RELEASEs queued (the consumer's ``get_finished``, once it
        has reported its loads: sent the moment a load is trusted, a RELEASE
        took the renewal thread and the interpreter lock just as the engine's
        thread was to report that load, 100-300 us later on a small one).
        Lock held."""
        for peer, _ in list(self._releases.values()):
            self._schedule(peer)  # False: the pool is closed; the leases expire on the producer

    def clear(self) -> None:
        """Drop the pins queued (the consumer is being suspended; its loads
        failed, and release their leases themselves). Lock held."""
        self._pins.clear()

    def _schedule(self, peer: PeerState) -> bool:
        if peer.key in self._scheduled:
            return True
        if not self._pool.submit_renewal(self._drain, peer, to=peer.address.rank_address(peer.rank)):
            return False
        self._scheduled.add(peer.key)
        return True

    def _drain(self, peer: PeerState) -> None:
        """Renewal thread: send ``peer``'s queued pins, then its releases.
        What is queued meanwhile goes in a task of its own, after the calls
        to that producer rank submitted since (a stream of pins does not
        hold the rank's turn on the pool: ``ClientPool``, one call per
        address at a time)."""
        with self._lock:
            self._scheduled.discard(peer.key)
            pins = self._pins.pop(peer.key, [])
            releases = self._releases.pop(peer.key, (peer, []))[1]
        try:
            wired = [(queued, self._leases.of(*queued)[1].to_wire()) for queued in pins]
            for chunk in wire.lease_chunks(wired, wired_id):
                self._send_pins(peer, chunk)
            for leases in wire.lease_chunks(releases, lease_id):
                self._send_releases(peer, leases)
        except Exception:  # a bug: this peer's later pins must still go out (its loads have deadlines)
            logger.exception("sending lease pins / releases to %r rank %d failed", peer.address.engine_id,
                             peer.rank)

    def _send_releases(self, peer: PeerState, leases: list[RemoteLease]) -> None:
        client = self._pool.get(*peer.address.rank_address(peer.rank))
        # A producer found gone is failed: drop its endpoint and keys now.
        if call_lease_rpc(client, wire.Release, peer.address, leases,
                          gone=lambda reason: self._gone(peer, reason)) is not None:
            with self._lock:
                self._book.counters.add("release_rpcs")

    def _gone(self, peer: PeerState, reason: str) -> None:
        """A RELEASE found ``peer`` gone: fail it, unless reads from it may
        still land (``LoadBook.reading_from``)."""
        with self._lock:
            reading = self._book.reading_from(peer.key)
        if not reading:
            self._failed(peer, reason)

    def _send_pins(self, peer: PeerState, wired: list[tuple[tuple[LoadState, Source], wire.LeaseWire]]) -> None:
        batch = [queued for queued, _ in wired]
        request = wire.Renew(wire.PROTOCOL_VERSION, [lease for _, lease in wired], pin=True)
        statuses: list[wire.LeaseStatus | None]
        try:
            reply = self._pool.get(*peer.address.rank_address(peer.rank)).lease_call(request, urgent=True)
            statuses, pinned_s = list(reply.statuses), reply.pinned_s
        except Exception as exc:  # their reads are CONFIRMed instead
            # The peer is not failed: these reads are on the wire (LoadBook.reading_from says why).
            logger.debug("PIN of %d lease(s) with %r rank %d failed: %s", len(batch), peer.address.engine_id,
                         peer.rank, exc)
            statuses, pinned_s = [None] * len(batch), 0.0
        with self._lock:
            if statuses[0] is not None:
                self._book.counters.add("pin_rpcs")
            for (load, src), status in zip(batch, statuses):
                if src.pin is PinStage.SENT:
                    self._on_answer(load, src, peer, status, pinned_s)
