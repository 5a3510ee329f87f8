"""The RDMA connector's worker side: registration, then routing to its roles.

Owns :class:`RdmaWorker`, which ``RdmaConnector`` delegates to:

- **startup**: ``register_kv_caches`` derives the geometry, registers each
  distinct allocation once with a new transport and prepares the local
  slot table; the producer part then starts its side channel.
- **every step**: ``on_step`` hands the producer part its lease grants and
  epoch (``producer.RdmaProducer``), and the consumer part the producers to
  pre-connect to, then its loads, releases, renewals and aborts
  (``consumer.RdmaConsumer``).
- **reporting**: ``get_finished`` merges ``done_sending`` (leases released
  or expired, aborted loads) and ``done_recving``; ``stats`` and
  ``resources`` merge both parts' records.
- **sleep** (vLLM >= 0.33 sleep mode): ``unregister_kv_caches`` fails the
  loads in flight once no read can land, ends every lease (GONE), refuses
  handshakes and closes the transport (every region deregistered, every
  endpoint closed); ``restore_kv_caches`` registers the same KV caches with
  a new transport under the next *registration* (handshake metadata, the
  handshake reply and the params carry it), so no consumer reads with a
  remote key or a peer of the memory before the sleep.

A ``kv_both`` worker holds one part of each kind; a ``kv_consumer`` worker
has no producer part; a ``kv_producer`` worker makes a consumer part only
if its scheduler asks it to release a lease it was handed (a request with
``do_remote_prefill`` sent to a producer-only engine), to give the blocks
back before the lease expires.

The consumer part is built once the KV caches are registered, from one
frozen record (``consumer.LocalKV``), and again after each wake from sleep
(over the new transport). The worker owns what outlives one consumer: the
``consumer.LoadBook`` (loads finished and not yet reported, stats) and the
side-channel clients and RPC threads (``consumer.ClientPool``).

Where to look: a load's whole life, its failures and validate-after-read
are in ``consumer``; a lease's grant, renewal, confirmation and expiry in
``leases``; the side-channel answers in ``producer``.

Imports the standard library, ``rdma_kv.errors`` and the connector's
``config``, ``geometry``, ``specs``, ``types`` and ``rdma.*`` modules; the
transport only through ``transport_api`` (the real ``Agent`` is created by
``connector.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rdma_kv.connector.config import KVTransferConfig
from rdma_kv.connector.geometry import derive_geometry
from rdma_kv.connector.rdma import auth, wire
from rdma_kv.connector.rdma.compat import compat_info, group_heads, rank_info
from rdma_kv.connector.rdma.consumer import ClientPool, LoadBook, LocalKV, RdmaConsumer
from rdma_kv.connector.rdma.leases import LeaseTable
from rdma_kv.connector.rdma.meta import LayerPushSpec, RdmaConnectorMetadata, RdmaHandshakeMetadata, agent_name
from rdma_kv.connector.rdma.producer import ProducerHandler, RdmaProducer
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.sidechannel import SideChannelServer
from rdma_kv.connector.rdma.sideclient import SideChannelClient
from rdma_kv.connector.rdma.slots import SlotTable
from rdma_kv.connector.rdma.stats import GAUGE_REFRESH_S, PushRecord, WorkerStats
from rdma_kv.connector.rdma.transport_api import Transport
from rdma_kv.connector.specs import KVCacheConfig
from rdma_kv.connector.types import BlockId, EngineId, RequestId
from rdma_kv.errors import NotInitializedError, UCXError

__all__ = ["RdmaWorker"]

logger = logging.getLogger(__name__)


class RdmaWorker:
    """Worker-side logic; ``RdmaConnector`` delegates to it."""

    def __init__(
        self,
        config: KVTransferConfig,
        settings: RdmaSettings,
        kv_cache_config: KVCacheConfig,
        transport_factory: Callable[[str, RdmaSettings], Transport],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._kv_cache_config = kv_cache_config
        self._transport_factory = transport_factory
        self._clock = clock
        self._engine_id = EngineId(str(config.engine_id))
        # Loaded here, once, and kept only in the parts (never in settings,
        # params, metadata or logs; its repr hides the value).
        self._secret = auth.load_secret(settings.auth_secret_env, settings.auth_secret_file)
        self._transport: Transport | None = None  # None before registration and while asleep
        self._local: LocalKV | None = None  # likewise
        self._compat: wire.CompatInfo | None = None
        self._producer = (RdmaProducer(self._engine_id, settings, self._secret, clock)
                          if config.is_kv_producer else None)
        self._consumes = config.is_kv_consumer
        self._consumer: RdmaConsumer | None = None
        """Built at registration (a ``kv_producer`` worker: when first asked to release a lease)."""
        self._book = LoadBook()
        self._pool = ClientPool(self._make_client, clock=clock, threads=settings.rpc_threads,
                                thread_name=f"rdma-kv-rpc-{settings.tp_rank}")
        # What ``leases`` shows on a consumer-only worker: nothing grants into it.
        self._leases = self._producer.leases if self._producer is not None else LeaseTable(clock)
        self._closed = False
        self._kv_caches: Mapping[str, Any] | None = None
        self._registration = 1
        self._incarnation = secrets.token_bytes(wire.INCARNATION_BYTES)
        """Push mode: who this worker is to a producer, with its engine id and rank
        (two decodes given one engine id by mistake are told apart)."""
        self._asleep = False
        self._wedged: str | None = None
        """Why every sleep is refused: a close for sleep left the memory registered (a thread stuck in UCX)."""
        self._reported: tuple[int, dict[str, int]] | None = None
        """The leases held and resources in the last stats returned: gauges are
        sent again whenever they change, not only with an event."""
        self._reported_at = 0.0
        """When ``stats`` last reported the gauges (again every ``GAUGE_REFRESH_S``)."""
        self._bound_at: float | None = None
        """``perf_counter()`` when the step's metadata was bound (``bind``): where its loads' stages start."""
        self._idle_step = False  # the step being run computes nothing (``RdmaConnectorMetadata.idle``)

    def _new_consumer(self, local: LocalKV) -> RdmaConsumer:
        return RdmaConsumer(local, self._engine_id, self._settings, self._pool, self._book, self._clock,
                            self._registration, incarnation=self._incarnation)

    def _make_client(self, host: str, port: int) -> SideChannelClient:
        s = self._settings
        return SideChannelClient(host, port, connect_timeout_s=s.connect_timeout_s,
                                 rpc_timeout_s=s.rpc_timeout_s, retries=s.rpc_retries, secret=self._secret)

    # --- startup -----------------------------------------------------------------------

    @property
    def agent_name(self) -> str:
        return agent_name(self._engine_id, self._settings.tp_rank)

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        if self._asleep and not self._closed:
            # Handed over again while asleep (instead of restore_kv_caches): a wake
            # with these caches. Before, it registered under the old registration
            # number (peers kept the keys they cached) and left the worker asleep,
            # so the next sleep kept the memory registered (an adversarial review).
            self._registration += 1
            self._register(kv_caches)
            self._kv_caches, self._asleep = kv_caches, False
            return
        if self._transport is not None:
            raise NotInitializedError(
                "register_kv_caches() was already called on this worker: the engine keeps one KV "
                "connector per worker process (vLLM: one per process), so one process cannot hold "
                "two connector engines, such as a prefill LLM and a decode LLM; run each engine in "
                "its own process (docs/vllm.md, 'Offline LLM')")
        self._register(kv_caches)
        self._kv_caches = kv_caches

    def _register(self, kv_caches: Mapping[str, Any]) -> None:
        """Register ``kv_caches`` with a new transport; start (or resume) the parts."""
        geometry = derive_geometry(kv_caches, self._kv_cache_config)
        # This rank's UCX context gets its own NICs (the GPU's, from the KV cache's device).
        transport = self._transport_factory(self.agent_name, self._settings.for_device(geometry.regions[0].device))
        try:
            for region in geometry.regions:
                transport.register((region.base_address, region.nbytes), memory_type=region.memory_type)
            slots = SlotTable(geometry)
            local_prep = transport.prep_local(slots.descs)
            s = self._settings
            rank = rank_info(self._kv_cache_config, s.tp_rank, s.tp_size)
            compat = compat_info(self._kv_cache_config, geometry,
                                 s.total_kv_heads or rank.num_kv_heads * s.tp_size, s.attention_backend, s.mode,
                                 s.kv_cache_dtype, s.model_id, s.kv_cache_scales)
            if self._producer is not None:
                if self._producer.handler is None:
                    self._producer.start(compat, rank, transport, geometry)
                else:
                    self._producer.resume(transport, geometry, self._registration)
        except BaseException:
            transport.close()
            raise
        self._transport, self._compat = transport, compat
        self._local = LocalKV(transport, geometry, slots, local_prep, compat, rank,
                              group_heads(self._kv_cache_config))
        if self._consumes or self._consumer is not None:
            # A new consumer over the new transport; it reports what the one before the sleep
            # left, and asks the producers about the pushes that one left unresolved.
            before = self._consumer
            self._consumer = self._new_consumer(self._local)
            if before is not None and before.pushes is not None and self._consumer.pushes is not None:
                self._consumer.pushes.adopt(before.pushes)
        server = self._server
        logger.info("rdma-kv worker %s: %d layers in %d region(s), %d blocks, %d bytes per block; "
                    "side channel %s, peer authentication %s, registration %d", self.agent_name,
                    len(geometry.layers), len(geometry.regions), slots.num_blocks, slots.bytes_per_block,
                    f"{server.host}:{server.port}" if server else "off (consumer only)",
                    f"on (secret from {self._secret.source})" if self._secret else "OFF", self._registration)

    # --- sleep mode (vLLM >= 0.33) ----------------------------------------------------------------

    def unregister_kv_caches(self) -> None:
        """Before the engine sleeps (its KV memory is unmapped, or remapped
        after): fail every load in flight, once none of its reads can land
        (bounded by ``read_timeout_s``: closing the transport then fails
        them); end every lease the producer part holds (GONE); refuse
        handshakes; close the transport. Idempotent."""
        if self._wedged is not None:
            raise UCXError(self._wedged)
        transport = self._transport
        if transport is None or self._asleep or self._closed:
            return
        self._asleep = True
        if self._consumer is not None:
            self._consumer.suspend("the engine went to sleep (its KV cache is unregistered)",
                                   self._settings.read_timeout_s)
        if self._producer is not None:
            self._producer.suspend()
        self._transport = self._local = None
        transport.close()
        if transport.wedged():
            # Every later sleep is refused too (until the process restarts): the memory
            # stays registered with the stuck transport whatever happens next.
            self._wedged = (
                f"rdma-kv worker {self.agent_name}: its transport could not be closed cleanly for sleep (a "
                "thread is stuck in UCX, see the log): the KV memory stays registered with UCX and a stuck "
                "transfer could still write into it, so the engine must not free or reuse it; restart this "
                "engine instead of putting it to sleep")
            raise UCXError(self._wedged)
        if self._producer is not None:
            self._producer.suspended()
        logger.info("rdma-kv worker %s: KV cache unregistered for sleep (registration %d)", self.agent_name,
                    self._registration)

    def restore_kv_caches(self) -> None:
        """After the engine woke: register the same KV caches with a new
        transport, under the next registration. Idempotent."""
        if not self._asleep or self._closed or self._kv_caches is None:
            return
        self._registration += 1
        self._register(self._kv_caches)
        self._asleep = False

    def handshake_metadata(self) -> RdmaHandshakeMetadata:
        if self._compat is None:
            raise NotInitializedError("the RDMA connector's worker has no KV caches; the engine "
                                      "must call register_kv_caches() at startup")
        server = self._server
        return RdmaHandshakeMetadata(self._engine_id, self._settings.advertise_host,
                                     server.port if server else 0, self._settings.tp_rank,
                                     self._compat.compat_hash(), self._registration)

    # --- the producer part, as tests and the harness reach it ----------------------------------

    @property
    def leases(self) -> LeaseTable:
        """The producer's lease table (an empty one on a consumer-only worker)."""
        return self._leases

    @property
    def side_channel_handler(self) -> ProducerHandler | None:
        return self._producer.handler if self._producer is not None else None

    @property
    def _server(self) -> SideChannelServer | None:
        return self._producer.server if self._producer is not None else None

    @property
    def side_channel_port(self) -> int | None:
        server = self._server
        return server.port if server else None

    # --- every step: start_load_kv -------------------------------------------------------------

    def bind(self, layer_pushes: Sequence[LayerPushSpec]) -> None:
        """The step's metadata was bound, before its forward pass: note when
        (its loads' ``start_s`` runs from here); push mode: start its prefill
        chunks whose layers go out as they are stored. Never raises."""
        self._bound_at = time.perf_counter()
        if self._producer is not None and not self._closed:
            try:
                self._producer.begin_layers(layer_pushes)
            except Exception:
                logger.exception("starting the step's layer-wise writes failed")

    def save_layer(self, layer_name: str) -> None:
        """The engine stored ``layer_name`` in this step (push mode writes it). Never raises."""
        if self._producer is not None and not self._closed:
            try:
                self._producer.save_layer(layer_name)
            except Exception:
                logger.exception("writing layer %r to the decodes failed", layer_name)

    def end_step(self) -> None:
        """The step's forward pass ended. Never raises."""
        if self._producer is not None and not self._closed:
            try:
                self._producer.end_step()
            except Exception:
                logger.exception("ending the step's layer-wise writes failed")

    def on_step(self, meta: RdmaConnectorMetadata) -> None:
        """Apply one step's metadata. Never raises: failures become load errors."""
        seen, self._bound_at = self._bound_at, None
        self._idle_step = meta.idle
        if self._closed:
            return
        if self._producer is not None:
            self._producer.on_step(meta.lease_epoch, meta.lease_key, meta.sends, meta.reclaims)
        elif meta.sends:
            logger.error("%d lease grant(s) sent to the worker of a consumer-only engine; ignored",
                         len(meta.sends))
        if self._consumer is None and meta.releases and self._local is not None:
            self._consumer = self._new_consumer(self._local)
        if self._consumer is not None:
            for address in meta.connects:  # before the loads: one of them may read from it
                self._consumer.preconnect(address)
            self._consumer.on_step(meta.loads, meta.releases, meta.renewals, meta.aborts, seen)
        elif meta.loads or meta.renewals or meta.aborts or meta.releases:
            logger.error("loads, renewals, releases or aborts sent to the worker of %s; ignored",
                         "a producer-only engine" if not self._consumes else
                         "an engine that has not registered its KV caches (register_kv_caches() first)")

    # --- get_finished ---------------------------------------------------------------------------------------

    def get_finished(self) -> tuple[set[RequestId], set[RequestId]]:
        idle, self._idle_step = self._idle_step, False
        sending = self._producer.take_done() if self._producer is not None else set()
        if self._consumer is None:
            return sending, set()
        if idle and self._settings.idle_wait_s > 0:
            self._consumer.wait_idle(self._settings.idle_wait_s)
        return sending, self._consumer.get_finished()

    def take_load_errors(self) -> set[BlockId]:
        return self._book.take_load_errors()

    def take_failed_loads(self) -> set[RequestId]:
        return self._book.take_failed()

    # --- stats and shutdown -----------------------------------------------------------------------------------

    def stats(self) -> WorkerStats | None:
        """Both parts' records and counters since the last call, with the
        leases and resources held now; None if nothing happened and what is
        held is what the last stats said (an engine that steps with its
        transfers under way reports its gauges as they move, e.g. a push
        held by the decode until no write of it can land)."""
        records, totals = self._book.take_stats()
        pushes: tuple[PushRecord, ...] = ()
        if self._producer is not None:
            pushes = self._producer.take_push_records()
            totals = dataclasses.replace(totals, leases=self._producer.take_counters(),  # granted, released...
                                         push=totals.push + self._producer.take_push_counters())
        if self._consumer is not None and self._consumer.pushes is not None:
            totals = dataclasses.replace(totals, push=totals.push + self._consumer.pushes.take_counters())
        held, now = (len(self.leases), self.resources()), self._clock()
        if not records and not pushes and not totals.events() and held == self._reported \
                and now - self._reported_at < GAUGE_REFRESH_S:
            return None
        self._reported, self._reported_at = held, now
        # By TP rank: vLLM sums the ranks' reports of a step, and a rank that returned None keeps its
        # last value where the gauges are exported (a gauge is a value, not a count: WorkerStats.by_rank),
        # for GAUGE_STALE_S while the engine's other ranks report; a new incarnation replaces the old.
        rank = self._settings.tp_rank
        return WorkerStats(records, totals, held[0], held[1], pushes,
                           by_rank={rank: {"leases_held": held[0], **held[1]}},
                           incarnations={rank: self._incarnation.hex()})

    def resources(self) -> dict[str, int]:
        """What this worker holds now (leak checks): loads in flight, peers
        known, side-channel clients, leases and held blocks (producer), and,
        when the transport exposes them, registered regions, transport peers
        (endpoints) and transfers in flight. Every key is present whatever
        the role (0 for the part a worker does not have)."""
        out = {"inflight_loads": 0, "peers": 0, "clients": 0, "unreported": 0, "confirm_queue": 0, "pin_queue": 0,
               "word_slots_quarantined": 0}
        if self._consumer is not None:
            out.update(self._consumer.resources())
        out.update(self._producer.resources() if self._producer is not None
                   else {"leases": 0, "held_blocks": 0, "lease_age_max_ms": 0})
        transport = self._transport
        for name, attr in (("regions", "regions"), ("transport_peers", "peers"),
                           ("transfers_inflight", "inflight")):
            value = getattr(transport, attr, None) if transport is not None else None
            if value is not None:
                out[name] = value if isinstance(value, int) else len(value)
        return out

    def num_inflight(self) -> int:
        return self._book.num_loads()

    def reads_on_the_wire(self) -> list[str]:
        """Request ids (aborted ones included) whose read transfer the
        transport has not yet resolved: their blocks can still be written."""
        return self._book.reads_on_the_wire()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._producer is not None:
            self._producer.close()
        self._pool.close()
        if self._transport is not None:
            self._transport.close()
