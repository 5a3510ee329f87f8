"""The KV-connector contract: ``KVConnectorBase``, roles and metadata.

Owns the abstract connector (the engine-neutral form of vLLM's
``KVConnectorBase_V1``), the role enum, the metadata base classes and the
role check that makes a scheduler-side call on a worker instance (or the
reverse) a :class:`~rdma_kv.errors.RoleError`. ``docs/connector-api.md``
is the long form of the specification in ``KVConnectorBase``'s docstring.

Imports the standard library, ``rdma_kv.errors`` and the connector's
``config``, ``specs`` and ``types``; never torch, vLLM or the transport.
"""

from __future__ import annotations

import abc
import enum
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

from rdma_kv.connector.config import KVTransferConfig
from rdma_kv.connector.specs import KVCacheConfig
from rdma_kv.connector.types import (
    BlockId,
    KVCacheBlocks,
    KVConnectorOutput,
    Request,
    RequestId,
    SchedulerOutput,
)
from rdma_kv.errors import ConfigError, NotInitializedError, RoleError

__all__ = [
    "KVConnectorBase",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "scheduler_side",
    "worker_side",
]

F = TypeVar("F", bound=Callable[..., Any])


class KVConnectorRole(enum.Enum):
    """Which half of the engine an instance serves; one instance per role."""

    SCHEDULER = 0
    """In the scheduler process: decides what to load, save and free."""
    WORKER = 1
    """In each worker process: moves the bytes of the KV cache."""


class KVConnectorMetadata:
    """Base of what a scheduler-side connector hands its workers each step
    (``build_connector_meta`` -> ``bind_connector_metadata``). Subclasses are
    frozen dataclasses; an engine may serialise them between processes."""


class KVConnectorHandshakeMetadata:
    """Base of what a worker publishes for peers to connect to it
    (``get_handshake_metadata`` -> the scheduler's ``set_xfer_handshake_metadata``)."""


# --- the role check ----------------------------------------------------------

_ROLE_ATTR = "__kv_connector_role__"
_METHOD_ROLES: dict[str, KVConnectorRole] = {}


def _role_checked(fn: F, role: KVConnectorRole) -> F:
    if getattr(fn, _ROLE_ATTR, None) is role:
        return fn

    @functools.wraps(fn)
    def checked(self: KVConnectorBase, *args: Any, **kwargs: Any) -> Any:
        own = getattr(self, "_role", None)
        if own is not role:
            if own is None:
                raise RoleError(
                    f"{type(self).__name__}.{fn.__name__}() called before "
                    "KVConnectorBase.__init__ set the role; call super().__init__() first"
                )
            raise RoleError(
                f"{type(self).__name__}.{fn.__name__}() is a {role.name.lower()}-side "
                f"method, but this instance has role {own.name}; call it on the "
                f"{role.name.lower()} connector instead"
            )
        return fn(self, *args, **kwargs)

    setattr(checked, _ROLE_ATTR, role)
    return cast(F, checked)  # functools.wraps keeps fn's signature


def scheduler_side(fn: F) -> F:
    """Mark a base method as callable only with role ``SCHEDULER``; overrides
    in subclasses inherit the check."""
    _METHOD_ROLES[fn.__name__] = KVConnectorRole.SCHEDULER
    return _role_checked(fn, KVConnectorRole.SCHEDULER)


def worker_side(fn: F) -> F:
    """Mark a base method as callable only with role ``WORKER``; overrides
    in subclasses inherit the check."""
    _METHOD_ROLES[fn.__name__] = KVConnectorRole.WORKER
    return _role_checked(fn, KVConnectorRole.WORKER)


