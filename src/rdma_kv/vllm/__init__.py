"""rdma-kv inside vLLM: ``RdmaKVConnector`` for ``kv_connector_module_path``.

    kv_transfer_config={"kv_connector": "RdmaKVConnector",
                        "kv_connector_module_path": "rdma_kv.vllm",
                        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                        "kv_connector_extra_config": {...}}

The only package of rdma-kv that imports vLLM (``import rdma_kv`` never
does), and only when one of the names below is first looked up (PEP 562):
``translate`` (vLLM objects <-> engine-neutral ones) imports without vLLM,
so ``rdma-kv info --config`` checks a vLLM config with the adapter's own
code on a host without vLLM. vLLM loads the connector with
``getattr(import_module("rdma_kv.vllm"), "RdmaKVConnector")``, which
imports ``connector``: vLLM's KV-connector base classes and rdma-kv's
engine-neutral types; UCX, threads and sockets appear only when vLLM
creates a connector instance in an engine. Modules: ``connector`` (the
adapter class), ``compat`` (``NixlConnector``: the same class under the
name Dynamo and SMG's gRPC servicer select NIXL's request protocol by),
``translate``, ``stats`` (``RdmaKVConnectorStats``). See ``docs/vllm.md``
and docs/deploy.md, "Routers".
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "RdmaKVConnector": "rdma_kv.vllm.connector",
    "RdmaKVConnectorMetadata": "rdma_kv.vllm.connector",
    "RdmaKVHandshakeMetadata": "rdma_kv.vllm.connector",
    "RdmaKVConnectorStats": "rdma_kv.vllm.stats",
    "NixlConnector": "rdma_kv.vllm.compat",
}

__all__ = [
    "NixlConnector",
    "RdmaKVConnector",
    "RdmaKVConnectorMetadata",
    "RdmaKVConnectorStats",
    "RdmaKVHandshakeMetadata",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rdma_kv.vllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
