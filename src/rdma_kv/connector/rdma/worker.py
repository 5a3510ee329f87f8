"""The RDMA connector's worker side: registration, handshakes, reads, confirmation.

Owns the byte movement of both roles in one worker:

- **startup**: ``register_kv_caches`` derives the geometry, registers each
  distinct allocation once, prepares the local slot table, and (producer)
  starts the side-channel server with the lease table.
- **producer**: lease grants arrive in the step metadata; the side channel
  answers HANDSHAKE (agent metadata + geometry, refused on a compatibility
  mismatch), RENEW, CONFIRM and RELEASE; ``get_finished`` reports released
  and expired leases in ``done_sending``.
- **consumer**: each load goes HANDSHAKE -> READING -> CONFIRMING -> DONE,
  or FAILED from any stage. Handshakes and lease RPCs run on a small thread
  pool, never on the engine thread; posting a request's reads is one
  ``read_prepared`` call (vectorised index math plus one C loop), done on
  the engine thread when the peer is known, on the RPC thread that finished
  the handshake otherwise. Completion arrives on the transport's progress
  thread; confirmations are batched per peer (one CONFIRM+RELEASE round
  trip for every request that completed since the last one).

Guarantees, and where they are kept:

- ``done_recving`` without load errors only after the producer confirmed
  the lease was held during the whole read (``_confirm``).
- A failed, unconfirmed, refused or unreachable load is reported in
  ``done_recving`` *and* its blocks in ``get_block_ids_with_load_errors``,
  in the same step (``get_finished``); the deadlines (read: the transport's
  per-transfer ``timeout_s``; handshake and confirmation: ``load_timeout_s``)
  bound when.
- An aborted request is reported in ``done_sending`` (its blocks handed
  back) only once its transfer completed or failed (``_abort``).
- Nothing raises into the engine loop: every step entry point catches,
  logs, and turns the failure into load errors.

Peers (side-channel clients, handshakes, failed peers) are
``handshakes.PeerHandshakes``, which this class inherits. Load-failure
warnings are rate-limited per producer (``lograte``).

Lock discipline: ``self._lock`` guards load and peer state; the transport
is never called while holding it (its completion callbacks take it).

Imports the standard library, numpy, ``rdma_kv.errors`` and the connector's
``config``, ``geometry``, ``specs``, ``types`` and ``rdma.*`` modules; the
transport only through ``transport_api`` (the real ``Agent`` is created by
``connector.py``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from rdma_kv.connector.config import KVTransferConfig
from rdma_kv.connector.geometry import KVCacheGeometry, derive_geometry
from rdma_kv.connector.rdma import auth, wire
from rdma_kv.connector.rdma.clients import ClientPool
from rdma_kv.connector.rdma.handshakes import PeerHandshakes
from rdma_kv.connector.rdma.lease_rpc import call_lease_rpc, refusal_reason, submit_lease_rpcs
from rdma_kv.connector.rdma.leases import LeaseTable
from rdma_kv.connector.rdma.loads import CONFIRMING, DONE, FAILED, HANDSHAKE, PEER_RETRY_S, READING, due_renewals
from rdma_kv.connector.rdma.loads import LoadState as _Load
from rdma_kv.connector.rdma.loads import PeerState as _Peer
from rdma_kv.connector.rdma.lograte import RateLimitedWarnings
from rdma_kv.connector.rdma.meta import (
    LoadSpec,
    PeerAddress,
    RdmaConnectorMetadata,
    RdmaHandshakeMetadata,
    RemoteLease,
)
from rdma_kv.connector.rdma.producer import ProducerHandler
from rdma_kv.connector.rdma.planning import SlotTable, compat_info, count_runs
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.sidechannel import SideChannelServer
from rdma_kv.connector.rdma.stats import LoadStats, summarize
from rdma_kv.connector.rdma.transport_api import TransferHandle, Transport
from rdma_kv.connector.specs import KVCacheConfig
from rdma_kv.connector.types import BlockId, EngineId, RequestId
from rdma_kv.errors import NotInitializedError, PeerError

__all__ = ["RdmaWorker"]

logger = logging.getLogger(__name__)

class RdmaWorker(PeerHandshakes):
    """Worker-side logic; ``RdmaConnector`` delegates to it. On a producer,
    its side channel is served by a :class:`ProducerHandler` over the same
    lease table."""

    def __init__(
        self,
        config: KVTransferConfig,
        settings: RdmaSettings,
        kv_cache_config: KVCacheConfig,
        transport_factory: Callable[[str, RdmaSettings], Transport],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._settings = settings
        self._kv_cache_config = kv_cache_config
        self._transport_factory = transport_factory
        self._clock = clock
        self._engine_id = EngineId(str(config.engine_id))
        self._producer = config.is_kv_producer
        # Loaded here, once, and kept only in this object (never in settings,
        # params, metadata or logs; its repr hides the value).
        self._secret = auth.load_secret(settings.auth_secret_env, settings.auth_secret_file)
        self._lock = threading.RLock()
        self._transport: Transport | None = None
        self._geometry: KVCacheGeometry | None = None
        self._slots: SlotTable | None = None
        self._local_prep: Any = None
        self._compat: wire.CompatInfo | None = None
        self._server: SideChannelServer | None = None
        self.leases = LeaseTable(clock)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            settings.rpc_threads, thread_name_prefix=f"rdma-kv-rpc-{settings.tp_rank}")
        self._clients = ClientPool(self._make_client, clock=clock)
        self._failure_warnings = RateLimitedWarnings(logger, "KV load failures", clock=clock)
        self._peers: dict[tuple[str, str, int], _Peer] = {}
        self._loads: dict[RequestId, _Load] = {}
        self._finished: list[_Load] = []  # DONE or FAILED, to report
        self._aborted_done: set[RequestId] = set()
        self._load_errors: set[BlockId] = set()
        self._confirm_queue: dict[tuple[str, str, int], list[_Load]] = collections.defaultdict(list)
        self._confirm_scheduled: set[tuple[str, str, int]] = set()
        self._confirm_retry: list[tuple[_Peer, _Load]] = []
        self._stats = LoadStats()
        self.side_channel_handler: ProducerHandler | None = None  # producer, after register_kv_caches
        self._lease_stats_seen: collections.Counter[str] = collections.Counter()
        self._closed = False

    # --- startup -----------------------------------------------------------------------

    @property
    def agent_name(self) -> str:
        return f"{self._engine_id}/tp{self._settings.tp_rank}"

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        if self._transport is not None:
            raise NotInitializedError(
                "register_kv_caches() was already called on this worker: the engine keeps one KV "
                "connector per worker process (vLLM: one per process), so one process cannot hold "
                "two connector engines, such as a prefill LLM and a decode LLM; run each engine in "
                "its own process (docs/vllm.md, 'Offline LLM')")
        geometry = derive_geometry(kv_caches, self._kv_cache_config)
        # This rank's UCX context gets its own NICs (the GPU's, from the KV cache's device).
        transport = self._transport_factory(self.agent_name, self._settings.for_device(geometry.regions[0].device))
        try:
            for region in geometry.regions:
                transport.register((region.base_address, region.nbytes), memory_type=region.memory_type)
            slots = SlotTable(geometry)
            local_prep = transport.prep_local(slots.descs)
            compat = compat_info(self._kv_cache_config, geometry, self._settings.tp_size,
                                 self._settings.attention_backend)
            server = None
            if self._producer:
                port = self._settings.side_channel_port
                self.side_channel_handler = ProducerHandler(
                    self._engine_id, self._settings.tp_rank, self._settings.lease_ttl_s, self.leases, compat,
                    transport.metadata, geometry)
                server = SideChannelServer(
                    self.side_channel_handler, self._settings.side_channel_host,
                    port + self._settings.tp_rank if port else 0,
                    name=f"rdma-kv-sidechannel-{self._settings.tp_rank}", secret=self._secret)
        except BaseException:
            transport.close()
            raise
        self._transport, self._geometry, self._slots = transport, geometry, slots
        self._local_prep, self._compat, self._server = local_prep, compat, server
        logger.info("rdma-kv worker %s: %d layers in %d region(s), %d blocks, %d bytes per block; "
                    "side channel %s, peer authentication %s", self.agent_name, len(geometry.layers),
                    len(geometry.regions), slots.num_blocks, slots.bytes_per_block,
                    f"{server.host}:{server.port}" if server else "off (consumer only)",
                    f"on (secret from {self._secret.source})" if self._secret else "OFF")

    def handshake_metadata(self) -> RdmaHandshakeMetadata:
        compat = self._require_compat()
        port = self._server.port if self._server else 0
        return RdmaHandshakeMetadata(self._engine_id, self._settings.advertise_host, port,
                                     self._settings.tp_rank, compat.compat_hash())

    def _require_compat(self) -> wire.CompatInfo:
        if self._compat is None:
            raise NotInitializedError("the RDMA connector's worker has no KV caches; the engine "
                                      "must call register_kv_caches() at startup")
        return self._compat

    @property
    def side_channel_port(self) -> int | None:
        return self._server.port if self._server else None

    # --- every step: start_load_kv -------------------------------------------------------------

    def on_step(self, meta: RdmaConnectorMetadata) -> None:
        """Apply one step's metadata. Never raises: failures become load errors."""
        if self._closed:
            return
        if meta.lease_epoch:
            self.leases.set_epoch(meta.lease_epoch, meta.lease_key)
        for send in meta.sends:
            try:
                self.leases.grant(send.lease, send.block_ids, send.lease_ttl_s)
            except Exception:
                logger.exception("request %r: could not record its lease", send.request_id)
        if meta.releases:
            self._lease_rpc_async(wire.Release, meta.releases)
        if meta.renewals:
            self._lease_rpc_async(wire.Renew, meta.renewals)
        for rid in meta.aborts:
            self._abort(rid)
        for spec in meta.loads:
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
        load = _Load(spec, now + self._settings.load_timeout_s, now)
        with self._lock:
            if spec.request_id in self._loads:
                logger.warning("request %r: a load is already running; ignoring the second", spec.request_id)
                return
            self._loads[spec.request_id] = load
            if spec.error is not None:
                self._fail(load, f"the scheduler could not plan the load: {spec.error}")
                return
            key = self._peer_key(spec.peer)
            peer = self._peers.get(key)
            if peer is not None and peer.state == "failed":
                if now - peer.failed_at < PEER_RETRY_S:
                    self._fail(load, f"producer {spec.peer.engine_id!r} is unavailable: {peer.error}")
                    return
                del self._peers[key]
                peer = None
            if peer is None:
                peer = self._peers[key] = _Peer(spec.peer)
                peer.waiting.append(load)
                self._executor.submit(self._handshake, peer)
                return
            if peer.state == "connecting":
                peer.waiting.append(load)
                return
        self._post(load, peer)

    # --- reads -----------------------------------------------------------------------------------------

    def _post(self, load: _Load, peer: _Peer) -> None:
        """Post one request's reads. Called without the lock held."""
        spec = load.spec
        with self._lock:
            if load.stage != HANDSHAKE:
                return  # failed by its deadline meanwhile
            if load.aborted:
                self._finish_aborted(load)
                return
            load.stage = READING
        assert self._slots is not None and peer.slots is not None and self._transport is not None
        t0 = time.perf_counter()
        try:
            local_ids = np.asarray(spec.local_block_ids, dtype=np.int64)
            remote_ids = np.asarray(spec.remote_block_ids, dtype=np.int64)
            if local_ids.shape != remote_ids.shape:
                raise ValueError(f"{local_ids.size} local blocks but {remote_ids.size} remote blocks")
            local_idx = self._slots.indices(local_ids, "local")
            remote_idx = peer.slots.indices(remote_ids, "remote")
            xfer = self._transport.read_prepared(self._local_prep, local_idx, peer.prep, remote_idx,
                                                 timeout_s=self._settings.read_timeout_s)
        except Exception as exc:
            with self._lock:
                load.read_resolved = True
                self._fail(load, f"posting reads from {spec.peer.engine_id!r} failed: {exc}")
            if peer.name is not None and not isinstance(exc, (ValueError,)):
                self._peer_failed(peer, str(exc))
            return
        load.transfer = xfer
        load.stats.update(
            num_blocks=int(local_ids.size), block_runs=count_runs(local_ids, remote_ids, self._slots.num_rows),
            plan_s=time.perf_counter() - t0 - xfer.post_s, post_s=xfer.post_s,
        )
        xfer.add_done_callback(lambda x, load=load, peer=peer: self._on_read_done(load, peer, x))

    def _on_read_done(self, load: _Load, peer: _Peer, xfer: TransferHandle) -> None:
        """Transport progress thread: the reads completed or failed."""
        load.stats.update(nbytes=xfer.nbytes, num_descs=xfer.num_descs, ops_posted=xfer.ops_posted,
                          transfer_s=xfer.elapsed_s)
        if xfer.error is not None:
            with self._lock:
                load.read_resolved = True
                self._fail(load, f"reads from {load.spec.peer.engine_id!r} failed: {xfer.error}")
            self._peer_failed(peer, str(xfer.error))
            return
        with self._lock:
            load.read_resolved = True
            if load.stage != READING:
                return
            if load.error is not None:  # failed while the reads were in flight
                self._fail(load, load.error)
                return
            if load.aborted:
                self._finish_aborted(load)
                return
            load.stage = CONFIRMING
            load.stats["confirm_start"] = time.perf_counter()
            self._queue_confirm(peer, load)

    # --- validate after read ----------------------------------------------------------------------------

    def _queue_confirm(self, peer: _Peer, load: _Load) -> None:
        key = self._peer_key(peer.address)
        self._confirm_queue[key].append(load)
        if key not in self._confirm_scheduled:
            self._confirm_scheduled.add(key)
            self._executor.submit(self._confirm, peer, key)

    def _confirm(self, peer: _Peer, key: tuple[str, str, int]) -> None:
        with self._lock:
            self._confirm_scheduled.discard(key)
            batch = [ld for ld in self._confirm_queue.pop(key, []) if ld.stage == CONFIRMING]
        if not batch:
            return
        request = wire.Confirm(wire.PROTOCOL_VERSION,
                               [wire.LeaseWire.of(ld.spec.lease, ld.spec.claim) for ld in batch], release=True)
        try:
            statuses = self._client(peer.address).lease_call(request).statuses
        except Exception as exc:
            with self._lock:
                for load in batch:
                    self._fail(load, f"could not confirm the lease with {peer.address.engine_id!r}, so "
                                     f"the data read cannot be trusted: {exc}")
            if isinstance(exc, PeerError):
                # The producer is gone: drop its endpoint and rkeys now, not at
                # the next load (found by the fault tests: a producer killed
                # after the reads landed left its transport peer behind).
                self._peer_failed(peer, str(exc))
            return
        now = time.perf_counter()
        with self._lock:
            for load, status in zip(batch, statuses):
                if load.stage != CONFIRMING:
                    continue
                load.stats["confirm_s"] = now - load.stats.pop("confirm_start", now)
                if status is wire.LeaseStatus.HELD:
                    if load.aborted:
                        self._finish_aborted(load)
                    else:
                        load.stage = DONE
                        self._finished.append(load)
                elif status is wire.LeaseStatus.PENDING:
                    self._confirm_retry.append((peer, load))  # re-sent at the next step
                else:
                    reason = refusal_reason(status, peer.address.engine_id, load.spec.lease.generation)
                    self._fail(load, f"{reason}; the data read cannot be trusted, discarded", release=False)

    # --- endings (called with the lock held) ---------------------------------------------------------------

    def _fail(self, load: _Load, reason: str, *, release: bool = True) -> None:
        if load.stage in (DONE, FAILED):
            return
        if load.stage == READING and not load.read_resolved:
            # Reads can still land: defer until the transfer resolves (its
            # deadline bounds this); _on_read_done will fail it.
            load.error = load.error or reason
            return
        load.stage, load.error = FAILED, load.error or reason
        self._stats.counters["loads_failed"] += 1
        self._failure_warnings.warn(load.spec.peer.engine_id, "request %r: KV load failed: %s",
                                    load.spec.request_id, load.error)
        if release:
            self._lease_rpc_async(wire.Release, [load.spec.remote_lease])
        if load.aborted:
            self._loads.pop(load.spec.request_id, None)
            self._aborted_done.add(load.spec.request_id)
        else:
            self._finished.append(load)

    def _finish_aborted(self, load: _Load) -> None:
        if load.stage in (HANDSHAKE, READING, CONFIRMING):
            self._lease_rpc_async(wire.Release, [load.spec.remote_lease])
        load.stage = DONE
        self._loads.pop(load.spec.request_id, None)
        self._aborted_done.add(load.spec.request_id)
        self._stats.counters["loads_aborted"] += 1

    def _abort(self, rid: RequestId) -> None:
        """The scheduler finished ``rid`` while its load was handed to us."""
        with self._lock:
            load = self._loads.get(rid)
            if load is None:
                self._aborted_done.add(rid)  # nothing in flight: hand the blocks back now
                return
            load.aborted = True
            if load.stage == READING and not load.read_resolved:
                return  # _on_read_done finishes it once no read can land
            if load.stage in (DONE, FAILED):
                self._finished = [ld for ld in self._finished if ld is not load]
                self._loads.pop(rid, None)
                self._aborted_done.add(rid)
                return
            self._finish_aborted(load)

    # --- get_finished ---------------------------------------------------------------------------------------

    def get_finished(self) -> tuple[set[RequestId], set[RequestId]]:
        sending = self.leases.take_done() if self._producer else set()
        now = self._clock()
        with self._lock:
            for load in list(self._loads.values()):
                if load.stage in (HANDSHAKE, CONFIRMING) and now > load.deadline:
                    self._fail(load, f"not finished within load_timeout_s={self._settings.load_timeout_s} "
                                     f"(stage {load.stage})")
            recving: set[RequestId] = set()
            for load in self._finished:
                rid = load.spec.request_id
                recving.add(rid)
                self._loads.pop(rid, None)
                if load.stage == FAILED:
                    self._load_errors.update(load.spec.local_block_ids)
                self._record(load)
            self._finished = []
            sending |= self._aborted_done
            self._aborted_done = set()
            retry, self._confirm_retry = self._confirm_retry, []
            for peer, load in retry:
                if load.stage == CONFIRMING:
                    self._queue_confirm(peer, load)
            renew = self._due_renewals(now)
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

    def _due_renewals(self, now: float) -> list[RemoteLease]:
        return due_renewals(self._loads.values(), now, self._settings.renew_interval_for)

    def _lease_rpc_async(self, kind: type, leases: Iterable[RemoteLease]) -> None:
        if not self._closed:
            submit_lease_rpcs(self._executor, self._lease_rpc, kind, leases)

    def _lease_rpc(self, kind: type, address: PeerAddress, leases: list[RemoteLease]) -> None:
        refused = call_lease_rpc(self._client(address), kind, address, leases)
        if refused is None:
            return
        self._stats.counters[f"{kind.__name__.lower()}_rpcs"] += 1
        if refused and kind is wire.Renew:
            # A load not yet reading gives up now; one whose reads are in
            # flight learns the same from its CONFIRM, once no read can land.
            with self._lock:
                by_claim = {ld.spec.claim: ld for ld in self._loads.values()}
                for lease, status in refused:
                    load = by_claim.get(lease.claim)
                    if load is not None and load.stage == HANDSHAKE:
                        self._fail(load, refusal_reason(status, address.engine_id, lease.lease.generation),
                                   release=False)

    # --- stats and shutdown -----------------------------------------------------------------------------------

    def _record(self, load: _Load) -> None:
        self._stats.record(load.spec.request_id, load.stats, ok=load.stage == DONE,
                           total_s=self._clock() - load.created, error=load.error)

    def stats(self) -> dict[str, Any] | None:
        with self._lock:
            records, counters = self._stats.take()
        lease_stats = collections.Counter(self.leases.stats)  # producer: leases granted, released...
        for key, value in (lease_stats - self._lease_stats_seen).items():
            counters[f"leases_{key}"] = value
        self._lease_stats_seen = lease_stats
        summary = summarize(records, counters, leases_held=len(self.leases))
        if summary is not None:
            summary["resources"] = self.resources()
        return summary

    def resources(self) -> dict[str, int]:
        """What this worker holds now (leak checks): loads in flight, peers
        known, side-channel clients, leases and held blocks (producer), and,
        when the transport exposes them, registered regions, transport peers
        (endpoints) and transfers in flight."""
        with self._lock:
            out = {"inflight_loads": len(self._loads), "peers": len(self._peers),
                   "clients": len(self._clients), "unreported": len(self._finished),
                   "confirm_queue": sum(len(v) for v in self._confirm_queue.values())}
        out["leases"] = len(self.leases)
        out["held_blocks"] = len(self.leases.held_block_ids())
        transport = self._transport
        for name, attr in (("regions", "regions"), ("transport_peers", "peers"),
                           ("transfers_inflight", "inflight")):
            value = getattr(transport, attr, None) if transport is not None else None
            if value is not None:
                out[name] = value if isinstance(value, int) else len(value)
        return out

    def num_inflight(self) -> int:
        with self._lock:
            return len(self._loads)

    def reads_on_the_wire(self) -> list[str]:
        """Request ids (aborted ones included) whose read transfer the
        transport has not yet resolved: their blocks can still be written."""
        with self._lock:
            return sorted(rid for rid, ld in self._loads.items()
                          if ld.transfer is not None and not ld.transfer.done())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._clients.close()
        if self._transport is not None:
            self._transport.close()
