"""The consumer's read path: from a load in the step metadata to ``done_recving``.

Owns :class:`RdmaConsumer`, everything a decode worker does to read a
prompt's KV blocks from a producer:

- **plan**: which producer ranks hold the KV heads this rank owns
  (``sources``, ``topology``: from both TP sizes and the model's KV
  heads): one *source* per producer rank read, each a head slice of both
  sides' blocks, or whole blocks when the TP sizes are equal.
- **peers**: one :class:`~rdma_kv.connector.rdma.loads.PeerState` per
  producer rank, CONNECTING -> READY (HANDSHAKE over the side channel: the
  rank's share checked against the plan, the producer's agent metadata
  imported) or FAILED (not dialled again for ``PEER_RETRY_S``; forgotten
  after that). Slot tables are prepared once per (peer, head slice). The
  first load from a producer rank starts its handshake, unless
  ``preconnect`` (the scheduler saw the producer's address before the
  load) already did.
- **loads**: each goes HANDSHAKE -> READING -> CONFIRMING -> DONE, or
  FAILED from any stage (:class:`~rdma_kv.connector.rdma.loads.LoadStage`).
  Posting one source's reads is one ``read_prepared`` call (vectorised
  index math plus one C loop), on the engine thread when the peer is
  ready, on the RPC thread that finished the handshake otherwise.
  Completion arrives on the transport's progress thread. A failure of any
  source fails the load, once none of its reads can still land.
- **validate after read**: confirmations are batched per peer (one
  CONFIRM+RELEASE round trip for every source that completed since the
  last one); only HELD from every source makes a load DONE (``_confirm``).
- **leases it was handed**: RENEW while a load runs or waits for admission,
  RELEASE when it ends or is abandoned (``lease_rpc``), over side-channel
  clients pooled per producer address (``clients``). Every call names this
  rank as the reader and how many consumer ranks read that producer rank,
  so a producer rank read by several consumer ranks keeps the blocks until
  each released; a producer rank this rank is to release without reading
  (a head replica read from another rank) is released when the load starts.

Guarantees, and where they are kept:

- ``done_recving`` without load errors only after the producer confirmed
  the lease was held during the whole read (``_confirm``).
- A failed, unconfirmed, refused or unreachable load is reported in
  ``done_recving`` *and* its blocks in ``take_load_errors``, in the same
  step (``get_finished``); the deadlines (read: the transport's
  per-transfer ``timeout_s``; handshake and confirmation:
  ``load_timeout_s``) bound when. Every failure goes through ``_fail``.
- An aborted request is reported in ``done_sending`` (its blocks handed
  back) only once its transfer completed or failed (``_abort``).
- Nothing raises into the engine loop: ``on_step`` catches, logs, and turns
  the failure into load errors.

Handshakes and lease RPCs run on a small thread pool, never on the engine
thread. Lock discipline: ``self._lock`` guards load and peer state; the
transport is never called while holding it (its completion callbacks take
it). Load-failure warnings are rate-limited per producer (``lograte``).

Imports the standard library, numpy, ``rdma_kv.errors``, the connector's
``types`` and ``geometry`` and its ``rdma`` modules (``auth``, ``wire``,
``meta``, ``planning``, ``settings``, ``sidechannel``, ``stats``,
``transport_api`` and the consumer's helpers ``sources``, ``loads``,
``clients``, ``lease_rpc``, ``lograte``). Never ``producer``, ``leases`` or
``worker``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time

import numpy as np
from collections.abc import Callable, Iterable
from typing import Any


from rdma_kv.connector.geometry import KVCacheGeometry
from rdma_kv.connector.rdma import auth, wire
from rdma_kv.connector.rdma.clients import ClientPool
from rdma_kv.connector.rdma.lease_rpc import call_lease_rpc, refusal_reason, submit_lease_rpcs
from rdma_kv.connector.rdma.loads import (
    PEER_RETRY_S,
    LoadStage,
    LoadState,
    PeerStage,
    PeerState,
    Source,
    SourceStage,
    due_renewals,
)
from rdma_kv.connector.rdma.lograte import RateLimitedWarnings
from rdma_kv.connector.rdma.meta import LoadSpec, PeerAddress, RemoteLease
from rdma_kv.connector.rdma.planning import SlotTable, block_arrays, count_runs
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.sideclient import SideChannelClient
from rdma_kv.connector.rdma.stats import ConsumerCounters, LoadRecord, LoadStats, Tally, Totals
from rdma_kv.connector.rdma.sources import Sources, Targeted
from rdma_kv.connector.rdma.transport_api import TransferHandle, Transport
from rdma_kv.connector.types import BlockId, EngineId, RequestId
from rdma_kv.errors import ConfigError, HandshakeError, PeerError

__all__ = ["RdmaConsumer"]

# The worker's name: operators filter the consumer's lines on it (docs/deploy.md).
logger = logging.getLogger("rdma_kv.connector.rdma.worker")

HANDSHAKE, READING, CONFIRMING, DONE, FAILED = (
    LoadStage.HANDSHAKE, LoadStage.READING, LoadStage.CONFIRMING, LoadStage.DONE, LoadStage.FAILED)

PeerKey = tuple[str, str, int]  # engine id, side-channel host, the producer rank's port


class RdmaConsumer:
    """The read path of one worker. Built by :class:`~rdma_kv.connector.rdma.worker.RdmaWorker`;
    reads once :meth:`attach` has given it the registered transport."""

    def __init__(self, engine_id: EngineId, settings: RdmaSettings, secret: auth.Secret | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engine_id = engine_id
        self._settings = settings
        self._rank = settings.tp_rank
        self._secret = secret
        self._clock = clock
        self._lock = threading.RLock()
        self._transport: Transport | None = None
        self._sources = Sources(settings.tp_rank, settings.tp_size)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            settings.rpc_threads, thread_name_prefix=f"rdma-kv-rpc-{settings.tp_rank}")
        self._clients = ClientPool(self._make_client, clock=clock)
        self._failure_warnings = RateLimitedWarnings(logger, "KV load failures", clock=clock)
        self._peers: dict[PeerKey, PeerState] = {}
        self._loads: dict[RequestId, LoadState] = {}
        self._finished: list[LoadState] = []  # DONE or FAILED, to report
        self._aborted_done: set[RequestId] = set()
        self._load_errors: set[BlockId] = set()
        self._confirm_queue: dict[PeerKey, list[tuple[LoadState, Source]]] = collections.defaultdict(list)
        self._confirm_scheduled: set[PeerKey] = set()
        self._confirm_retry: list[tuple[PeerState, LoadState, Source]] = []
        self._stats = LoadStats()
        self._counters = Tally(ConsumerCounters)
        self._closed = False

    def attach(self, transport: Transport, geometry: KVCacheGeometry, slots: SlotTable, local_prep: Any,
               compat: wire.CompatInfo, rank: wire.RankInfo) -> None:
        """The worker registered its KV caches: reads go into ``slots`` of ``transport``."""
        self._transport = transport
        self._sources.attach(transport, geometry, slots, local_prep, compat, rank)

    # --- every step ------------------------------------------------------------------------------------

    def on_step(self, loads: Iterable[LoadSpec], releases: Iterable[RemoteLease],
                renewals: Iterable[RemoteLease], aborts: Iterable[RequestId]) -> None:
        """Apply the consumer's part of one step's metadata. Never raises."""
        if self._closed:
            return
        if releases:
            self._lease_rpc_async(wire.Release, [t for lease in releases for t in self._sources.targets(lease)])
        if renewals:
            self._lease_rpc_async(wire.Renew, [t for lease in renewals for t in self._sources.targets(lease)])
        for rid in aborts:
            self._abort(rid)
        for spec in loads:
            try:
                self._start(spec)
            except Exception as exc:  # a bug here must not escape into the engine loop
                logger.exception("request %r: starting its load failed", spec.request_id)
                with self._lock:
                    load = self._loads.get(spec.request_id)
                    if load is not None:
                        self._fail(load, f"starting the load failed: {exc}")

    def _start(self, spec: LoadSpec) -> None:
        now = self._clock()
        load = LoadState(spec, now + self._settings.load_timeout_s, now)
        ready: list[tuple[PeerState, Source]] = []
        with self._lock:
            if spec.request_id in self._loads:
                logger.warning("request %r: a load is already running; ignoring the second", spec.request_id)
                return
            self._loads[spec.request_id] = load
            if spec.error is not None:
                self._fail(load, f"the scheduler could not plan the load: {spec.error}")
                return
            try:
                plan = self._sources.plan(spec.peer)
            except ConfigError as exc:
                self._fail(load, f"cannot map tensor-parallel ranks: {exc}")
                return
            load.sources = [Source(read, plan.readers[read.rank]) for read in plan.reads]
            release_only = [t for t in self._sources.targets(spec.remote_lease) if t[0] in plan.release_only]
            for src in load.sources:
                peer = self._known_peer(spec.peer, src.read.rank, now)
                if (peer is not None and peer.state is not PeerStage.CONNECTING
                        and 0 < peer.registration < spec.registration):
                    self._forget(peer)  # the producer re-registered (woke from sleep): its old keys are void
                    peer = None
                if peer is not None and peer.state is PeerStage.FAILED:
                    self._fail(load, f"producer {spec.peer.engine_id!r} rank {src.read.rank} is "
                                     f"unavailable: {peer.error}")
                    break
                if peer is None:
                    peer = self._connect(spec.peer, src.read.rank)
                    peer.waiting.append((load, src))
                elif peer.state is PeerStage.CONNECTING:
                    peer.waiting.append((load, src))
                elif (stale := self._registration_mismatch(spec, peer)) is not None:
                    self._fail(load, stale)
                    break
                else:
                    ready.append((peer, src))
        if release_only:
            self._lease_rpc_async(wire.Release, release_only)
        for peer, src in ready:
            self._post(load, src, peer)

    # --- peers --------------------------------------------------------------------------------------------

    def preconnect(self, address: PeerAddress) -> None:
        """Start the handshakes with the producer ranks at ``address`` this
        rank reads, without a load, so that the first load from them finds
        the peers READY, or CONNECTING (it then waits for these handshakes
        instead of starting others). A peer already known, or failed less
        than ``PEER_RETRY_S`` ago, is left alone. A failure is the same as a
        load's failed handshake: the peer is FAILED for ``PEER_RETRY_S``, and
        the loads waiting on it fail. Never raises."""
        if self._closed or self._transport is None:
            return  # not registered yet: a handshake would only fail
        try:
            ranks = sorted({read.rank for read in self._sources.plan(address).reads})
        except Exception:
            return  # no plan: the load fails with the reason
        with self._lock:
            for rank in ranks:
                if self._known_peer(address, rank, self._clock()) is not None:
                    continue
                try:
                    self._connect(address, rank)
                except RuntimeError:  # the executor is shut down: closing
                    return
                self._counters.add("preconnects")

    def _peer_key(self, address: PeerAddress, rank: int) -> PeerKey:
        return (address.engine_id, *address.rank_address(rank))

    def _known_peer(self, address: PeerAddress, rank: int, now: float) -> PeerState | None:
        """The peer for producer rank ``rank`` at ``address``, if any: a FAILED
        one only within ``PEER_RETRY_S`` of its failure (an older one is
        forgotten, so the caller handshakes again). Called with the lock held."""
        key = self._peer_key(address, rank)
        peer = self._peers.get(key)
        if peer is not None and peer.state is PeerStage.FAILED and now - peer.failed_at >= PEER_RETRY_S:
            del self._peers[key]
            return None
        return peer

    def _connect(self, address: PeerAddress, rank: int) -> PeerState:
        """A new CONNECTING peer, its handshake submitted to the RPC threads
        (RuntimeError, and no peer, once they are shut down). Called with the
        lock held."""
        key = self._peer_key(address, rank)
        peer = self._peers[key] = PeerState(address, rank)
        try:
            self._executor.submit(self._handshake, peer)
        except RuntimeError:
            del self._peers[key]
            raise
        return peer

    def _client(self, address: PeerAddress, rank: int) -> SideChannelClient:
        return self._clients.get(*address.rank_address(rank))

    def _make_client(self, host: str, port: int) -> SideChannelClient:
        s = self._settings
        return SideChannelClient(host, port, connect_timeout_s=s.connect_timeout_s,
                                 rpc_timeout_s=s.rpc_timeout_s, retries=s.rpc_retries, secret=self._secret)

    def _handshake(self, peer: PeerState) -> None:
        """RPC thread: make ``peer`` READY (then post its waiting loads) or FAILED."""
        address, t0 = peer.address, time.perf_counter()
        name = None
        try:
            compat, rank = self._sources.require()
            plan = self._sources.plan(address)
            client = self._client(address, peer.rank)
            reply = client.handshake(wire.Handshake(wire.PROTOCOL_VERSION, self._engine_id, rank, compat))
            if reply.engine_id != address.engine_id:
                raise HandshakeError(
                    f"expected producer engine {address.engine_id!r} at {client.address}, found "
                    f"{reply.engine_id!r}; the request's kv_transfer_params point at another engine")
            if reply.compat != compat:
                diff = "; ".join(compat.mismatches(reply.compat, mine="consumer", theirs="producer"))
                raise HandshakeError(f"producer {reply.engine_id!r} has an incompatible KV cache: {diff}")
            expected = wire.RankInfo(peer.rank, address.tp_size, plan.remote_heads)
            if reply.rank != expected:
                raise HandshakeError(
                    f"producer {reply.engine_id!r} at {client.address} is rank {reply.rank.tp_rank} of "
                    f"{reply.rank.tp_size} with {reply.rank.num_kv_heads} KV heads; expected rank "
                    f"{expected.tp_rank} of {expected.tp_size} with {expected.num_kv_heads} (the "
                    "kv_transfer_params' tp_size, or the producer's ports, are wrong)")
            geometry = reply.geometry.to_geometry()
            assert self._transport is not None
            name = self._transport.add_peer(reply.agent_metadata)
        except Exception as exc:
            if name is not None:
                self._safe_remove_peer(name)
            host, port = address.rank_address(peer.rank)
            reason = f"handshake with {host}:{port} failed: {exc}"
            logger.warning("producer %r: %s", address.engine_id, reason)
            with self._lock:
                peer.state, peer.error, peer.failed_at = PeerStage.FAILED, reason, self._clock()
                waiting, peer.waiting = peer.waiting, []
                for load, _ in waiting:
                    self._fail(load, reason)
            return
        with self._lock:
            peer.state, peer.name, peer.geometry = PeerStage.READY, name, geometry
            peer.registration = reply.registration
            peer.handshake_s = time.perf_counter() - t0
            waiting, peer.waiting = peer.waiting, []
            self._counters.add("handshakes")
            post = []
            for load, src in waiting:
                load.measures = load.measures.at_least(handshake_s=peer.handshake_s)
                stale = self._registration_mismatch(load.spec, peer)
                if stale is None:
                    post.append((load, src))
                else:
                    self._fail(load, stale)
        for load, src in post:
            self._post(load, src, peer)

    @staticmethod
    def _registration_mismatch(spec: LoadSpec, peer: PeerState) -> str | None:
        """Why ``spec`` must not be read from ``peer`` (None: it may): the
        producer re-registered its KV cache since the params were issued."""
        if spec.registration == peer.registration:
            return None
        return (f"producer {spec.peer.engine_id!r} rank {peer.rank} re-registered its KV cache (sleep mode: "
                f"registration {peer.registration}) since these kv_transfer_params were issued (registration "
                f"{spec.registration}): the blocks they name are gone; nothing was read")

    def _forget(self, peer: PeerState) -> None:
        """Drop a peer whose metadata is void (called with the lock held;
        the transport call touches the transport's lock only)."""
        del self._peers[self._peer_key(peer.address, peer.rank)]
        peer.state, peer.error = PeerStage.FAILED, "re-registered"
        if peer.name is not None:
            self._safe_remove_peer(peer.name)

    def _safe_remove_peer(self, name: str) -> None:
        try:
            assert self._transport is not None
            self._transport.remove_peer(name)
        except Exception:
            pass

    def _peer_failed(self, peer: PeerState, reason: str) -> None:
        """Forget a peer whose reads failed: the next load re-handshakes (a
        restarted producer has a new agent). Called without the lock held."""
        with self._lock:
            key = self._peer_key(peer.address, peer.rank)
            if self._peers.get(key) is peer and peer.state is PeerStage.READY:
                peer.state, peer.error, peer.failed_at = PeerStage.FAILED, reason, self._clock()
            else:
                return
        if peer.name is not None:
            self._safe_remove_peer(peer.name)

    def _addresses_in_use(self) -> set[tuple[str, int]]:
        with self._lock:
            return ({p.address.rank_address(p.rank) for p in self._peers.values()}
                    | {ld.spec.peer.rank_address(src.read.rank)
                       for ld in self._loads.values() for src in ld.sources})

    def _prune_failed_peers(self, now: float) -> None:
        """Forget peers that failed more than ``PEER_RETRY_S`` ago (a new load
        re-handshakes anyway), so producers that come and go (new engine
        ids on restart) do not accumulate. Called with the lock held."""
        for key, peer in list(self._peers.items()):
            if peer.state is PeerStage.FAILED and not peer.waiting and now - peer.failed_at > PEER_RETRY_S:
                del self._peers[key]

    # --- reads -----------------------------------------------------------------------------------------

    def _post(self, load: LoadState, src: Source, peer: PeerState) -> None:
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
        assert self._transport is not None
        t0 = time.perf_counter()
        try:
            plan = self._sources.plan(spec.peer)
            # Not under self._lock: preparing tables calls the transport, whose
            # completion callbacks take self._lock (lock order, module docstring).
            (local, local_prep), (remote, remote_prep) = self._sources.tables(plan, read, peer)
            local_ids, remote_ids = block_arrays(spec.local_block_ids, spec.remote_block_ids)
            local_idx = local.indices(local_ids, "local")
            remote_idx = remote.indices(remote_ids, "remote")
            xfer = self._transport.read_prepared(local_prep, local_idx, remote_prep, remote_idx,
                                                 timeout_s=self._settings.read_timeout_s)
        except Exception as exc:
            with self._lock:
                src.resolved = True
                self._fail(load, f"posting reads from {spec.peer.engine_id!r} rank {read.rank} failed: {exc}")
            if peer.name is not None and not isinstance(exc, (ValueError, ConfigError)):
                self._peer_failed(peer, str(exc))
            return
        src.transfer = xfer
        runs, skipped = count_runs(local_ids, remote_ids, local), local.skipped_nbytes(spec.num_skipped_blocks)
        with self._lock:
            load.measures = load.measures.with_(num_blocks=sum(int(ids.size) for ids in local_ids)).add(
                block_runs=runs, nbytes_skipped=skipped,
                plan_s=time.perf_counter() - t0 - xfer.post_s, post_s=xfer.post_s)
        xfer.add_done_callback(functools.partial(self._on_read_done, load, src, peer))

    def _on_read_done(self, load: LoadState, src: Source, peer: PeerState, xfer: TransferHandle) -> None:
        """Transport progress thread: one source's reads completed or failed."""
        failed = xfer.error is not None
        with self._lock:
            load.measures = load.measures.add(nbytes=xfer.nbytes, num_descs=xfer.num_descs,
                                              ops_posted=xfer.ops_posted).at_least(transfer_s=xfer.elapsed_s)
            src.resolved = True
            if failed:
                self._fail(load, f"reads from {load.spec.peer.engine_id!r} rank {src.read.rank} "
                                 f"failed: {xfer.error}")
            elif not load.stage.terminal:
                src.stage = SourceStage.CONFIRMING
                if load.error is not None:
                    self._fail(load, load.error)  # failed while reads were in flight
                elif load.aborted:
                    if load.read_resolved:
                        self._finish_aborted(load)
                else:
                    self._queue_confirm(peer, load, src)
                    if all(s.stage in (SourceStage.CONFIRMING, SourceStage.CONFIRMED) for s in load.sources):
                        load.stage = CONFIRMING
                        load.confirm_started = time.perf_counter()
        if failed:
            self._peer_failed(peer, str(xfer.error))

    # --- validate after read ----------------------------------------------------------------------------

    def _queue_confirm(self, peer: PeerState, load: LoadState, src: Source) -> None:
        key = self._peer_key(peer.address, peer.rank)
        self._confirm_queue[key].append((load, src))
        if key not in self._confirm_scheduled:
            self._confirm_scheduled.add(key)
            self._executor.submit(self._confirm, peer, key)

    def _confirm(self, peer: PeerState, key: PeerKey) -> None:
        with self._lock:
            self._confirm_scheduled.discard(key)
            batch = [(ld, src) for ld, src in self._confirm_queue.pop(key, [])
                     if src.stage is SourceStage.CONFIRMING and not ld.stage.terminal]
        if not batch:
            return
        request = wire.Confirm(wire.PROTOCOL_VERSION, [self._sources.of(ld, src)[1].to_wire() for ld, src in batch],
                               release=True)
        try:
            statuses = self._client(peer.address, peer.rank).lease_call(request).statuses
        except Exception as exc:
            with self._lock:
                for load, _ in batch:
                    self._fail(load, f"could not confirm the lease with {peer.address.engine_id!r} rank "
                                     f"{peer.rank}, so the data read cannot be trusted: {exc}")
            if isinstance(exc, PeerError):
                # The producer is gone: drop its endpoint and rkeys now, not
                # at the next load, or they outlive it.
                self._peer_failed(peer, str(exc))
            return
        now = time.perf_counter()
        with self._lock:
            for (load, src), status in zip(batch, statuses):
                if load.stage.terminal or src.stage is not SourceStage.CONFIRMING:
                    continue
                if status is wire.LeaseStatus.PENDING:
                    self._confirm_retry.append((peer, load, src))  # re-sent at the next step
                    continue
                src.released = True  # HELD released this reader's share; a refusal holds nothing
                if status is not wire.LeaseStatus.HELD:
                    reason = refusal_reason(status, peer.address.engine_id, load.spec.lease.generation)
                    self._fail(load, f"{reason}; the data read cannot be trusted, discarded")
                    continue
                src.stage = SourceStage.CONFIRMED
                if all(s.stage is SourceStage.CONFIRMED for s in load.sources):
                    started = load.confirm_started
                    load.measures = load.measures.with_(confirm_s=0.0 if started is None else now - started)
                    if load.aborted:
                        self._finish_aborted(load)
                    else:
                        load.stage = DONE
                        self._finished.append(load)

    # --- endings (called with the lock held) ---------------------------------------------------------------

    def _release_sources(self, load: LoadState) -> None:
        """RELEASE this reader's share of every source not yet released (a
        load that failed before it had sources: every producer rank this rank
        calls, as for a request released by the scheduler)."""
        if load.sources:
            targets = [self._sources.of(load, src) for src in load.sources if not src.released]
            for src in load.sources:
                src.released = True
        else:
            targets = self._sources.targets(load.spec.remote_lease)
        if targets:
            self._lease_rpc_async(wire.Release, targets)

    def _fail(self, load: LoadState, reason: str) -> None:
        """The one place a load fails."""
        if load.stage.terminal:
            return
        if not load.read_resolved:
            # Reads can still land: defer until every transfer resolves (its
            # deadline bounds this); _on_read_done fails it.
            load.error = load.error or reason
            return
        load.stage, load.error = FAILED, load.error or reason
        self._counters.add("loads_failed")
        self._failure_warnings.warn(load.spec.peer.engine_id, "request %r: KV load failed: %s",
                                    load.spec.request_id, load.error)
        self._release_sources(load)
        if load.aborted:
            self._hand_back(load.spec.request_id)
        else:
            self._finished.append(load)

    def _finish_aborted(self, load: LoadState) -> None:
        if not load.stage.terminal:
            self._release_sources(load)
        load.stage = DONE
        self._hand_back(load.spec.request_id)
        self._counters.add("loads_aborted")

    def _hand_back(self, rid: RequestId) -> None:
        """An aborted request's blocks go back to the scheduler at the next
        ``get_finished`` (its ``finished_sending``)."""
        self._loads.pop(rid, None)
        self._aborted_done.add(rid)

    def _abort(self, rid: RequestId) -> None:
        """The scheduler finished ``rid`` while its load was handed to us."""
        with self._lock:
            load = self._loads.get(rid)
            if load is None:
                self._hand_back(rid)  # nothing in flight
                return
            load.aborted = True
            if not load.read_resolved:
                return  # _on_read_done finishes it once no read can land
            if load.stage.terminal:
                self._finished = [ld for ld in self._finished if ld is not load]
                self._hand_back(rid)
                return
            self._finish_aborted(load)

    # --- get_finished ---------------------------------------------------------------------------------------

    def get_finished(self) -> tuple[set[RequestId], set[RequestId]]:
        """(aborted requests whose blocks may be freed, loads finished):
        fails the loads past their deadline, records the finished ones,
        re-queues PENDING confirmations and sends the renewals due."""
        now = self._clock()
        with self._lock:
            for load in list(self._loads.values()):
                if not load.stage.terminal and load.error is None and now > load.deadline:
                    self._fail(load, f"not finished within load_timeout_s={self._settings.load_timeout_s} "
                                     f"(stage {load.stage.value})")
            recving: set[RequestId] = set()
            for load in self._finished:
                rid = load.spec.request_id
                recving.add(rid)
                self._loads.pop(rid, None)
                if load.stage is FAILED:
                    self._load_errors.update(load.spec.all_local_block_ids)
                self._record(load)
            self._finished = []
            sending, self._aborted_done = self._aborted_done, set()
            retry, self._confirm_retry = self._confirm_retry, []
            for peer, load, src in retry:
                if src.stage is SourceStage.CONFIRMING and not load.stage.terminal:
                    self._queue_confirm(peer, load, src)
            renew = due_renewals(self._loads.values(), now, self._settings.renew_interval_for, self._rank)
            self._prune_failed_peers(now)
        if renew:
            self._lease_rpc_async(wire.Renew, renew)
        self._clients.prune(self._addresses_in_use, now)
        self._failure_warnings.flush(now)
        return sending, recving

    def take_load_errors(self) -> set[BlockId]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
            return errors

    # --- lease RPCs ---------------------------------------------------------------------------------------

    def _lease_rpc_async(self, kind: type, leases: Iterable[Targeted]) -> None:
        if not self._closed:
            submit_lease_rpcs(self._executor, self._lease_rpc, kind, leases)

    def _lease_rpc(self, kind: type, address: PeerAddress, rank: int, leases: list[RemoteLease]) -> None:
        refused = call_lease_rpc(self._client(address, rank), kind, address, leases)
        if refused is None:
            return
        self._counters.add("renew_rpcs" if kind is wire.Renew else "release_rpcs")
        if refused and kind is wire.Renew:
            # A load not yet reading gives up now; one whose reads are in
            # flight learns the same from its CONFIRM, once no read can land.
            with self._lock:
                by_claim = {ld.spec.claim: ld for ld in self._loads.values()}
                for lease, status in refused:
                    load = by_claim.get(lease.claim)
                    if load is not None and load.stage is HANDSHAKE:
                        for src in load.sources:
                            if src.read.rank == rank:
                                src.released = True  # the producer holds nothing for it
                        self._fail(load, refusal_reason(status, address.engine_id, lease.lease.generation))

    # --- stats, resources, shutdown -----------------------------------------------------------------------

    def _record(self, load: LoadState) -> None:
        self._stats.record(load.spec.request_id, load.measures, ok=load.stage is DONE,
                           total_s=self._clock() - load.created, error=load.error)

    def take_stats(self) -> tuple[tuple[LoadRecord, ...], Totals]:
        """Per-load records, and their totals with the event counters, since the last call."""
        with self._lock:
            records, totals = self._stats.take()
            return records, dataclasses.replace(totals, consumer=self._counters.take())

    def resources(self) -> dict[str, int]:
        with self._lock:
            return {"inflight_loads": len(self._loads), "peers": len(self._peers),
                    "clients": len(self._clients), "unreported": len(self._finished),
                    "confirm_queue": sum(len(v) for v in self._confirm_queue.values())}

    def num_inflight(self) -> int:
        with self._lock:
            return len(self._loads)

    def reads_on_the_wire(self) -> list[str]:
        """Request ids (aborted ones included) whose read transfers the
        transport has not yet resolved: their blocks can still be written."""
        with self._lock:
            return sorted(rid for rid, ld in self._loads.items() if ld.on_the_wire())

    def suspend(self, reason: str, timeout_s: float) -> None:
        """The worker is about to close the transport (sleep): fail every load
        in flight, reported by the next ``get_finished`` with its blocks as
        load errors, and forget every peer. Waits, at most ``timeout_s``,
        for reads still on the wire to resolve; closing the transport then
        fails the rest (no read lands after it)."""
        with self._lock:
            for load in list(self._loads.values()):
                self._fail(load, reason)
        deadline = time.monotonic() + timeout_s
        while self.reads_on_the_wire() and time.monotonic() < deadline:
            time.sleep(0.005)
        with self._lock:
            self._peers.clear()
            self._confirm_queue.clear()
            self._confirm_retry.clear()
            self._transport = None

    def close(self) -> None:
        """Stop the RPC threads and close the side-channel clients (the
        transport belongs to the worker)."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._clients.close()
