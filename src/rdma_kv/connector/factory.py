"""KVConnectorFactory: connectors by registered name or module path, loaded lazily.

Owns the registry of connector names and the resolution of a
``KVTransferConfig`` to a connector class: ``kv_connector_module_path``
wins (the class named ``kv_connector`` inside that module), otherwise the
registered name. Registering a name imports nothing; the module is
imported on first use, so a connector whose dependencies are missing
costs nothing until it is asked for.

Imports the standard library, ``rdma_kv.errors`` and the connector's
``base``, ``config`` and ``specs`` (connector modules only lazily).
"""

from __future__ import annotations

import importlib
import inspect
import threading
from typing import ClassVar

from rdma_kv.connector.base import KVConnectorBase, KVConnectorRole
from rdma_kv.connector.config import KVTransferConfig
from rdma_kv.connector.specs import KVCacheConfig
from rdma_kv.errors import ConfigError, ConnectorLoadError

__all__ = ["KVConnectorFactory"]


class KVConnectorFactory:
    """Registry and builder of connectors (class-level; one per process)."""

    _registry: ClassVar[dict[str, tuple[str, str]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``name`` as ``module_path.class_name``, imported on first use."""
        for label, value in (("name", name), ("module_path", module_path),
                             ("class_name", class_name)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"connector {label} must be a non-empty string, got {value!r}")
        with cls._lock:
            if name in cls._registry:
                raise ConfigError(
                    f"connector {name!r} is already registered as "
                    f"{'.'.join(cls._registry[name])}"
                )
            cls._registry[name] = (module_path, class_name)

    @classmethod
    def unregister_connector(cls, name: str) -> None:
        """Remove ``name`` (for tests and plugins that replace a connector)."""
        with cls._lock:
            if cls._registry.pop(name, None) is None:
                raise ConfigError(f"connector {name!r} is not registered")

    @classmethod
    def registered_names(cls) -> list[str]:
        with cls._lock:
            return sorted(cls._registry)

    @classmethod
    def get_connector_class(cls, config: KVTransferConfig) -> type[KVConnectorBase]:
        """The class ``config`` names, imported now; :class:`ConnectorLoadError`
        when it cannot be found, imported or is not a concrete connector."""
        name = config.kv_connector
        if name is None:
            raise ConfigError("kv_connector is not set; no connector to create")
        if config.kv_connector_module_path is not None:
            module_path, class_name = config.kv_connector_module_path, name
        else:
            with cls._lock:
                entry = cls._registry.get(name)
            if entry is None:
                raise ConnectorLoadError(
                    f"unknown connector {name!r}; registered connectors are "
                    f"{cls.registered_names()}, or set kv_connector_module_path to the "
                    f"module that defines class {name!r}"
                )
            module_path, class_name = entry
        return _load_class(name, module_path, class_name)

    @classmethod
    def create_connector(
        cls,
        config: KVTransferConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> KVConnectorBase:
        """Build the connector ``config`` names for ``role``."""
        if not config.is_kv_transfer_instance:
            raise ConfigError(
                "cannot create a connector: kv_connector and kv_role must both be set "
                f"(kv_connector={config.kv_connector!r}, kv_role={config.kv_role!r})"
            )
        connector_cls = cls.get_connector_class(config)
        return connector_cls(config, role, kv_cache_config)


def _load_class(name: str, module_path: str, class_name: str) -> type[KVConnectorBase]:
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as exc:
        if exc.name and (module_path == exc.name or module_path.startswith(exc.name + ".")):
            raise ConnectorLoadError(
                f"connector {name!r}: module {module_path!r} not found; is the package "
                "that provides it installed and importable in this process?"
            ) from exc
        raise ConnectorLoadError(
            f"connector {name!r}: importing {module_path!r} failed, it needs the missing "
            f"module {exc.name!r}"
        ) from exc
    except Exception as exc:
        raise ConnectorLoadError(
            f"connector {name!r}: importing {module_path!r} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    connector_cls = getattr(module, class_name, None)
    if connector_cls is None:
        raise ConnectorLoadError(
            f"connector {name!r}: module {module_path!r} has no attribute {class_name!r}"
        )
    if not (isinstance(connector_cls, type) and issubclass(connector_cls, KVConnectorBase)):
        raise ConnectorLoadError(
            f"connector {name!r}: {module_path}.{class_name} is not a KVConnectorBase "
            f"subclass (got {connector_cls!r})"
        )
    if inspect.isabstract(connector_cls):
        missing = sorted(getattr(connector_cls, "__abstractmethods__", ()))
        raise ConnectorLoadError(
            f"connector {name!r}: {module_path}.{class_name} is abstract; it does not "
            f"implement {missing}"
        )
    return connector_cls


# Built-in connectors. Registration imports nothing: the RDMA connector (and
# with it the transport and UCX) loads only when a config asks for it.
KVConnectorFactory.register_connector("MultiConnector", "rdma_kv.connector.multi", "MultiConnector")
KVConnectorFactory.register_connector(
    "StorageConnector", "rdma_kv.connector.storage", "StorageConnector"
)
KVConnectorFactory.register_connector("RdmaKVConnector", "rdma_kv.connector.rdma", "RdmaConnector")