class KVConnectorBase(abc.ABC):
    """A KV connector: moves KV-cache blocks between engine instances (or a
    store) on behalf of a paged-attention engine.

    **Roles.** The engine creates one instance per role from the same
    config: role ``SCHEDULER`` in the scheduler, role ``WORKER`` in every
    worker. Each method belongs to one role (below); calling it on an
    instance of the other role raises :class:`~rdma_kv.errors.RoleError`.
    Overrides in subclasses are checked too (``__init_subclass__`` wraps
    them). ``shutdown``, ``get_kv_connector_stats`` and the properties may be
    called on either role.

    **Scheduler side.**

    - ``get_num_new_matched_tokens(request, num_computed_tokens) -> (n, async)``:
      how many tokens beyond the ``num_computed_tokens`` already computed
      (block aligned) can be loaded externally. ``n`` is ``None`` when the
      connector cannot tell yet (the engine asks again later). ``async`` True
      means the load completes between steps: the request waits until the
      worker reports it in ``get_finished``'s ``done_recving``. ``(0, False)``
      when nothing can be loaded. May be called several times per request;
      must not have side effects the engine can observe.
    - ``update_state_after_alloc(request, blocks, num_external_tokens)``: after
      the engine allocated ``blocks`` (all of the request's blocks, token
      order) for the request; load ``num_external_tokens`` into them (0: load
      nothing, but the connector sees the blocks).
    - ``build_connector_meta(scheduler_output) -> KVConnectorMetadata``: once
      per step, after scheduling; hands the step's work to the workers and
      resets the per-step state. Must not modify ``scheduler_output``.
    - ``update_connector_output(output)``: the workers' ``KVConnectorOutput``
      of the step.
    - ``request_finished(request, block_ids) -> (delay_free, kv_transfer_params)``:
      exactly once per request, finished or aborted, before its blocks are
      freed. ``delay_free`` True makes the connector responsible: the blocks
      stay allocated until a worker reports the request in ``done_sending``.
      A request that waits for an asynchronous load keeps its blocks, even
      once finished (aborted, failed), until every worker reported it in
      ``done_recving``: the engine's rule (vLLM 0.32: a finished
      ``WAITING_FOR_REMOTE_KVS`` request), not a delay the connector asks for.
      ``kv_transfer_params`` (a new dict, or None) goes to the request's
      output, e.g. for a router to pass to a consumer. An engine with
      several KV-cache groups (hybrid models) calls
      ``request_finished_all_groups(request, block_ids_per_group)`` instead.
    - ``set_xfer_handshake_metadata(metadata)``: the workers' handshake
      metadata, by worker rank, gathered by the engine at startup.

    **Worker side.**

    - ``register_kv_caches(kv_caches)``: once at startup, every layer's KV
      tensor by layer name.
    - ``get_handshake_metadata()``: after registration; what peers need.
    - ``bind_connector_metadata(metadata)`` before and
      ``clear_connector_metadata()`` after each forward step;
      ``_get_connector_metadata()`` inside the connector while bound.
    - ``start_load_kv(forward_context, **kwargs)``: starts the step's loads;
      before the forward pass, or (vLLM 0.32, when every load of the step is
      asynchronous) after it was launched: work that must precede the
      layers belongs in ``bind_connector_metadata``.
    - ``wait_for_layer_load(layer_name)``: in each attention layer before it
      reads the KV cache.
    - ``save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)``: in
      each attention layer after it wrote its KV.
    - ``wait_for_save()``: as the forward step ends; the KV cache may be
      overwritten once it returns.
    - ``get_finished(finished_req_ids) -> (done_sending, done_recving)``:
      after each step with the requests finished since the last call;
      returns the requests whose asynchronous sends / loads completed. A
      request is reported in ``done_sending`` only if ``request_finished``
      delayed its free, and at most once; a load, in ``done_recving``
      exactly once per worker, whether it completed, failed or its request
      was aborted (then once none of its reads can still land).
    - ``get_block_ids_with_load_errors()``: after ``get_finished``; blocks
      whose load failed since the last call, no later than the step in which
      their request appears in ``done_recving``.

    **Step order** (one engine step): scheduler ``get_num_new_matched_tokens``
    / ``update_state_after_alloc`` for admitted requests, then
    ``build_connector_meta``; worker ``bind_connector_metadata`` ->
    ``start_load_kv`` (or after the layers) -> per layer ``wait_for_layer_load`` / ``save_kv_layer``
    -> ``wait_for_save`` -> ``get_finished`` -> ``get_block_ids_with_load_errors``
    -> ``clear_connector_metadata``; scheduler ``update_connector_output``,
    then ``request_finished`` for requests that finished.

    The constructor takes ``(config, role, kv_cache_config)``; subclasses
    keep that signature so the factory can build them.
    """

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None,
    ) -> None:
        if not isinstance(role, KVConnectorRole):
            raise ConfigError(f"role must be a KVConnectorRole, got {role!r}")
        if not isinstance(config, KVTransferConfig):
            raise ConfigError(f"config must be a KVTransferConfig, got {type(config).__name__}")
        if kv_cache_config is not None and not isinstance(kv_cache_config, KVCacheConfig):
            raise ConfigError(
                f"kv_cache_config must be a KVCacheConfig or None, got "
                f"{type(kv_cache_config).__name__}"
            )
        self._role = role
        self._config = config
        self._kv_cache_config = kv_cache_config
        self._connector_metadata: KVConnectorMetadata | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, role in _METHOD_ROLES.items():
            fn = cls.__dict__.get(name)
            if callable(fn) and not isinstance(fn, (staticmethod, classmethod)):
                setattr(cls, name, _role_checked(fn, role))

    # --- either role ----------------------------------------------------------

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    @property
    def config(self) -> KVTransferConfig:
        return self._config

    @property
    def kv_cache_config(self) -> KVCacheConfig | None:
        return self._kv_cache_config

    def get_kv_connector_stats(self) -> Mapping[str, Any] | None:
        """Stats collected since the last call, or None when there are none."""
        return None

    def shutdown(self) -> None:
        """Finish or cancel outstanding work and release resources. Idempotent."""
        return None

    # --- worker side ------------------------------------------------------------

    @worker_side
    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Receive every layer's KV tensor (torch tensor or numpy array)."""
        return None

    @worker_side
    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """What peers need to connect to this worker; None when nothing."""
        return None

    @classmethod
    def supports_sleep_mode(cls, config: KVTransferConfig) -> bool:
        """Whether the connector follows the KV cache through sleep mode
        (``unregister_kv_caches`` before the memory is unmapped,
        ``restore_kv_caches`` after it is mapped again). vLLM 0.33's default
        is True; a connector that registers KV memory with a NIC and keeps
        no-op hooks would then publish keys to memory that is gone."""
        return True

    @worker_side
    def unregister_kv_caches(self) -> None:
        """Before sleep: drop every registration of the KV caches (transfers
        are drained by the engine). Idempotent."""
        return None

    @worker_side
    def restore_kv_caches(self) -> None:
        """After wake: register the KV caches again; peers must load the new
        registration. Idempotent."""
        return None

    @worker_side
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind the step's metadata from ``build_connector_meta``."""
        if not isinstance(connector_metadata, KVConnectorMetadata):
            raise ConfigError(
                f"connector metadata must be a KVConnectorMetadata, got "
                f"{type(connector_metadata).__name__}"
            )
        self._connector_metadata = connector_metadata

    @worker_side
    def clear_connector_metadata(self) -> None:
        """Unbind the step's metadata after the forward step."""
        self._connector_metadata = None

    @worker_side
    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    @worker_side
    def _get_connector_metadata(self) -> KVConnectorMetadata:
        """The bound metadata; for use inside the connector during a step."""
        if self._connector_metadata is None:
            raise NotInitializedError(
                f"{type(self).__name__} has no connector metadata bound; the engine must "
                "call bind_connector_metadata() before the forward step"
            )
        return self._connector_metadata

    @worker_side
    @abc.abstractmethod
    def start_load_kv(self, forward_context: Any = None, **kwargs: Any) -> None:
        """Start the step's loads into the paged KV cache (may be asynchronous)."""

    @worker_side
    @abc.abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s loads of this step have landed."""

    @worker_side
    @abc.abstractmethod
    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any = None, **kwargs: Any
    ) -> None:
        """Start saving ``layer_name``'s KV of this step (may be asynchronous)."""

    @worker_side
    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """Block until the step's saves no longer need the KV cache."""

    @worker_side
    def get_finished(
        self, finished_req_ids: set[RequestId] | frozenset[RequestId]
    ) -> tuple[set[RequestId], set[RequestId]]:
        """``(done_sending, done_recving)``: requests whose asynchronous sends
        and loads completed since the last call. Empty sets, never None."""
        return set(), set()

    @worker_side
    def get_block_ids_with_load_errors(self) -> set[BlockId]:
        """Blocks whose load failed since the last call (and forget them)."""
        return set()

    # --- scheduler side --------------------------------------------------------

    @scheduler_side
    @abc.abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens loadable beyond ``num_computed_tokens``, and whether asynchronously."""

    @scheduler_side
    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Record the blocks allocated for ``request`` and what to load into them."""

    @scheduler_side
    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's metadata for the workers; resets per-step state."""

    @scheduler_side
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' report for the step."""
        return None

    @scheduler_side
    def request_finished(
        self, request: Request, block_ids: Sequence[BlockId]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, kv_transfer_params)`` for a finished or aborted request."""
        return False, None

    @scheduler_side
    def request_finished_all_groups(
        self, request: Request, block_ids: Sequence[Sequence[BlockId]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with the request's block ids per KV-cache group
        (hybrid models; vLLM's ``SupportsHMA``). The default serves connectors
        of one group; a connector that handles several overrides it."""
        if len(block_ids) != 1:
            raise ConfigError(
                f"{type(self).__name__} supports one KV-cache group, got block ids of "
                f"{len(block_ids)}; run the engine without its hybrid KV-cache manager"
            )
        return self.request_finished(request, block_ids[0])

    @scheduler_side
    def set_xfer_handshake_metadata(
        self, metadata: Mapping[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """The workers' handshake metadata by worker rank."""
        return None
