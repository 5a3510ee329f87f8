"""``RdmaConnector``: the KV connector over one-sided UCX reads.

Owns only the delegation: a ``KVConnectorBase`` whose scheduler-side
methods go to :class:`~rdma_kv.connector.rdma.scheduler.RdmaScheduler` and
whose worker-side methods go to
:class:`~rdma_kv.connector.rdma.worker.RdmaWorker`, plus the default
transport (``rdma_kv.transport.Agent``, created lazily at
``register_kv_caches``). Roles: ``kv_producer`` (prefill), ``kv_consumer``
(decode), ``kv_both``. See ``docs/rdma-connector.md``.

Every entry point the engine calls during a step is guarded: an exception
is logged and becomes load errors, never an exception in the engine loop.

Imports the standard library, ``rdma_kv.errors``, the connector's ``base``,
``config``, ``specs``, ``types`` and ``rdma.*``; ``rdma_kv.transport``
lazily (only when a worker registers its KV caches).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rdma_kv.connector.base import (
    KVConnectorBase,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)
from rdma_kv.connector.config import KVTransferConfig
from rdma_kv.connector.rdma.meta import RdmaConnectorMetadata
from rdma_kv.connector.rdma.scheduler import RdmaScheduler
from rdma_kv.connector.rdma.settings import RdmaSettings
from rdma_kv.connector.rdma.transport_api import Transport, TransportFactory
from rdma_kv.connector.rdma.worker import RdmaWorker
from rdma_kv.connector.specs import KVCacheConfig
from rdma_kv.connector.types import (
    BlockId,
    KVCacheBlocks,
    KVConnectorOutput,
    Request,
    RequestId,
    SchedulerOutput,
)
from rdma_kv.errors import ConfigError

__all__ = ["RdmaConnector", "agent_transport"]

logger = logging.getLogger(__name__)


def agent_transport(name: str, settings: RdmaSettings) -> Transport:
    """The real transport: one UCX ``Agent`` with a progress thread."""
    from rdma_kv.transport import Agent, AgentConfig

    return Agent(name, AgentConfig(progress="thread", ucx_options=dict(settings.ucx_options),
                                   transfer_timeout_s=settings.read_timeout_s, lanes=settings.lanes,
                                   express=settings.express))


class RdmaConnector(KVConnectorBase):
    """Disaggregated prefill -> decode over one-sided reads; see the module docstring.

    ``transport_factory`` (keyword-only, not part of the engine contract)
    replaces the UCX agent, e.g. with a fake in unit tests.
    """

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None,
        *,
        transport_factory: TransportFactory | None = None,
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ConfigError("RdmaKVConnector needs the engine's KVCacheConfig")
        self._settings = RdmaSettings.from_config(config)
        self._scheduler: RdmaScheduler | None = None
        self._worker: RdmaWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = RdmaScheduler(config, self._settings, kv_cache_config)
        else:
            self._worker = RdmaWorker(config, self._settings, kv_cache_config,
                                      transport_factory or agent_transport)

    @property
    def settings(self) -> RdmaSettings:
        return self._settings

    @property
    def scheduler(self) -> RdmaScheduler:
        assert self._scheduler is not None
        return self._scheduler

    @property
    def worker(self) -> RdmaWorker:
        assert self._worker is not None
        return self._worker

    # --- either role -------------------------------------------------------------------

    def get_kv_connector_stats(self) -> Mapping[str, Any] | None:
        """Worker: per-request transfer records (bytes, descriptors, ops,
        contiguous block runs, post / transfer / confirm seconds) and totals,
        as the dict the engine carries (``stats.WorkerStats.to_dict``)."""
        stats = self._worker.stats() if self._worker is not None else None
        return stats.to_dict() if stats is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # --- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.handshake_metadata()

    def unregister_kv_caches(self) -> None:
        self.worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self.worker.restore_kv_caches()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step's metadata; push mode: this step's prefill chunks
        whose layers go to registered decodes as they are stored. Here, not
        in ``start_load_kv``: vLLM 0.32 starts asynchronous loads after the
        forward pass, once every ``save_kv_layer`` of the step has run."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, RdmaConnectorMetadata):
            self._worker.bind(connector_metadata.layer_pushes)

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Apply the step's metadata and post reads; returns at once (handshakes
        and lease RPCs run on the connector's threads)."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, RdmaConnectorMetadata):
            logger.error("RdmaConnector got %s metadata; ignoring the step", type(meta).__name__)
            return
        self.worker.on_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are asynchronous (whole requests, reported by get_finished)."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any = None,
                      **kwargs: Any) -> None:
        """Pull: nothing (consumers read the producer's blocks in place). Push,
        concurrent dispatch: the layer's complete blocks go to the decodes
        registered for this step's prefills (host KV caches; ``pusher``)."""
        if self._worker is not None:
            self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        """Nothing to wait for: the blocks stay held under a lease (layer-wise
        writes are sealed when the lease is granted, off the engine thread)."""
        if self._worker is not None:
            self._worker.end_step()

    def get_finished(self, finished_req_ids: set[RequestId] | frozenset[RequestId]
                     ) -> tuple[set[RequestId], set[RequestId]]:
        try:
            return self.worker.get_finished()
        except Exception:
            logger.exception("RdmaConnector.get_finished failed; reporting nothing this step")
            return set(), set()

    def get_block_ids_with_load_errors(self) -> set[BlockId]:
        return self.worker.take_load_errors()

    def take_failed_loads(self) -> set[RequestId]:
        """The requests whose load failed since the last call, each also in
        ``done_recving`` and its blocks in ``get_block_ids_with_load_errors``:
        for an engine that cannot map block ids back to requests (vLLM with
        several KV-cache groups: block ids are unique within a group only)
        and fails or recomputes a request as a whole."""
        return self.worker.take_failed_loads()

    # --- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        try:
            return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:
            logger.exception("request %r: get_num_new_matched_tokens failed; computing locally",
                             request.request_id)
            return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.update_connector_output(connector_output)

    def bind_free_blocks(self, free_blocks: Callable[[], int]) -> None:
        """Scheduler: how to read the engine's free KV-cache blocks, so that
        only a request short of blocks counts as memory pressure
        (``RdmaScheduler.bind_free_blocks``)."""
        self.scheduler.bind_free_blocks(free_blocks)

    def request_finished(self, request: Request, block_ids: Sequence[BlockId]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: Sequence[Sequence[BlockId]]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with the block ids of every KV-cache group
        (hybrid models; vLLM's ``SupportsHMA``): a sliding-window group is
        held, and offered to the consumer, from its window only."""
        return self.scheduler.request_finished(request, tuple(block_ids))

    def set_xfer_handshake_metadata(self, metadata: Mapping[int, KVConnectorHandshakeMetadata]) -> None:
        self.scheduler.set_handshake_metadata(metadata)
