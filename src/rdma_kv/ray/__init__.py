"""rdma-kv under Ray Serve LLM: ``RdmaKVConnectorBackend`` for P/D apps.

Ray Serve's ``build_pd_openai_app`` runs each prefill and decode replica as
a vLLM engine and looks up a *connector backend* by the name in
``engine_kwargs["kv_transfer_config"]["kv_connector"]``; the backend's
``setup()`` runs in the replica before its engine starts. Register rdma-kv's
once, after ``ray.init``, on the driver::

    import rdma_kv.ray
    rdma_kv.ray.register_backend()          # "RdmaKVConnector" -> rdma_kv.ray:RdmaKVConnectorBackend

Without it Ray uses its ``DefaultConnectorBackend``, which sets nothing:
two replicas of a role then share one side-channel port and the second
producer fails to bind. Per replica the backend sets (``replica.py``)
``kv_port`` (the base port plus the replica's rank times its GPUs, so each
TP rank keeps ``kv_port + tp_rank``), ``engine_id`` and, when the config
names none, ``side_channel_host`` (the node's address, Ray's view). See
docs/deploy.md, "Routers".

Importing this package imports neither Ray nor vLLM (PEP 562):
``RdmaKVConnectorBackend`` (``backend.py``, which subclasses Ray's base) is
loaded when first looked up, as Ray's factory does with
``"rdma_kv.ray:RdmaKVConnectorBackend"``. Imports nothing from rdma-kv's
connector layers.
"""

from __future__ import annotations

import importlib
from typing import Any

from rdma_kv.ray.replica import BACKEND_PATH, CONNECTOR_NAMES, replica_kv_transfer_config

__all__ = ["BACKEND_PATH", "CONNECTOR_NAMES", "RdmaKVConnectorBackend", "register_backend",
           "replica_kv_transfer_config"]


def register_backend(names: tuple[str, ...] = CONNECTOR_NAMES) -> None:
    """Register ``RdmaKVConnectorBackend`` with Ray Serve LLM's connector
    backend factory under ``names`` (rdma-kv's connector class names), for
    every process of the Ray cluster. Call after ``ray.init()``."""
    from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import KVConnectorBackendFactory

    for name in names:
        if name == "NixlConnector":
            # Ray registers its own NIXL backend under that name; ours is the same
            # request protocol plus rdma-kv's ports and ids, so replace it.
            KVConnectorBackendFactory.unregister_backend(name)
        if not KVConnectorBackendFactory.is_registered(name):
            KVConnectorBackendFactory.register_backend(name, BACKEND_PATH)


def __getattr__(name: str) -> Any:
    if name == "RdmaKVConnectorBackend":
        value = importlib.import_module("rdma_kv.ray.backend").RdmaKVConnectorBackend
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rdma_kv.ray' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"RdmaKVConnectorBackend"})
