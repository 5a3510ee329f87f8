"""MultiConnector: several connectors behind one, e.g. RDMA over a disk cache.

Owns the composition rules. Children come from
``kv_connector_extra_config["connectors"]``, a list of KV-transfer config
dicts (each child inherits the parent's ``engine_id`` and ``kv_role`` unless
it sets its own):

- load: every child is asked ``get_num_new_matched_tokens`` (as vLLM's
  MultiConnector does); the first, in config order, that reports tokens
  loads; the choice is remembered per request and only that child is told
  to load;
- save: every child sees every step (each decides what to save);
- free: a request's blocks stay allocated while any child delays their
  free, and the request counts as finished sending only when every child
  that delayed it has reported it in ``done_sending`` (the scheduler side
  tells the workers which children those are, through the step metadata);
  ``request_finished_all_groups`` (several KV-cache groups) follows the
  same rules, each child given every group;
- ``kv_transfer_params`` of the children are combined (a key set by two
  children is a configuration error), as are load errors, handshake
  metadata (per child) and stats.

Imports the standard library, ``rdma_kv.errors`` and the connector's
``base``, ``config``, ``factory``, ``specs`` and ``types``.
"""

from __future__ import annotations

import dataclasses
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
from rdma_kv.connector.factory import KVConnectorFactory
from rdma_kv.connector.specs import KVCacheConfig
from rdma_kv.connector.types import (
    BlockId,
    KVCacheBlocks,
    KVConnectorOutput,
    Request,
    RequestId,
    SchedulerOutput,
)
from rdma_kv.errors import ConfigError, MetadataError

