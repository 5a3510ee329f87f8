"""``RdmaKVConnectorBackend``: Ray Serve LLM's connector backend for rdma-kv.

A ``BaseConnectorBackend`` with Ray's default P/D request protocol (NIXL's:
``{"do_remote_decode": true}`` on the prefill, the returned params verbatim
on the decode), whose ``setup()`` gives each replica its own side-channel
port and engine id (``replica.py``). Imports Ray; loaded only when
``rdma_kv.ray.RdmaKVConnectorBackend`` is looked up.
"""

from __future__ import annotations

from typing import Any

import ray
from ray import serve
from ray.llm._internal.serve.engines.vllm.kv_transfer.base import (
    BaseConnectorBackend,
    DefaultPDProtocolMixin,
)

from rdma_kv.ray.replica import replica_kv_transfer_config

__all__ = ["RdmaKVConnectorBackend"]


class RdmaKVConnectorBackend(DefaultPDProtocolMixin, BaseConnectorBackend):
    """Per-replica ports and ids for ``RdmaKVConnector`` (see ``rdma_kv.ray``)."""

    def setup(self) -> None:
        dp_rank = self.llm_config.engine_kwargs.get("data_parallel_rank")
        replica_rank = 0 if isinstance(dp_rank, int) and dp_rank >= 0 else serve.get_replica_context().rank.rank
        config: dict[str, Any] = self.kv_transfer_config
        updated = replica_kv_transfer_config(
            config, replica_rank=replica_rank,
            num_devices=self.llm_config.get_engine_config().num_devices,
            dp_rank=dp_rank if isinstance(dp_rank, int) and dp_rank >= 0 else None,
            node_ip=ray.util.get_node_ip_address(), suffix=self._get_unique_suffix())
        # In place: the engine is built from this very dict after setup().
        config.clear()
        config.update(updated)
