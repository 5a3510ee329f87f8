"""``RdmaKVConnector``: rdma-kv's RDMA connector inside vLLM (v1 API, 0.32).

Owns the vLLM-facing class only: a ``KVConnectorBase_V1`` with vLLM's
3-argument constructor whose every method translates its arguments
(``translate.py``), calls the engine-neutral
:class:`~rdma_kv.connector.rdma.RdmaConnector` and translates the result
back. No transfer logic lives here. Metadata crossing vLLM's processes is
wrapped in vLLM's base types (``RdmaKVConnectorMetadata``,
``RdmaKVHandshakeMetadata``), both plain picklable dataclasses.

Imports vLLM's KV-connector base and ``rdma_kv.connector`` (the RDMA
connector, hence UCX, only when an instance is created).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from rdma_kv.connector.base import KVConnectorRole as Role
from rdma_kv.connector.types import RequestId, as_block_ids
from rdma_kv.errors import ConfigError
from rdma_kv.vllm import identity, translate
from rdma_kv.vllm.stats import RdmaKVConnectorStats, RdmaKVLoggedStats, RdmaKVPromMetrics

if TYPE_CHECKING:
    from rdma_kv.connector.rdma.connector import RdmaConnector
    from rdma_kv.connector.rdma.meta import RdmaConnectorMetadata, RdmaHandshakeMetadata

__all__ = ["RdmaKVConnector", "RdmaKVConnectorMetadata", "RdmaKVHandshakeMetadata"]

logger = logging.getLogger(__name__)

_ROLES = {KVConnectorRole.SCHEDULER: Role.SCHEDULER, KVConnectorRole.WORKER: Role.WORKER}


@dataclasses.dataclass(frozen=True)
class RdmaKVConnectorMetadata(KVConnectorMetadata):
    """One step's metadata, scheduler -> workers (the connector's own, wrapped)."""

    inner: RdmaConnectorMetadata


@dataclasses.dataclass(frozen=True)
class RdmaKVHandshakeMetadata(KVConnectorHandshakeMetadata):
    """A worker's side-channel address and compatibility hash, wrapped."""

    inner: RdmaHandshakeMetadata


def _log_through_vllm() -> None:
    """Send rdma-kv's log records to vLLM's handlers, once per process.

    rdma-kv only adds a ``NullHandler`` (a library does not configure
    logging), so without this its warnings (e.g. why a KV load failed)
    would be invisible in a vLLM server's log. vLLM is the application
    here: its ``vllm`` logger's handlers and level are reused, mirroring
    ``propagate=False``. Nothing is done when the application already
    gave ``rdma_kv`` a handler, or vLLM's logging is off
    (``VLLM_CONFIGURE_LOGGING=0``: no handlers to reuse).
    """
    ours, theirs = logging.getLogger("rdma_kv"), logging.getLogger("vllm")
    if any(not isinstance(h, logging.NullHandler) for h in ours.handlers) or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def _parallel(vllm_config: Any, role: KVConnectorRole) -> tuple[int, int, int]:
    """(tp_rank, tp_size, dp_rank) of this process, from vLLM's config."""
    parallel = vllm_config.parallel_config
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        raise ConfigError("RdmaKVConnector does not support pipeline parallelism "
                          f"(pipeline_parallel_size={parallel.pipeline_parallel_size})")
    tp_size = int(getattr(parallel, "tensor_parallel_size", 1))
    tp_rank = 0
    if role is KVConnectorRole.WORKER and tp_size > 1:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
    return tp_rank, tp_size, int(getattr(parallel, "data_parallel_rank", 0) or 0)


def _total_kv_heads(vllm_config: Any) -> int:
    """The model's KV heads before tensor parallelism (0: unknown, derived later)."""
    model = getattr(vllm_config, "model_config", None)
    try:
        return int(model.get_total_num_kv_heads()) if model is not None else 0
    except Exception:  # a model config without heads (e.g. a test double)
        return 0


def _kv_cache_dtype(vllm_config: Any) -> str:
    """vLLM's ``--kv-cache-dtype`` ("auto": the model's dtype, which the KV
    tensors carry; "fp8", "fp8_e4m3", "fp8_e5m2"... are all ``uint8``
    tensors, so the name is what tells two engines' bytes apart)."""
    cache = getattr(vllm_config, "cache_config", None)
    value = getattr(cache, "cache_dtype", None)
    return "" if value is None else str(value)