__all__ = ["MultiConnector", "MultiKVConnectorHandshakeMetadata", "MultiKVConnectorMetadata"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MultiKVConnectorMetadata(KVConnectorMetadata):
    """Each child's metadata, in child order, plus the delayed frees
    decided since the previous step: request id -> indices of the children
    that must each report it in ``done_sending``."""

    children: tuple[KVConnectorMetadata, ...]
    delayed_sends: Mapping[RequestId, tuple[int, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class MultiKVConnectorHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Each child's handshake metadata (None where a child has none)."""

    children: tuple[KVConnectorHandshakeMetadata | None, ...]


def child_configs(config: KVTransferConfig) -> list[KVTransferConfig]:
    """The children's configs, parsed and validated."""
    unknown = sorted(set(config.kv_connector_extra_config) - {"connectors"})
    if unknown:
        raise ConfigError(
            f"MultiConnector: unknown kv_connector_extra_config key(s) {unknown}; its only key "
            "is 'connectors': a child's settings go in that child's own "
            "kv_connector_extra_config"
        )
    raw = config.get_extra("connectors", type=tuple)
    if not raw:
        raise ConfigError(
            "MultiConnector needs kv_connector_extra_config['connectors'], a non-empty "
            "list of KV-transfer config dicts"
        )
    children = []
    for index, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise ConfigError(
                f"kv_connector_extra_config['connectors'][{index}] must be a dict, "
                f"got {type(item).__name__}"
            )
        data = {"engine_id": config.engine_id, "kv_role": config.kv_role, **item}
        try:
            children.append(KVTransferConfig.from_dict(data))
        except ConfigError as exc:
            raise ConfigError(f"kv_connector_extra_config['connectors'][{index}]: {exc}") from None
    return children


class MultiConnector(KVConnectorBase):
    """Several connectors used together; see the module docstring for the rules."""

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None,
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        self._children: list[KVConnectorBase] = []
        try:
            for child_config in child_configs(config):
                self._children.append(
                    KVConnectorFactory.create_connector(child_config, role, kv_cache_config)
                )
        except BaseException:
            for child in self._children:
                child.shutdown()
            raise
        names = [c.config.kv_connector or "" for c in self._children]
        self._labels = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
        # Scheduler side: the child chosen to load each request, and frees
        # delayed since the last step (shipped in the next metadata).
        self._load_child: dict[RequestId, int] = {}
        self._new_delays: dict[RequestId, tuple[int, ...]] = {}
        # Worker side: children that still have to report each delayed request.
        self._awaiting_senders: dict[RequestId, set[int]] = {}

    @property
    def children(self) -> tuple[KVConnectorBase, ...]:
        return tuple(self._children)

    # --- either role ----------------------------------------------------------

    def get_kv_connector_stats(self) -> Mapping[str, Any] | None:
        stats = {
            label: child_stats
            for label, child in zip(self._labels, self._children)
            if (child_stats := child.get_kv_connector_stats()) is not None
        }
        return stats or None

    def shutdown(self) -> None:
        """Shut down every child; re-raise the first failure after trying all."""
        first: BaseException | None = None
        for child in self._children:
            try:
                child.shutdown()
            except Exception as exc:  # keep shutting the others down
                logger.exception("shutting down %s failed", type(child).__name__)
                first = first or exc
        if first is not None:
            raise first

    # --- worker side ------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        for child in self._children:
            child.register_kv_caches(kv_caches)

    @classmethod
    def supports_sleep_mode(cls, config: KVTransferConfig) -> bool:
        """Only if every child does."""
        return all(KVConnectorFactory.get_connector_class(child).supports_sleep_mode(child)
                   for child in child_configs(config))

    def unregister_kv_caches(self) -> None:
        for child in self._children:
            child.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        for child in self._children:
            child.restore_kv_caches()

    def get_handshake_metadata(self) -> MultiKVConnectorHandshakeMetadata | None:
        parts = tuple(child.get_handshake_metadata() for child in self._children)
        if all(part is None for part in parts):
            return None
        return MultiKVConnectorHandshakeMetadata(parts)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(connector_metadata, MultiKVConnectorMetadata) or len(
            connector_metadata.children
        ) != len(self._children):
            raise MetadataError(
                f"MultiConnector with {len(self._children)} children expects a "
                f"MultiKVConnectorMetadata with as many parts, got {connector_metadata!r}"
            )
        for request_id, senders in connector_metadata.delayed_sends.items():
            self._awaiting_senders[request_id] = set(senders)
        for child, part in zip(self._children, connector_metadata.children):
            child.bind_connector_metadata(part)
        super().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        for child in self._children:
            child.clear_connector_metadata()
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        for child in self._children:
            child.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for child in self._children:
            child.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any = None, **kwargs: Any
    ) -> None:
        for child in self._children:
            child.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        for child in self._children:
            child.wait_for_save()

    def get_finished(
        self, finished_req_ids: set[RequestId] | frozenset[RequestId]
    ) -> tuple[set[RequestId], set[RequestId]]:
        done_sending: set[RequestId] = set()
        done_recving: set[RequestId] = set()
        for index, child in enumerate(self._children):
            sending, recving = child.get_finished(finished_req_ids)
            done_recving.update(recving or ())  # only the chosen child loads
            for request_id in sending or ():
                awaiting = self._awaiting_senders.get(request_id)
                if awaiting is None or index not in awaiting:
                    # The scheduler never waits for this report: passing it on
                    # would free blocks another child may still be reading.
                    logger.warning(
                        "%s reported request %r finished sending, but it did not delay "
                        "that request's free; ignored",
                        self._labels[index], request_id,
                    )
                    continue
                awaiting.discard(index)
                if not awaiting:
                    del self._awaiting_senders[request_id]
                    done_sending.add(request_id)
        return done_sending, done_recving

    def get_block_ids_with_load_errors(self) -> set[BlockId]:
        errors: set[BlockId] = set()
        for child in self._children:
            errors |= child.get_block_ids_with_load_errors()
        return errors

    # --- scheduler side --------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Every child is asked, as vLLM's MultiConnector does (a child may
        learn from the question, e.g. the RDMA producer that a request waits
        for blocks); the first (config order) that reports tokens wins. A
        child that cannot tell yet (None) makes the answer None."""
        self._load_child.pop(request.request_id, None)
        answer: tuple[int | None, bool] = (0, False)
        chosen = None
        for index, child in enumerate(self._children):
            num_tokens, load_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if num_tokens is None:
                return None, False
            if chosen is None and num_tokens > 0:
                chosen, answer = index, (num_tokens, load_async)
        if chosen is not None:
            self._load_child[request.request_id] = chosen
        return answer

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        chosen = self._load_child.get(request.request_id)
        for index, child in enumerate(self._children):
            # Every child sees the real blocks; only the chosen one loads.
            child.update_state_after_alloc(
                request, blocks, num_external_tokens if index == chosen else 0
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MultiKVConnectorMetadata:
        parts = tuple(child.build_connector_meta(scheduler_output) for child in self._children)
        delays, self._new_delays = self._new_delays, {}
        return MultiKVConnectorMetadata(parts, delays)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for child in self._children:
            child.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: Sequence[BlockId]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, lambda child: child.request_finished(request, block_ids))

    def request_finished_all_groups(
        self, request: Request, block_ids: Sequence[Sequence[BlockId]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Every child hears the request's block ids per KV-cache group (a
        child of one group takes a single group and refuses several)."""
        return self._finished(request, lambda child: child.request_finished_all_groups(request, block_ids))

    def _finished(
        self, request: Request, finish: Callable[[KVConnectorBase], tuple[bool, dict[str, Any] | None]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Tell every child; delay the free while any child delays it, and
        merge the children's params (a key set by two children is an error)."""
        self._load_child.pop(request.request_id, None)
        delaying: list[int] = []
        params: dict[str, Any] | None = None
        owner: dict[str, str] = {}
        for index, child in enumerate(self._children):
            delay, child_params = finish(child)
            if delay:
                delaying.append(index)
            if child_params:
                for key in child_params:
                    if key in owner:
                        raise ConfigError(
                            f"kv_transfer_params key {key!r} of request {request.request_id!r} "
                            f"is set by both {owner[key]} and {self._labels[index]}; "
                            "configure the children to use distinct keys"
                        )
                    owner[key] = self._labels[index]
                params = {**(params or {}), **child_params}
        if delaying:
            self._new_delays[request.request_id] = tuple(delaying)
        return bool(delaying), params

    def set_xfer_handshake_metadata(
        self, metadata: Mapping[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Hand each child the parts of every rank's metadata that are its own."""
        per_child: list[dict[int, KVConnectorHandshakeMetadata]] = [{} for _ in self._children]
        for rank, value in metadata.items():
            if not isinstance(value, MultiKVConnectorHandshakeMetadata) or len(
                value.children
            ) != len(self._children):
                raise MetadataError(
                    f"rank {rank}: expected MultiKVConnectorHandshakeMetadata with "
                    f"{len(self._children)} parts, got {value!r}"
                )
            for index, part in enumerate(value.children):
                if part is not None:
                    per_child[index][rank] = part
        for child, parts in zip(self._children, per_child):
            child.set_xfer_handshake_metadata(parts)
