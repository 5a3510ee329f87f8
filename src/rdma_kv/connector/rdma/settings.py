"""The RDMA connector's settings, parsed once from ``kv_connector_extra_config``.

Owns the list of extra-config keys the connector understands, their
defaults, their validation (unknown keys are rejected with the valid ones)
and the frozen :class:`RdmaSettings` inner code receives.

Imports the standard library, ``rdma_kv.errors`` and the connector's ``config``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rdma_kv.connector.config import KVTransferConfig
from rdma_kv.errors import ConfigError

# The transport's bound (rdma_kv.transport.lanes.MAX_LANES), repeated so
# that parsing settings does not import the transport; a test ties the two.
MAX_LANES = 16

__all__ = ["EXTRA_KEYS", "USER_KEYS", "RdmaSettings"]


@dataclasses.dataclass(frozen=True)
class RdmaSettings:
    side_channel_host: str
    """Interface the side channel binds (default ``kv_ip``). Only this one."""
    advertise_host: str
    """Host consumers are told to reach (default: ``side_channel_host``)."""
    side_channel_port: int
    """Base port (default ``kv_port``); rank ``r`` listens on ``port + r``. 0: the OS picks."""
    tp_rank: int = 0
    tp_size: int = 1
    lease_ttl_s: float = 30.0
    """How long a producer holds delayed blocks without a renewal."""
    renew_interval_s: float = 0.0
    """How often a consumer renews (0: a third of the producer's TTL)."""
    read_timeout_s: float = 10.0
    """Deadline of one request's reads; a dead producer fails them within it."""
    load_timeout_s: float = 30.0
    """Deadline of a whole load (handshake, reads, confirmation)."""
    connect_timeout_s: float = 2.0
    rpc_timeout_s: float = 2.0
    rpc_retries: int = 2
    rpc_threads: int = 4
    """Threads for handshakes and lease RPCs (never the engine thread)."""
    ucx_options: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """UCX settings without the ``UCX_`` prefix, e.g. ``{"TLS": "rc,sm"}``."""
    lanes: int = 1
    """UCX workers that carry one request's reads in parallel (``AgentConfig.lanes``):
    each extra lane is a worker, an endpoint per producer and a progress thread."""
    auth_secret_env: str | None = None
    """*Name* of an environment variable holding the side channel's shared
    secret (the value itself never goes into the config). Wins over the file
    when set and non-empty."""
    auth_secret_file: str | None = None
    """Path of a file (mode 0600) holding the side channel's shared secret.
    With either key set, every side-channel connection is authenticated
    (``auth.py``, ``docs/security.md``) and peers without the secret are refused."""

    @classmethod
    def from_config(cls, config: KVTransferConfig) -> RdmaSettings:
        extra = config.kv_connector_extra_config
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ConfigError(
                f"RdmaKVConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                f"valid keys are {sorted(USER_KEYS)}"
            )
        get = config.get_extra
        host = get("side_channel_host", config.kv_ip, type=str)
        advertise = get("advertise_host", host, type=str)
        if advertise in ("0.0.0.0", "::", ""):
            raise ConfigError(
                f"side channel binds {host!r}, which consumers cannot dial; set "
                "kv_connector_extra_config['advertise_host'] to this host's address"
            )
        ucx = get("ucx_options", {}, type=Mapping)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in ucx.items()):
            raise ConfigError("kv_connector_extra_config['ucx_options'] must map strings to strings")
        values: dict[str, Any] = {
            "side_channel_host": host,
            "advertise_host": advertise,
            "side_channel_port": get("side_channel_port", config.kv_port, type=int),
            "ucx_options": dict(ucx),
        }
        for name in ("auth_secret_env", "auth_secret_file"):
            value = get(name, None, type=str)
            if value is not None and not value.strip():
                raise ConfigError(f"kv_connector_extra_config[{name!r}] is empty; remove it or "
                                  "name an environment variable / a file")
            values[name] = value
        for name, kind in (("tp_rank", int), ("tp_size", int), ("lease_ttl_s", float),
                           ("renew_interval_s", float), ("read_timeout_s", float),
                           ("load_timeout_s", float), ("connect_timeout_s", float),
                           ("rpc_timeout_s", float), ("rpc_retries", int), ("rpc_threads", int),
                           ("lanes", int)):
            if name in extra:
                values[name] = get(name, type=kind)
        settings = cls(**values)
        settings._validate()
        return settings

    def _validate(self) -> None:
        if not 0 <= self.side_channel_port <= 65535:
            raise ConfigError(f"side_channel_port={self.side_channel_port} not in [0, 65535]")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank={self.tp_rank} must be in [0, tp_size={self.tp_size})")
        if self.side_channel_port == 0 and self.tp_size > 1:
            raise ConfigError("side_channel_port 0 (OS-chosen) works only with tp_size 1: "
                              "consumers dial port + rank")
        if self.side_channel_port and self.side_channel_port + self.tp_size - 1 > 65535:
            raise ConfigError(f"side_channel_port {self.side_channel_port} + tp_size exceeds 65535")
        for name in ("lease_ttl_s", "read_timeout_s", "load_timeout_s", "connect_timeout_s",
                     "rpc_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.renew_interval_s < 0:
            raise ConfigError(f"renew_interval_s must be >= 0, got {self.renew_interval_s}")
        if self.rpc_retries < 0 or self.rpc_threads < 1:
            raise ConfigError("rpc_retries must be >= 0 and rpc_threads >= 1")
        if not 1 <= self.lanes <= MAX_LANES:
            raise ConfigError(f"lanes must be 1..{MAX_LANES}, got {self.lanes}")

    def renew_interval_for(self, remote_ttl_s: float) -> float:
        third = remote_ttl_s / 3.0
        return min(self.renew_interval_s, third) if self.renew_interval_s else third


EXTRA_KEYS = tuple(f.name for f in dataclasses.fields(RdmaSettings))

USER_KEYS = tuple(k for k in EXTRA_KEYS if k not in ("tp_rank", "tp_size"))
"""The keys a user sets: the engine adapter sets ``tp_rank``/``tp_size`` from
the engine's parallel layout (vLLM refuses them from the user), so the
unknown-key error lists only these."""