def _kv_cache_scales(vllm_config: Any, role: KVConnectorRole) -> str:
    """An fp8 cache's k/v scales (``identity.kv_cache_scales``), for the
    compatibility check; empty on the scheduler, which holds no layers."""
    return identity.kv_cache_scales(vllm_config) if role is KVConnectorRole.WORKER else ""


def _attention_backend(vllm_config: Any, role: KVConnectorRole) -> str:
    """The worker's attention backend name(s) (as NixlConnector reads them),
    for the compatibility check; empty on the scheduler, which checks none."""
    if role is not KVConnectorRole.WORKER:
        return ""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    return ",".join(sorted({backend.get_name() for backend in get_current_attn_backends(vllm_config)}))


class RdmaKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Disaggregated prefill -> decode over one-sided UCX reads; see
    ``docs/vllm.md``. Enable with ``kv_transfer_config={"kv_connector":
    "RdmaKVConnector", "kv_connector_module_path": "rdma_kv.vllm",
    "kv_role": "kv_producer" | "kv_consumer" | "kv_both"}``.

    A ``SupportsHMA`` connector: vLLM keeps its hybrid KV-cache manager on
    for models with sliding-window layers (several KV-cache groups, block
    ids per group) and calls ``request_finished_all_groups``."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        from rdma_kv.connector.rdma.connector import RdmaConnector

        _log_through_vllm()

        tp_rank, tp_size, dp_rank = _parallel(vllm_config, role)
        config = translate.transfer_config(vllm_config.kv_transfer_config, tp_rank=tp_rank,
                                           tp_size=tp_size, dp_rank=dp_rank,
                                           attention_backend=_attention_backend(vllm_config, role),
                                           total_kv_heads=_total_kv_heads(vllm_config),
                                           kv_cache_dtype=_kv_cache_dtype(vllm_config),
                                           model_id=identity.model_id(vllm_config),
                                           kv_cache_scales=_kv_cache_scales(vllm_config, role))
        if kv_cache_config is None:
            raise ConfigError("RdmaKVConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        ours = translate.kv_cache_config(kv_cache_config)
        self._connector: RdmaConnector = RdmaConnector(config, _ROLES[role], ours)
        self._per_request_failures = len(ours.kv_cache_groups) > 1
        """Failed loads go to vLLM as ``failed_recving``, not block ids (``get_transfer_results``)."""
        self._requests = translate.Requests()
        """Each request's checked prompt, kept between the scheduler hooks."""

    @property
    def connector(self) -> RdmaConnector:
        """The engine-neutral connector this adapter drives."""
        return self._connector

    # --- either role ---------------------------------------------------------------

    def get_kv_connector_stats(self) -> RdmaKVConnectorStats | None:
        data = translate.stats_dict(self._connector.get_kv_connector_stats())
        return RdmaKVConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> RdmaKVConnectorStats:
        """What vLLM's API server logs an interval from (only there): see
        ``RdmaKVLoggedStats``."""
        return RdmaKVLoggedStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> RdmaKVPromMetrics:
        return RdmaKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self._connector.shutdown()

    # --- worker side -----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._connector.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> RdmaKVHandshakeMetadata | None:
        inner = self._connector.get_handshake_metadata()
        return None if inner is None else RdmaKVHandshakeMetadata(inner)

    # vLLM >= 0.33 sleep mode (0.32 never calls these): the worker calls
    # unregister_kv_caches before the KV memory is unmapped and
    # restore_kv_caches once it is mapped again; then the engine core hands
    # the scheduler the workers' new handshake metadata, whose registration
    # the params carry from then on.

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True

    def unregister_kv_caches(self) -> None:
        self._connector.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        self._connector.restore_kv_caches()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, RdmaKVConnectorMetadata):
            self._connector.bind_connector_metadata(connector_metadata.inner)
        else:
            logger.error("RdmaKVConnector got %s metadata; ignoring the step",
                         type(connector_metadata).__name__)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._connector.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._connector.has_connector_metadata():
            self._connector.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._connector.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._connector.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        self._connector.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """vLLM frees a finished request's blocks when it appears in
        ``finished_recving`` from every rank (its aggregator counts them):
        each rank reports every load there exactly once, an aborted one
        included, and never in ``finished_sending`` (``LoadBook.hand_back``).
        Before, an aborted load went to ``finished_sending``, and this
        adapter dropped the report of a rank that had already reported the
        load in ``finished_recving`` (vLLM would free the blocks twice): with
        tensor parallelism neither count completed and the blocks leaked."""
        sending, recving = self._connector.get_finished({RequestId(rid) for rid in finished_req_ids})
        if self._connector.worker.num_inflight():
            # vLLM's engine loop starts its next step at once, even when every
            # request waits for KV, so this thread holds the GIL nearly all the
            # time; CPython hands it to a waiting thread only after the switch
            # interval (5 ms). The connector's handshakes, completions and
            # confirmations run on threads of its own, and each of their GIL
            # hand-offs waited that long: a 20 ms handshake took 70-180 ms
            # inside vLLM. Releasing the GIL once per step while loads are in
            # flight lets them run now (docs/benchmarks.md, "First request").
            time.sleep(0)
        return translate.finished_sets(sending, recving)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.32's ``get_finished`` with ``failed_recving``. With several
        KV-cache groups (a hybrid model) vLLM refuses block-level load errors
        (block ids are unique within a group only: a ``RuntimeError`` that
        ends its engine loop, so a client sending params that cannot load
        took the decode engine down) and takes failed loads by request: it
        recomputes them from the start, or fails them, per its policy. A
        single-group engine keeps the block-level errors (recompute from the
        first bad block)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sending, recving = self.get_finished(finished_req_ids)
        failed = self._connector.take_failed_loads()  # taken either way: nothing accumulates
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()),
            failed_recving={str(r) for r in failed} if self._per_request_failures else set())

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._connector.get_block_ids_with_load_errors()  # taken either way
        return set() if self._per_request_failures else {int(b) for b in errors}

    # --- scheduler side ----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._connector.get_num_new_matched_tokens(self._requests.of(request),
                                                          num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self._connector.update_state_after_alloc(self._requests.of(request),
                                                 translate.block_ids(blocks), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> RdmaKVConnectorMetadata:
        inner = self._connector.build_connector_meta(translate.scheduler_output(scheduler_output))
        return RdmaKVConnectorMetadata(inner)

    def update_connector_output(self, connector_output: Any) -> None:
        self._connector.update_connector_output(translate.connector_output(connector_output))

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM binds its scheduler's block pool: a request vLLM asked about
        and left waiting is memory pressure (leases reclaimed) only if it
        needs more blocks than the pool has free. vLLM also leaves requests
        for the next step with blocks to spare (its token budget with chunked
        prefill off): a lease was ended for each such step."""
        super().bind_gpu_block_pool(gpu_block_pool)
        self._connector.bind_free_blocks(gpu_block_pool.get_num_free_blocks)

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, params)``: a prefill that asked ``do_remote_decode``
        is held under a lease and returns the params a router hands verbatim
        to the decode request (``do_remote_prefill: true``, ``remote_*``)."""
        return self._connector.request_finished(self._requests.finished(request),
                                                as_block_ids(block_ids))

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with one block-id list per KV-cache group
        (vLLM's hybrid KV-cache manager; a sliding-window group's list starts
        with null-block placeholders where the window has moved on)."""
        return self._connector.request_finished_all_groups(self._requests.finished(request),
                                                           translate.group_block_ids(block_ids))

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        self._connector.set_xfer_handshake_metadata(
            {rank: m.inner for rank, m in metadata.items() if isinstance(m, RdmaKVHandshakeMetadata)})


def _register_with_vllm() -> None:
    """Put ``RdmaKVConnector`` in vLLM's connector registry (once; a name
    already there is left alone). vLLM loads rdma-kv by
    ``kv_connector_module_path`` and needs no registry entry for that, but
    its ``MultiConnector`` rebuilds a child's stats in the API server by the
    child's class name, looked up in the registry: unregistered, the first
    stats report raised there and stopped the server's output handler
    (found by an adversarial review; ``tests/vllm/test_vllm_translate.py``)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(RdmaKVConnector.__name__, __name__, RdmaKVConnector.__name__)
    except ValueError:
        pass  # registered already (this module imported again, or by the engine's own entry points)


_register_with_vllm()
