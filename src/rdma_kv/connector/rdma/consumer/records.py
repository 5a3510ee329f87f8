"""The consumer's records: one load and its sources, and the book of loads a worker reports.

Owns the stages of a load (:class:`LoadStage`: HANDSHAKE -> READING ->
CONFIRMING -> DONE, or FAILED from any stage), of each of its sources (one
per producer rank it reads, :class:`SourceStage`: WAITING -> READING ->
CONFIRMING -> CONFIRMED), and :class:`LoadBook`: the loads a consumer
runs and what it has not reported yet (finished loads, aborted requests
whose blocks may be freed, load errors, stats), with the lock that guards
them. The book outlives a consumer: the worker hands the same book to the
consumer it builds after a wake from sleep, so loads the old one finished
are still reported.

A load with equal tensor-parallel sizes on both sides has one source; a
consumer rank that owns heads held by several producer ranks has one per
rank (``topology``). A load is CONFIRMING once every source's reads
landed, and DONE once every source was confirmed HELD.

Imports the standard library and the connector's ``types`` and ``rdma``
data modules (``meta``, ``stats``, ``topology``, ``transport_api``).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import time
from typing import Any

from rdma_kv.connector.rdma.meta import LoadSpec, RemoteLease
from rdma_kv.connector.rdma.stats import ConsumerCounters, LoadMeasures, LoadRecord, LoadStats, Tally, Totals
from rdma_kv.connector.rdma.topology import Read
from rdma_kv.connector.rdma.transport_api import TransferHandle
from rdma_kv.connector.types import BlockId, RequestId

__all__ = ["LoadBook", "LoadStage", "LoadState", "PinStage", "Source", "SourceStage"]


class LoadStage(enum.Enum):
    """Where one load is. A load holds its producer's lease (and renews
    it) in every stage that is not ``terminal``."""

    HANDSHAKE = "handshake"  # waiting for its peer to become ready
    READING = "reading"  # reads posted, the transfer not yet resolved
    CONFIRMING = "confirming"  # reads landed; waiting for the producer's CONFIRM
    DONE = "done"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (LoadStage.DONE, LoadStage.FAILED)


class SourceStage(enum.Enum):
    """Where the part of a load read from one producer rank is."""

    WAITING = "waiting"  # its peer's handshake is in flight
    READING = "reading"  # reads posted, the transfer not yet resolved
    CONFIRMING = "confirming"  # reads landed; waiting for its pin's answer, or CONFIRM(release) queued or sent
    CONFIRMED = "confirmed"  # trusted: landed within its pin, or the producer's CONFIRM answered HELD


class PinStage(enum.Enum):
    """Where a source's read pin is (pull mode, ``pins``): a lease pinned
    when its reads were posted vouches for reads that land within the pin."""

    NONE = "none"  # not pinned: push mode, pins off, or its reads not posted
    SENT = "sent"  # queued or sent; no answer yet
    HELD = "held"  # granted until ``Source.pin_until``
    DECLINED = "declined"  # not granted (PENDING, no time granted, the call failed): CONFIRM instead


@dataclasses.dataclass(eq=False)
class Source:
    """The part of one load read from producer rank ``read.rank``."""

    read: Read
    readers: int
    """Consumer ranks that call this producer rank for this lease (``topology``)."""
    stage: SourceStage = SourceStage.WAITING
    transfer: TransferHandle | None = None
    resolved: bool = True
    """No read of this source can still land (never posted, completed or failed)."""
    released: bool = False
    """This reader's share of the lease needs no RELEASE any more (sent, confirmed
    with release, or refused by the producer)."""
    pin: PinStage = PinStage.NONE
    pin_sent: float = 0.0
    """``perf_counter()`` when its pin was queued (the pin runs from later)."""
    pin_until: float = 0.0
    """``perf_counter()`` by which its reads must have landed to be trusted
    on the pin (``pin_sent`` plus the time granted, less a margin)."""
    landed_at: float = 0.0
    """``perf_counter()`` when its reads were seen to land (0: not yet)."""
    words: Any = None
    """Its held words' read, chained behind its reads (``words.WordCheck``),
    when the words are to vouch for them; None: a pin or a CONFIRM."""


@dataclasses.dataclass(eq=False)
class LoadState:
    spec: LoadSpec
    deadline: float
    created: float
    stage: LoadStage = LoadStage.HANDSHAKE
    aborted: bool = False
    sources: list[Source] = dataclasses.field(default_factory=list)
    error: str | None = None
    renewed_at: float | None = None
    waiting_on: str = ""
    """Why the load is not done yet, when it waits on a producer that does
    not answer (a CONFIRM, ``confirms``; a HANDSHAKE, ``peers``: STALLED),
    said when its deadline fails it."""
    confirm_started: float | None = None
    """``perf_counter()`` when the load entered CONFIRMING (its ``confirm_s`` runs from here)."""
    seen: float = dataclasses.field(default_factory=time.perf_counter)
    """``perf_counter()`` when the worker bound the step's metadata that carries
    the load: its stages (``start_s``, ``finish_s``, ``total_s``) run from here."""
    reads_done_at: float | None = None
    """``perf_counter()`` when its last read completed (``finish_s`` runs from here)."""
    measures: LoadMeasures = dataclasses.field(default_factory=LoadMeasures)
    release_only: list[tuple[int, RemoteLease]] = dataclasses.field(default_factory=list)
    """The RELEASEs of the producer ranks this rank releases without reading,
    held until a handshake of this load confirms the producer's TP size
    (``lease_rpc.LeaseCalls.targets``)."""

    def posting(self, started: float) -> None:
        """A source's reads were posted, the call starting at ``started``
        (``TransferHandle.started``): the first post ends ``start_s``. Lock held."""
        start_s = max(0.0, started - self.seen)
        if self.measures.start_s is None or start_s < self.measures.start_s:
            self.measures = self.measures.with_(start_s=start_s)

    def read_done(self, done_at: float) -> None:
        """A source's reads completed at ``done_at`` (``perf_counter()``). Lock held."""
        if self.reads_done_at is None or done_at > self.reads_done_at:
            self.reads_done_at = done_at

    @property
    def read_resolved(self) -> bool:
        """No read of any source can still land in this load's blocks."""
        return all(src.resolved for src in self.sources)

    def on_the_wire(self) -> bool:
        """A posted transfer of this load is not yet resolved by the transport."""
        return any(src.transfer is not None and not src.transfer.done() for src in self.sources)

    @property
    def all_confirming(self) -> bool:
        """Every source's reads landed (none is waiting or reading)."""
        return all(s.stage in (SourceStage.CONFIRMING, SourceStage.CONFIRMED) for s in self.sources)

    @property
    def all_confirmed(self) -> bool:
        return all(s.stage is SourceStage.CONFIRMED for s in self.sources)


