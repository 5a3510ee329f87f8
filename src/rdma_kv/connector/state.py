"""The process's KV-transfer group: the one worker-side connector.

Owns the process-global connector that an engine's model code reaches
(``get_kv_transfer_group()``) from attention layers, its thread-safe
initialisation and its reset (for tests and shutdown).

Imports the standard library, ``rdma_kv.errors`` and the connector's
``base``, ``config``, ``factory`` and ``specs``.
"""

from __future__ import annotations

import threading

from rdma_kv.connector.base import KVConnectorBase, KVConnectorRole
from rdma_kv.connector.config import KVTransferConfig
from rdma_kv.connector.factory import KVConnectorFactory
from rdma_kv.connector.specs import KVCacheConfig
from rdma_kv.errors import ConfigError, NotInitializedError

__all__ = [
    "ensure_kv_transfer_initialized",
    "ensure_kv_transfer_shutdown",
    "get_kv_transfer_group",
    "has_kv_transfer_group",
    "is_v1_kv_transfer_group",
    "reset_kv_transfer_state",
]

_lock = threading.Lock()
_group: KVConnectorBase | None = None


def ensure_kv_transfer_initialized(
    config: KVTransferConfig | None,
    kv_cache_config: KVCacheConfig | None = None,
    role: KVConnectorRole = KVConnectorRole.WORKER,
) -> KVConnectorBase | None:
    """Create the process's connector once; return it (None when ``config``
    configures no transfer). A second call with an equal config returns the
    existing connector; with a different one it raises :class:`ConfigError`
    (call ``reset_kv_transfer_state`` first)."""
    global _group
    if config is None or not config.is_kv_transfer_instance:
        return None
    with _lock:
        if _group is not None:
            if _group.config != config or _group.role is not role:
                raise ConfigError(
                    "KV transfer is already initialized with a different config or role "
                    f"(engine_id {_group.config.engine_id!r}, role {_group.role.name}; "
                    f"asked for engine_id {config.engine_id!r}, role {role.name}); "
                    "call reset_kv_transfer_state() first"
                )
            return _group
        _group = KVConnectorFactory.create_connector(config, role, kv_cache_config)
        return _group


def get_kv_transfer_group() -> KVConnectorBase:
    """The process's connector; :class:`NotInitializedError` before
    ``ensure_kv_transfer_initialized``."""
    group = _group
    if group is None:
        raise NotInitializedError(
            "the KV transfer group is not initialized; call "
            "ensure_kv_transfer_initialized(config) with a config that sets "
            "kv_connector and kv_role"
        )
    return group


def has_kv_transfer_group() -> bool:
    return _group is not None


def is_v1_kv_transfer_group(connector: KVConnectorBase | None = None) -> bool:
    """Whether ``connector`` (default: the process's group) is a connector
    of this (v1) contract."""
    if connector is None:
        connector = _group
    return isinstance(connector, KVConnectorBase)


def ensure_kv_transfer_shutdown() -> None:
    """Shut down and forget the process's connector, if any."""
    reset_kv_transfer_state(shutdown=True)


def reset_kv_transfer_state(shutdown: bool = True) -> None:
    """Forget the process's connector (shutting it down first by default)."""
    global _group
    with _lock:
        group, _group = _group, None
    if group is not None and shutdown:
        group.shutdown()
