"""What one Ray Serve replica changes in its ``kv_transfer_config``.

Pure functions over plain dicts, so that the rule is tested without Ray:
``backend.py`` gathers the replica's facts from Ray and applies the result.
Imports nothing outside the standard library.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

BACKEND_PATH = "rdma_kv.ray:RdmaKVConnectorBackend"
"""Where Ray's factory finds the backend (``module:Class``)."""

CONNECTOR_NAMES = ("RdmaKVConnector",)
"""The connector names ``register_backend`` registers by default. rdma-kv's
``NixlConnector`` (``rdma_kv.vllm.compat``) is left to Ray's own NIXL
backend unless named: Ray keys backends by name alone, not by module."""


def replica_kv_transfer_config(config: Mapping[str, Any], *, replica_rank: int, num_devices: int,
                               dp_rank: int | None, node_ip: str, suffix: str) -> dict[str, Any]:
    """``config`` (a vLLM ``kv_transfer_config`` dict) for one replica.

    - ``kv_port``: a producer's rank ``r`` listens on ``kv_port + r``, so
      replica ``k`` of an engine with ``num_devices`` GPUs (TP x PP) gets
      ``kv_port + k * num_devices``: consecutive replicas never overlap.
      Under data parallelism (``dp_rank`` set) the connector already adds
      ``dp_rank * tp_size`` itself, so the port is left as it is. ``0``
      (any free port, TP 1) stays 0.
    - ``engine_id``: ``<engine_id or "rdma-kv">-r<replica_rank>-<suffix>``, so
      two replicas never answer to one id (the params name the engine
      whose blocks they hold; the decode checks the producer it reaches).
    - ``side_channel_host``: the node's address when the config names none
      (rdma-kv's default, 127.0.0.1, is unreachable from other nodes);
      ``advertise_host`` likewise when the side channel binds ``0.0.0.0``.
    """
    if replica_rank < 0 or num_devices < 1:
        raise ValueError(f"replica_rank must be >= 0 and num_devices >= 1, got {replica_rank}, {num_devices}")
    out = copy.deepcopy(dict(config))
    extra = dict(out.get("kv_connector_extra_config") or {})
    base = int(out.get("kv_port") or 0)
    if base and dp_rank is None:
        out["kv_port"] = base + replica_rank * num_devices
    out["engine_id"] = f"{out.get('engine_id') or 'rdma-kv'}-r{replica_rank}-{suffix}"
    if not extra.get("side_channel_host"):
        extra["side_channel_host"] = node_ip
    elif extra["side_channel_host"] == "0.0.0.0" and not extra.get("advertise_host"):
        extra["advertise_host"] = node_ip
    out["kv_connector_extra_config"] = extra
    return out