class LoadBook:
    """The loads of one worker's consumer and what it has not reported yet.
    :meth:`finish`, :meth:`hand_back` and :meth:`report` expect :attr:`lock`
    held by the caller; the others take it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.loads: dict[RequestId, LoadState] = {}
        """Every load not yet reported: running, or finished and waiting for ``report``."""
        self._finished: list[LoadState] = []  # DONE or FAILED, in ``loads`` until reported
        self._handed_back: set[RequestId] = set()
        self._failed_ids: set[RequestId] = set()  # failed loads reported since the last take_failed
        self._load_errors: set[BlockId] = set()
        self._stats = LoadStats()
        self.counters = Tally(ConsumerCounters)
        self._has_finished = threading.Event()  # set while a finished load waits for ``report``

    def peer_keys(self) -> set[tuple[str, str, int]]:
        """The producer ranks (``PeerState.key``) that the loads in the book
        read from. Lock held."""
        return {load.spec.peer.rank_key(src.read.rank) for load in self.loads.values() for src in load.sources}

    def reading_from(self, key: tuple[str, str, int]) -> bool:
        """Whether a read from the producer rank ``key`` (``PeerState.key``)
        may still land. Lock held. A lease call that finds a producer's side
        channel down fails the peer only when none may: failing it cancels
        them, and a side channel down for a moment (a link flap: with the
        consumer's own end down, three attempts meet "Network is
        unreachable" within 0.15 s) does not lose reads that cross once it
        is back. Their deadline, or their CONFIRM, tells a producer that is
        gone. (A 0.5 s flap failed every load still reading when a CONFIRM
        or a RELEASE of another failed the peer.)"""
        return any(not src.resolved and load.spec.peer.rank_key(src.read.rank) == key
                   for load in self.loads.values() for src in load.sources)

    def finish(self, load: LoadState) -> None:
        """``load`` is DONE or FAILED: the next :meth:`report` names it."""
        self._finished.append(load)
        self._has_finished.set()

    def wait_finished(self, timeout_s: float) -> bool:
        """Block (without the lock) until a load is finished and not yet
        reported, at most ``timeout_s``; whether one is."""
        return self._has_finished.wait(timeout_s)

    def hand_back(self, rid: RequestId) -> None:
        """An aborted request's blocks go back to the engine at the next
        report: its load is reported in ``finished_recving`` (no load errors,
        no stats: the request is gone), where each worker reports every load
        once, so that an engine gathering the reports of several workers (vLLM
        counts them per request) frees the blocks once all of them did. (They
        were reported in ``finished_sending``: a worker that had reported the
        load before the abort never reported it there, and with tensor
        parallelism the count never completed: the blocks leaked.)"""
        load = self.loads.pop(rid, None)
        if load is not None:
            self._finished = [ld for ld in self._finished if ld is not load]
            if not self._finished:
                self._has_finished.clear()
        self._handed_back.add(rid)

    def report(self) -> set[RequestId]:
        """The loads finished since the last call, and the aborted requests
        whose blocks may be freed (``hand_back``); the failed loads' blocks go
        to the load errors and every finished load to the stats."""
        recving: set[RequestId] = set()
        now = time.perf_counter()  # the stages' clock (``LoadState.seen``)
        for load in self._finished:
            rid = load.spec.request_id
            recving.add(rid)
            self.loads.pop(rid, None)
            if load.stage is LoadStage.FAILED:
                self._load_errors.update(load.spec.all_local_block_ids)
                self._failed_ids.add(rid)
            measures = load.measures
            if load.reads_done_at is not None:
                measures = measures.with_(finish_s=max(0.0, now - load.reads_done_at))
            self._stats.record(rid, measures, ok=load.stage is LoadStage.DONE, total_s=now - load.seen,
                               error=load.error)
        self._finished = []
        self._has_finished.clear()
        recving |= self._handed_back
        self._handed_back = set()
        return recving

    def take_load_errors(self) -> set[BlockId]:
        with self.lock:
            errors, self._load_errors = self._load_errors, set()
            return errors

    def take_failed(self) -> set[RequestId]:
        """The requests whose load was reported failed since the last call."""
        with self.lock:
            failed, self._failed_ids = self._failed_ids, set()
            return failed

    def take_stats(self) -> tuple[tuple[LoadRecord, ...], Totals]:
        """Per-load records, and their totals with the consumer's counters, since the last call."""
        with self.lock:
            records, totals = self._stats.take()
            return records, dataclasses.replace(totals, consumer=self.counters.take())

    @property
    def num_unreported(self) -> int:
        return len(self._finished)

    def reads_on_the_wire(self) -> list[str]:
        """Request ids (aborted ones included) whose read transfers the
        transport has not yet resolved: their blocks can still be written."""
        with self.lock:
            return sorted(rid for rid, ld in self.loads.items() if ld.on_the_wire())

    def num_loads(self) -> int:
        """Loads running or finished and not yet reported."""
        with self.lock:
            return len(self.loads)
