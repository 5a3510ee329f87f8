"""The consumer's load state machine: from a load in the step metadata to ``done_recving``.

Owns :class:`RdmaConsumer`. A load goes HANDSHAKE -> READING -> CONFIRMING
-> DONE, or FAILED from any stage (``records.LoadStage``), with one *source*
per producer rank it reads (the rank plan, ``peers``). One source's reads
are one ``read_prepared`` call (vectorised index math plus one C loop), on
the engine thread when the peer is ready, else on the RPC thread that ended
the handshake. When its producer publishes held words (``heldwords``), the
read of the source's blocks' words is chained behind its reads (the shim
posts it once they completed, ``words``) and vouches for it if each names
its lease; otherwise its lease is pinned as they are posted (``pins``,
unless ``read_pin`` is off). Completion arrives on
the transport's progress thread; the source is then trusted on its words,
or on its pin if its reads landed within it, else confirmed
(``confirms``); the load is DONE once all are.

Guarantees, and where they are kept:

- ``done_recving`` without load errors only after the producer vouched
  that the lease was held during the whole read: its held words read
  after the reads completed, each naming the lease (``words``), a pin
  granted before the reads landed and lasting past that (``pins``), or a
  CONFIRM after them (``confirms``).
- A failed, unconfirmed, refused or unreachable load is reported in
  ``done_recving`` *and* its blocks in ``take_load_errors``, in the same
  step (``records.LoadBook``); the deadlines (read: the transport's
  per-transfer ``timeout_s``; handshake and confirmation:
  ``load_timeout_s``) bound when. Every failure goes through ``_fail``,
  which waits until none of the load's reads can still land.
- An aborted request's load is reported in ``done_recving`` (its blocks
  handed back), once, when none of its reads can still land (``_abort``);
  the engine holds the blocks of a request waiting for a load until then
  (vLLM 0.32's rule). A load already reported is not reported again.
- Nothing raises into the engine loop: ``on_step`` catches, logs, and turns
  the failure into load errors.

Lock discipline: the book's lock guards load and peer state; the transport
is never called while holding it (its completion callbacks take it).
Load-failure warnings are rate-limited per producer (``lograte``).

Imports the standard library, ``rdma_kv.errors``, the connector's
``types`` and its ``rdma`` modules ``meta``, ``settings``, ``slots``,
``lograte``, ``transport_api``, ``wire`` and the consumer's ``clients``,
``confirms``, ``lease_rpc``, ``peers``, ``pins``, ``pushes``, ``records`` and ``words``, and
numpy and ``rdma.heldwords``. Never the producer's modules.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable

import numpy as np

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.clients import ClientPool
from rdma_kv.connector.rdma.consumer.confirms import Confirmations
from rdma_kv.connector.rdma.consumer.lease_rpc import REFUSALS, LeaseCalls, refusal_reason
from rdma_kv.connector.rdma.consumer.peers import Connection, LocalKV, PeerDirectory, PeerState
from rdma_kv.connector.rdma.consumer.pins import PIN_MARGIN_S, Pins
from rdma_kv.connector.rdma.consumer.pushes import PushHandle, Pushes
from rdma_kv.connector.rdma.consumer.records import (LoadBook, LoadStage, LoadState, PinStage, Source,
                                                     SourceStage)
from rdma_kv.connector.rdma.consumer import words as words_module
from rdma_kv.connector.rdma.consumer.words import WordChecks
from rdma_kv.connector.rdma.heldwords import word_tag
from rdma_kv.connector.rdma.lograte import RateLimitedWarnings
from rdma_kv.connector.rdma.meta import LoadSpec, PeerAddress, RemoteLease
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.slots import BlockPairs
from rdma_kv.connector.rdma.transport_api import TransferHandle
from rdma_kv.connector.types import EngineId, RequestId
from rdma_kv.errors import ConfigError

__all__ = ["RdmaConsumer"]

logger = logging.getLogger(__name__)

_NO_IDS = np.zeros(0, np.int64)

HANDSHAKE, READING, CONFIRMING, DONE, FAILED = (
    LoadStage.HANDSHAKE, LoadStage.READING, LoadStage.CONFIRMING, LoadStage.DONE, LoadStage.FAILED)


class RdmaConsumer:
    """The read path of one worker, built once its KV caches are registered
    (``local``). Reports into ``book``, which a consumer built after a wake
    from sleep takes over."""

    def __init__(self, local: LocalKV, engine_id: EngineId, settings: RdmaSettings, pool: ClientPool,
                 book: LoadBook, clock: Callable[[], float] = time.monotonic, registration: int = 1, *,
                 incarnation: bytes) -> None:
        self._local = local
        self._settings = settings
        self._clock = clock
        self._pool = pool
        self._book = book
        self._lock = book.lock
        self._failure_warnings = RateLimitedWarnings(logger, "KV load failures", clock=clock)
        self.peers = PeerDirectory(local, engine_id, settings.tp_rank, self._lock, pool, book.counters, clock,
                                   self._handshake_done)
        self.leases = LeaseCalls(settings, self.peers.plan, pool, book, self._fail, self.peers.confirmed)
        self._confirms = Confirmations(self._lock, pool, self.peers, self.leases, self._fail, self._confirmed,
                                       book.reading_from, book.counters)
        self._pins = Pins(book, pool, self.leases, self._on_pin, self.peers.failed)
        self._words = (WordChecks(local.transport) if settings.mode != "push" and settings.held_words
                       else None)
        """Pull mode with ``held_words``: reads a source's held words after its data (``words``)."""
        self._asleep: str | None = None  # why loads fail at once (suspend)
        self.pushes = (Pushes(local, engine_id, registration, incarnation, settings, pool, self.peers.failed,
                              self.peers.local_table, clock)
                       if settings.mode == "push" else None)
        """Push mode: the producer writes each source (``pushes``); None in pull mode."""
        if self.pushes is not None:
            self.peers.introduce = self.pushes.introduce  # no link without an introduction

    # --- every step ------------------------------------------------------------------------------

    def on_step(self, loads: Iterable[LoadSpec], releases: Iterable[RemoteLease],
                renewals: Iterable[RemoteLease], aborts: Iterable[RequestId], seen: float | None = None) -> None:
        """Apply the consumer's part of one step's metadata, bound at ``seen``
        (``perf_counter()``; None: now). Never raises."""
        if seen is None:
            seen = time.perf_counter()
        if releases:  # (most steps carry none: no call)
            self.leases.release(t for lease in releases for t in self.leases.targets(lease))
        if renewals:
            self.leases.renew(t for lease in renewals for t in self.leases.targets(lease))
        for rid in aborts:
            self._abort(rid)
        for spec in loads:
            try:
                self._start(spec, seen)
            except Exception as exc:  # a bug here must not escape into the engine loop
                logger.exception("request %r: starting its load failed", spec.request_id)
                with self._lock:
                    load = self._book.loads.get(spec.request_id)
                    if load is not None:
                        self._fail(load, f"starting the load failed: {exc}")

    def preconnect(self, address: PeerAddress) -> None:
        """Handshake ahead of the first load from ``address`` (``peers``). Never raises."""
        if self._asleep is None:
            self.peers.preconnect(address)

    def _start(self, spec: LoadSpec, seen: float) -> None:
        now = self._clock()
        load = LoadState(spec, now + self._settings.load_timeout_s, now, seen=seen)
        ready: list[tuple[Source, PeerState, Connection]] = []
        with self._lock:
            if spec.request_id in self._book.loads:
                logger.warning("request %r: a load is already running; ignoring the second", spec.request_id)
                return
            self._book.loads[spec.request_id] = load
            self.leases.check_ttl(load)
            if spec.error is not None or self._asleep is not None:
                self._fail(load, f"the scheduler could not plan the load: {spec.error}" if spec.error
                           else str(self._asleep))
                return
            try:
                plan = self.peers.plan(spec.peer)
            except ConfigError as exc:
                self._fail(load, f"cannot map tensor-parallel ranks: {exc}")
                return
            load.sources = [Source(read, plan.readers[read.rank]) for read in plan.reads]
            release_only = [] if spec.concurrent else self.leases.release_only(spec.remote_lease, plan)
            for src in load.sources:
                found = self.peers.peer_for(load, src, now)
                if isinstance(found, str):
                    self._fail(load, found)
                    break
                if found is not None:
                    ready.append((src, *found))
            if release_only and not self.peers.confirmed(spec.peer, {src.read.rank for src in load.sources}):
                # The params' TP size is a client's word: released once a handshake confirms it.
                load.release_only, release_only = release_only, []
        self.leases.release(release_only)
        for src, peer, connection in ready:
            self._post(load, src, peer, connection)

    def _handshake_done(self, peer: PeerState, waiting: list[tuple[LoadState, Source]]) -> None:
        """RPC thread: ``peer`` became READY (post its waiting loads, and
        release the producer ranks they only release: the handshake confirmed
        the TP size) or FAILED (fail them). Not called for a peer that became
        STALLED: its loads wait on (``peers``)."""
        post, release_only = [], []
        with self._lock:
            for load, src in waiting:
                if load.release_only and peer.connection is not None and peer.address == load.spec.peer:
                    release_only += load.release_only
                    load.release_only = []
                if peer.connection is None or peer.error is not None:
                    self._fail(load, peer.error or "handshake failed")
                    continue
                load.measures = load.measures.at_least(handshake_s=peer.connection.handshake_s)
                stale = peer.connection.stale_for(load.spec.registration, peer)
                if stale is None:
                    post.append((load, src, peer.connection))
                else:
                    self._fail(load, stale)
        self.leases.release(release_only)
        for load, src, connection in post:
            try:
                self._post(load, src, peer, connection)
            except Exception as exc:  # a bug; the loads after it must still be posted
                logger.exception("posting the reads of request %r failed", load.spec.request_id)
                with self._lock:
                    self._fail(load, f"posting its reads failed (a bug: please report it): {exc!r}")

    # --- reads -----------------------------------------------------------------------------------

    def _post(self, load: LoadState, src: Source, peer: PeerState, connection: Connection) -> None:
        """Post one source's reads. Called without the lock held."""
        spec, read = load.spec, src.read
        with self._lock:
            if load.stage.terminal or load.error is not None or src.stage is not SourceStage.WAITING:
                return  # failed meanwhile (deadline, another source)
            if load.aborted:
                if load.read_resolved:
                    self._finish_aborted(load)
                return
            src.stage, src.resolved = SourceStage.READING, False
            if load.stage is HANDSHAKE:
                load.stage = READING
            # Held words vouch for the reads one-sided, after them: no pin (docs/benchmarks.md, "Held words").
            words = self._words is not None and connection.words is not None  # (None in push mode)
            pin = self.pushes is None and self._settings.read_pin and not words
            if pin:
                self._pins.pin(peer, load, src)
        if self.pushes is not None:
            self._push(load, src, peer)
            return
        t0, check = time.perf_counter(), None
        try:
            # Not under the lock: preparing tables calls the transport, whose
            # completion callbacks take it (lock order, module docstring).
            (local, local_prep), (remote, remote_prep) = self.peers.tables(self.peers.plan(spec.peer), read,
                                                                           connection)
            pairs = BlockPairs.of(spec.local_block_ids, spec.remote_block_ids)
            if words:  # their read chained behind the data's (words)
                assert self._words is not None
                ids = pairs.remote[0] if len(pairs.remote) == 1 else np.concatenate(pairs.remote or [_NO_IDS])
                check = self._words.prepare(connection, ids, word_tag(spec.lease.token, spec.lease.binding))
            local_slots, remote_slots = pairs.slots(local, remote)
            xfer = self._local.transport.read_prepared(local_prep, local_slots, remote_prep, remote_slots,
                                                       timeout_s=self._settings.read_timeout_s,
                                                       then=None if check is None else check.then)
        except Exception as exc:
            if check is not None:
                assert self._words is not None
                self._words.verify(check, landed=False)  # (nothing was posted: its slots are free again)
            with self._lock:
                src.resolved = True
                self._fail(load, f"posting reads from {spec.peer.engine_id!r} rank {read.rank} failed: {exc}")
            if pin:
                self._pins.flush(peer)  # its answer finds the load failed (the pin then ends with the RELEASE)
            if not isinstance(exc, (ValueError, ConfigError)):
                self.peers.failed(peer, str(exc))
            return
        src.transfer = xfer
        src.words = check
        try:
            runs, skipped = pairs.runs(local), local.skipped_nbytes(spec.num_skipped_blocks)
            with self._lock:
                if words and check is None:  # no word check could be made: CONFIRMed once its reads land
                    self._book.counters.add("words_fallbacks")  # (the counters are the lock's)
                load.posting(xfer.started)
                load.measures = load.measures.with_(num_blocks=pairs.num_blocks).add(
                    block_runs=runs, nbytes_skipped=skipped, plan_s=max(0.0, xfer.started - t0),
                    post_s=xfer.post_s)
        finally:
            # The reads are on the wire: whatever the figures above did, the
            # source must resolve when they land (an exception here used to
            # leave it unresolved, so a failed load waited for ever).
            xfer.add_done_callback(functools.partial(self._on_read_done, load, src, peer))
            if pin:
                self._pins.flush(peer)  # after the post: the pin's round trip runs beside the reads

    def _push(self, load: LoadState, src: Source, peer: PeerState) -> None:
        """Push mode: register this source's blocks with its producer rank,
        which writes them (``pushes``). Called without the lock held."""
        assert self.pushes is not None
        spec = load.spec
        try:
            plan = self.peers.plan(spec.peer)
            if spec.concurrent:
                handle = self.pushes.register(peer, plan, src.read, src.readers, spec)
            else:
                handle = self.pushes.start(peer, plan, src.read, self.leases.of(load, src)[1],
                                           spec.local_block_ids, spec.remote_block_ids)
        except Exception as exc:  # nothing was sent
            with self._lock:
                src.resolved = True
                self._fail(load, f"registering the blocks with {spec.peer.engine_id!r} rank {src.read.rank} "
                                 f"failed: {exc}")
            return
        src.transfer = handle
        with self._lock:
            load.posting(handle.started)
        handle.add_done_callback(functools.partial(self._on_push_done, load, src))

    def _on_push_done(self, load: LoadState, src: Source, handle: PushHandle) -> None:
        """An RPC, progress or engine thread: one source's push resolved (no
        write of it can land any more, ``pushes``)."""
        ok = handle.error is None
        skipped = self._local.slots.skipped_nbytes(load.spec.num_skipped_blocks) if ok else 0
        if ok and skipped:  # this source's heads' share (heterogeneous TP)
            plan = self.peers.plan(load.spec.peer)
            skipped = skipped * src.read.count // plan.local_heads if not plan.whole(src.read) else skipped
        num_blocks = sum(len(g) for g in load.spec.local_block_ids)
        with self._lock:
            load.measures = load.measures.with_(num_blocks=num_blocks).add(
                nbytes=handle.nbytes if ok else 0, num_descs=handle.num_descs,
                nbytes_skipped=skipped).at_least(transfer_s=handle.elapsed_s)
            load.read_done(handle.started + handle.elapsed_s)
            src.resolved = True
            if handle.error is not None:
                if load.aborted and not load.stage.terminal:
                    # The engine dropped the request and asked the push to stop; it ended (nothing of
                    # it can land): an abort, not a load failure (no "KV load failed" warning).
                    if load.read_resolved:
                        self._finish_aborted(load)
                    return
                self._fail(load, f"push from {load.spec.peer.engine_id!r} rank {src.read.rank}: {handle.error}")
                return
            src.released = True  # the producer released its lease when the push resolved
            if load.stage.terminal:
                return
            src.stage = SourceStage.CONFIRMED  # the producer held the lease (pinned) through every write
            if load.error is not None:
                self._fail(load, load.error)
            elif load.aborted:
                if load.read_resolved:
                    self._finish_aborted(load)
            elif load.all_confirmed:
                self._confirmed(load, time.perf_counter())  # confirm_started's clock

    def _stop_pushes(self, load: LoadState) -> None:
        """Ask the producers to stop the load's pushes still running (lock held)."""
        if self.pushes is not None:
            for src in load.sources:
                if isinstance(src.transfer, PushHandle) and not src.transfer.done():
                    self.pushes.abort(src.transfer)

    def _on_read_done(self, load: LoadState, src: Source, peer: PeerState, xfer: TransferHandle) -> None:
        """Transport progress thread: one source's reads completed or failed,
        with the read of their held words chained behind them, if any: the
        words vouch for the data (``vouched``) or not (False: then a CONFIRM
        decides, as when the words' read alone failed)."""
        failed = xfer.error is not None
        landed = time.perf_counter()
        vouched = None
        if src.words is not None:
            assert self._words is not None
            vouched = self._words.verify(src.words, landed=not failed, may_land_later=xfer.abandoned)
            failed = failed and not xfer.chained  # (chained: the reads landed, their words' read failed)
        with self._lock:
            load.measures = load.measures.add(nbytes=xfer.nbytes, num_descs=xfer.num_descs,
                                              ops_posted=xfer.ops_posted).at_least(transfer_s=xfer.elapsed_s)
            load.read_done(xfer.started + xfer.elapsed_s)
            src.resolved = True
            src.words = None
            if failed:
                self._fail(load, f"reads from {load.spec.peer.engine_id!r} rank {src.read.rank} "
                                 f"failed: {xfer.error}")
            elif not load.stage.terminal:
                src.stage, src.landed_at = SourceStage.CONFIRMING, landed
                if load.error is not None:
                    self._fail(load, load.error)  # failed while reads were in flight
                elif load.aborted:
                    if load.read_resolved:
                        self._finish_aborted(load)
                else:
                    if load.all_confirming:
                        load.stage = CONFIRMING
                        load.confirm_started = landed
                    if vouched is not None:  # (then it was not pinned)
                        self._vouch(load, src, peer, vouched)
                    else:
                        self._trust_or_confirm(load, src, peer)
        if failed:
            self.peers.failed(peer, str(xfer.error))

    def _vouch(self, load: LoadState, src: Source, peer: PeerState, vouched: bool) -> None:
        """``src``'s reads landed, its load is live, and its held words were
        read behind them: trusted if each named its lease (``vouched``),
        else CONFIRMed (lock held)."""
        if not vouched:
            self._book.counters.add("words_fallbacks")
            self._confirms.queue(peer, load, src)  # (a source whose words are read was not pinned)
            return
        src.stage = SourceStage.CONFIRMED
        self._book.counters.add("words_trusted")
        self._pins.release(peer, load, src)  # sent after the report (get_finished), as a pin's
        if load.all_confirmed:
            self._confirmed(load, time.perf_counter())

    def _trust_or_confirm(self, load: LoadState, src: Source, peer: PeerState) -> None:
        """``src``'s reads landed, and its load is live: trust them on its
        pin, or CONFIRM them (lock held)."""
        if src.pin is PinStage.SENT:
            return  # its pin's answer decides (_on_pin)
        if src.pin is PinStage.HELD and src.landed_at <= src.pin_until:
            # Held from the grant until the pin's answer, and pinned from
            # there past the moment the reads landed: nobody reused the blocks.
            src.stage = SourceStage.CONFIRMED
            self._book.counters.add("pin_trusted")
            self._pins.release(peer, load, src)
            if load.all_confirmed:
                self._confirmed(load, time.perf_counter())
            return
        if src.pin is not PinStage.NONE:
            self._book.counters.add("pin_fallbacks")
        self._confirms.queue(peer, load, src)

    def _on_pin(self, load: LoadState, src: Source, peer: PeerState, status: wire.LeaseStatus | None,
                pinned_s: float) -> None:
        """A renewal thread: ``src``'s pin was answered (``status``; None: the
        call failed) with ``pinned_s`` granted. Lock held."""
        if load.stage.terminal or src.stage not in (SourceStage.READING, SourceStage.CONFIRMING):
            return
        if status is wire.LeaseStatus.HELD and pinned_s > PIN_MARGIN_S:
            src.pin, src.pin_until = PinStage.HELD, src.pin_sent + pinned_s - PIN_MARGIN_S
        elif status in REFUSALS:
            assert status is not None
            src.pin, src.released = PinStage.DECLINED, True  # the producer holds nothing for this reader
            reason = refusal_reason(status, load.spec.peer.engine_id, load.spec.lease.generation)
            self._fail(load, f"{reason}; the data read cannot be trusted, discarded")  # once no read can land
            return
        else:
            src.pin = PinStage.DECLINED  # PENDING, no time granted, or the call failed: CONFIRM
        if src.stage is SourceStage.CONFIRMING and load.error is None and not load.aborted:
            self._trust_or_confirm(load, src, peer)

    def _confirmed(self, load: LoadState, now: float) -> None:
        """Every source of ``load`` was confirmed HELD (lock held)."""
        started = load.confirm_started
        load.measures = load.measures.with_(confirm_s=0.0 if started is None else now - started)
        if load.aborted:
            self._finish_aborted(load)
        else:
            load.stage = DONE
            self._book.finish(load)

    # --- endings (lock held) ---------------------------------------------------------------------

    def _fail(self, load: LoadState, reason: str) -> None:
        """The one place a load fails."""
        if load.stage.terminal:
            return
        if not load.read_resolved:
            # Reads can still land: defer until every transfer resolves (its
            # deadline bounds this); _on_read_done fails it.
            load.error = load.error or reason
            self._stop_pushes(load)
            return
        load.stage, load.error = FAILED, load.error or reason
        self._book.counters.add("loads_failed")
        self._failure_warnings.warn(load.spec.peer.engine_id, "request %r: KV load failed: %s",
                                    load.spec.request_id, load.error)
        self.leases.release_load(load)
        if load.aborted:
            self._book.hand_back(load.spec.request_id)
        else:
            self._book.finish(load)

    def _finish_aborted(self, load: LoadState) -> None:
        if not load.stage.terminal:
            self.leases.release_load(load)
        load.stage = DONE
        self._book.hand_back(load.spec.request_id)
        self._book.counters.add("loads_aborted")

    def _abort(self, rid: RequestId) -> None:
        """The scheduler finished ``rid`` while its load was handed to us."""
        with self._lock:
            load = self._book.loads.get(rid)
            if load is None:
                return  # reported already (done or failed): the engine freed its blocks then
            if load.stage.terminal and load.read_resolved:
                self._book.hand_back(rid)  # finished, not yet reported: reported now, as handed back
                return
            load.aborted = True
            if load.read_resolved:
                self._finish_aborted(load)
            else:  # _on_read_done finishes it once no read can land
                self._stop_pushes(load)

    # --- get_finished, introspection, sleep -------------------------------------------------------

    def get_finished(self) -> set[RequestId]:
        """The loads finished, aborted ones included (``LoadBook.report``):
        fails the loads past their deadline, re-queues PENDING and
        unanswered confirmations, dials the STALLED peers again
        (``PeerDirectory.redial``) and sends the renewals due."""
        if self.pushes is not None:
            self.pushes.poll()
        elif self._book.loads:
            # Reads that completed since the last step are settled here, on
            # the engine's thread: their CONFIRM goes out now, and the load
            # can be reported in this call, rather than after the transport's
            # service thread wakes and wins the interpreter lock from an
            # engine stepping back to back (docs/benchmarks.md, "Connector
            # overhead per stage"). Not under the lock: callbacks take it.
            self._local.transport.settle()
        now = self._clock()
        with self._lock:
            for load in list(self._book.loads.values()):
                if not load.stage.terminal and load.error is None and now > load.deadline:
                    waiting = f": {load.waiting_on}" if load.waiting_on else ""
                    self._fail(load, f"not finished within load_timeout_s={self._settings.load_timeout_s} "
                                     f"(stage {load.stage.value}){waiting}")
            finished = self._book.report()
            self._pins.send_releases()
            self._confirms.retry()
            self.peers.redial(now)
            renew = self.leases.due(self._book.loads.values(), now)
            idle = self.peers.prune(now, self._book.peer_keys)
        self.peers.remove(idle)
        self.leases.renew(renew)
        self._pool.prune(self._addresses_in_use, now)
        self._failure_warnings.flush(now)
        return finished

    def wait_idle(self, timeout_s: float) -> None:
        """An idle step (nothing computes in it): wait, at most ``timeout_s``,
        until a load in flight is finished -- first on its reads, on this
        thread (``wait``: it copies for a lane whose pump has no CPU yet,
        and settles the read here, which checks the held words read behind
        it or queues its CONFIRM), then on its CONFIRM -- so that the
        ``get_finished`` that follows reports it. Reads with their held
        words' read chained behind them still in flight when the time is up
        are waited for up to ``words.WORDS_GRACE_S`` more, once (else the
        next step reports them).
        Returns at once when nothing is reading or confirming (handshakes
        are not waited for). Pull mode only. Never raises."""
        if self.pushes is not None:
            return
        end, graced = time.perf_counter() + timeout_s, False
        while True:
            with self._lock:
                if self._book.num_unreported:
                    return
                active = [ld for ld in self._book.loads.values() if ld.stage in (READING, CONFIRMING)]
                sources = [src for ld in active for src in ld.sources
                           if src.stage is SourceStage.READING and src.transfer is not None]
                reading = [src.transfer for src in sources if src.transfer is not None]
                chained = any(src.words is not None for src in sources)
            now = time.perf_counter()
            if now >= end and not graced and chained:
                end, graced = now + min(timeout_s, words_module.WORDS_GRACE_S), True
            left = end - now
            if not active or left <= 0:
                return
            if reading:
                try:
                    reading[0].wait(left)
                except Exception:  # failed (its callback fails the load) or not done in time
                    pass
            else:  # confirming: a load's end wakes it (then reported); at the time, look once more
                self._book.wait_finished(left)

    def _addresses_in_use(self) -> set[tuple[str, int]]:
        with self._lock:
            return self.peers.addresses() | {ld.spec.peer.rank_address(src.read.rank)
                                             for ld in self._book.loads.values() for src in ld.sources}

    def resources(self) -> dict[str, int]:
        with self._lock:
            out = {"inflight_loads": len(self._book.loads), "peers": len(self.peers),
                   "clients": len(self._pool), "unreported": self._book.num_unreported,
                   "confirm_queue": len(self._confirms), "pin_queue": len(self._pins),
                   "word_slots_quarantined": self._words.quarantined if self._words is not None else 0}
        if self.pushes is not None:
            out["pushes_running"] = self.pushes.running()
        return out

    def suspend(self, reason: str, timeout_s: float) -> None:
        """The worker is about to close the transport (sleep): fail every load
        in flight, reported by the next ``get_finished`` with its blocks as
        load errors, and forget every peer; from now on a load fails at once
        with ``reason``. Waits, at most ``timeout_s``, for reads still on the
        wire to resolve; closing the transport then fails the rest (no read
        lands after it)."""
        with self._lock:
            self._asleep = reason
            for load in list(self._book.loads.values()):
                self._fail(load, reason)
        deadline = time.monotonic() + timeout_s
        while self._book.reads_on_the_wire() and time.monotonic() < deadline:
            time.sleep(0.005)
        with self._lock:
            self.peers.clear()
            self._confirms.clear()
            self._pins.clear()
