"""The RDMA connector's settings, parsed once from ``kv_connector_extra_config``.

Owns the list of extra-config keys the connector understands, their
defaults, their validation (unknown keys are rejected with the valid ones)
and the frozen :class:`RdmaSettings` inner code receives.

Imports the standard library, ``rdma_kv.errors``, the connector's ``config``
and ``rdma.admission`` (the file-descriptor bound of ``side_channel_max_connections``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import string
from collections.abc import Mapping
from typing import Any

from rdma_kv.connector.config import KVTransferConfig
from rdma_kv.connector.rdma.admission import check_max_connections
from rdma_kv.errors import ConfigError

# The transport's bound (rdma_kv.transport.lanes.MAX_LANES) and default
# (rdma_kv.transport.config.default_lanes), repeated so that parsing settings
# does not import the transport; a test ties them.
MAX_LANES = 16
DEFAULT_LANES_CAP = 2


def default_lanes() -> int:
    """The transport's default lanes: the CPUs the calling thread may run on, at
    most ``DEFAULT_LANES_CAP`` (see docs/deploy.md, "Threads and CPU")."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, DEFAULT_LANES_CAP, MAX_LANES))


__all__ = ["EXTRA_KEYS", "MODES", "USER_KEYS", "RdmaSettings"]

MODES = ("pull", "push")

MIN_LEASE_TTL_S = 1.0
"""The shortest lease a producer grants and a consumer accepts in
``kv_transfer_params``. The params name the TTL and the consumer renews at a
third of it, so without a floor a client's ``remote_lease_ttl_s`` of 1e-9
made every engine step a RENEW to the producer for as long as the request
waited; and a lease under a second lapses between the renewals of a
consumer on a loaded host."""

MAX_LEASE_TTL_S = 86400.0

MAX_TIMEOUT_S = 86400.0
"""The longest timeout or interval a setting may name: past ~1e10 s a
deadline overflows the clocks and C fields it is kept in (an
``OverflowError`` in every handshake), and long before that a dead
producer would never be detected."""

MAX_RPC_RETRIES = 10
"""Each retry is an attempt and a backoff on an RPC thread."""

MAX_RPC_THREADS = 256

MAX_RECORD_CHARS = 1024
"""The longest string the compatibility record carries (``wiregeom.Str``):
a longer ``model_id`` would be refused by every peer as malformed."""


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
    total_kv_heads: int = 0
    """The model's KV heads before tensor parallelism shards them (the engine
    adapter sets it). 0: this rank's heads x ``tp_size``, which is right
    unless heads are replicated (``tp_size`` above the number of KV heads)."""
    lease_ttl_s: float = 30.0
    """How long a producer holds delayed blocks without a renewal."""
    renew_interval_s: float = 0.0
    """How often a consumer renews (0: a third of the producer's TTL)."""
    lease_max_s: float = 300.0
    """The longest a producer holds a lease's blocks, renewed or not: past
    it the lease ends and the consumer recomputes. Covers a long admission
    wait on a loaded decode (minutes), not an unbounded one."""
    lease_max_share: float = 0.5
    """Under memory pressure (a new request waits for blocks), leases may
    hold at most this share of the producer's KV-cache blocks: past it the
    oldest leases end first (their consumers recompute). 1: never reclaim."""
    read_timeout_s: float = 10.0
    """Deadline of one request's reads; a dead producer fails them within it."""
    load_timeout_s: float = 30.0
    """Deadline of a whole load (handshake, reads, confirmation)."""
    connect_timeout_s: float = 2.0
    rpc_timeout_s: float = 2.0
    rpc_retries: int = 2
    rpc_threads: int = 4
    """Threads for handshakes and lease RPCs (never the engine thread), and as
    many again for renewals alone (``consumer.clients``): a RENEW never
    queues behind a slow call."""
    idle_wait_s: float = 0.002
    """In a step where no request computes (the engine only waits for
    loads), ``get_finished`` waits at most this long for a load in flight to
    finish -- on its reads, helping the transport's copy, then on its
    CONFIRM -- so that this step reports it, rather than returning to an
    engine that would step again at once and take the CPU and the
    interpreter lock the copy and the CONFIRM need. 0: never wait."""
    side_channel_max_connections: int = 0
    """Connections a producer rank's side channel keeps open (one per consumer
    rank that reads it, pooled). 0: sized from the process's file-descriptor
    limit (``admission.default_max_connections``: 48,384 under vLLM, which
    raises ``RLIMIT_NOFILE`` to 65,535). Else at least 64 and at most what
    that limit leaves after ``admission.FD_RESERVE`` (or 256 if more):
    ``admission.check_max_connections``."""
    ucx_options: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """UCX settings without the ``UCX_`` prefix, e.g. ``{"TLS": "rc,sm"}``."""
    ucx_net_devices: str | Mapping[int, str] | None = None
    """``UCX_NET_DEVICES`` of each rank's UCX context, so that every GPU uses
    the NIC next to it: a template, where ``{local_rank}`` is the CUDA
    device index of the rank's KV cache (its TP rank for a host-memory
    cache) and ``{rank}`` its TP rank, e.g. ``"mlx5_{local_rank}:1"``; or a
    map from TP rank to devices, e.g. ``{"0": "mlx5_0:1", "1": "mlx5_1:1"}``
    (every rank present). Unset: UCX's default, every device, each GPU's
    memory registered on the HCAs closest to it (``MAX_HCA_PER_GPU=auto``)."""
    attention_backend: str = ""
    """The engine's attention backend, part of the compatibility check (an
    NHD and an HND backend must not exchange blocks). The vLLM adapter sets
    it from vLLM (e.g. ``FLASH_ATTN``); elsewhere, any name both sides use."""
    kv_cache_dtype: str = ""
    """The format of the KV bytes when the tensor's dtype does not tell it,
    part of the compatibility check: vLLM stores ``--kv-cache-dtype``
    ``fp8``, ``fp8_e4m3`` and ``fp8_e5m2`` all as ``uint8`` tensors of one
    page size, so two engines of different fp8 formats would otherwise
    exchange blocks. The vLLM adapter sets it from vLLM's cache config (empty
    for ``auto``: the tensor's dtype is the format); elsewhere, any name both
    sides use."""
    model_id: str = ""
    """Which model this engine runs, compared at the handshake: two models of
    one shape (two fine-tunes of one base, or unrelated models with the same
    layers and heads) must not exchange KV. Any name both engines of a pair
    use; empty (the default outside vLLM): not known, and then not compared
    (a peer naming one is accepted). The vLLM adapter derives it
    (``rdma_kv.vllm.identity``: the served model name when one is set,
    else the model path's last component and a digest of its architecture)
    unless this key is set, which wins: set the same value on both engines
    when they load one model from paths of different names."""
    kv_cache_scales: str = ""
    """A quantized (fp8) KV cache's per-layer k/v scales, or their digest,
    compared at the handshake: the same fp8 bytes under other scales are
    other values. The vLLM adapter sets it from the attention layers
    (refused in vLLM's extra config); empty for an unquantized cache."""
    lanes: int = dataclasses.field(default_factory=default_lanes)
    """UCX workers that carry one request's reads in parallel (``AgentConfig.lanes``):
    each extra lane is a worker, an endpoint per producer and a progress thread.
    Default: the transport's, ``min(allowed CPUs, 2)``; 1 keeps every read on one worker.
    Push mode's writes to a decode take one worker whatever this says (both sides import
    each other ``paired``: the decode's fence needs the producer's writes on the endpoint
    UCX pairs with its own)."""
    auth_secret_env: str | None = None
    """*Name* of an environment variable holding the side channel's shared
    secret (the value itself never goes into the config). Wins over the file
    when set and non-empty."""
    auth_secret_file: str | None = None
    """Path of a file (mode 0600) holding the side channel's shared secret.
    With either key set, every side-channel connection is authenticated
    (``auth.py``, ``docs/security.md``) and peers without the secret are refused."""
    allow_unauthenticated: bool = False
    """Let a producer whose side channel listens on a non-loopback address
    start without a shared secret. Off: such a producer refuses to start."""
    router_discovery_address: str | None = None
    """``host:port`` of a P/D router's service discovery (vllm-router's
    ``--vllm-discovery-address``): the engine's rank 0 registers there every
    2 s (``discovery``), as a prefill (kv_producer) or a decode (kv_consumer),
    with ``transfer_mode`` WRITE in push mode (the router then dispatches both
    legs at once) and READ in pull mode. Needs ``router_http_address``."""
    router_http_address: str | None = None
    """``host:port`` of this engine's OpenAI server, where the router sends requests."""
    read_pin: bool = True
    """Pull mode, reading a producer that publishes no held words
    (``held_words``): pin each source's lease as its reads are posted (a RENEW
    with ``pin``, answered during the reads) and trust reads that land
    within the pin without a CONFIRM round trip after them; the lease is
    then released by a RELEASE nobody waits for. ``false``: CONFIRM after
    every read (one round trip more per load). Reads that land after their
    pin ended, or whose pin was not granted, are CONFIRMed either way."""
    held_words: bool = True
    """Pull mode. Producer: publish a 16-byte word per block naming the
    live lease that holds it (``heldwords``, registered with the KV cache).
    Consumer: when the producer publishes them, read its blocks' words after
    the data (one small RMA get, no producer CPU) and trust the data when
    every word names its lease, without a PIN or a CONFIRM; anything else
    is CONFIRMed. ``false``: neither (``read_pin`` decides)."""
    express: bool = False
    """Give every endpoint to a peer an express twin for reads and writes too
    small to stripe (``AgentConfig.express``): a small load's reads then do
    not queue behind a large load's. Doubles the endpoints (on InfiniBand the
    queue pairs, on both sides)."""
    push_layerwise: bool = True
    """Push mode, concurrent dispatch: write each layer's complete blocks as
    the prefill stores it (``save_kv_layer``; host-memory KV caches) rather
    than every layer at the seal. ``false``: always at the seal."""
    mode: str = "pull"
    """``pull``: the decode reads the producer's blocks (one-sided GET),
    then confirms the lease. ``push``: the decode allocates and registers its
    blocks with the producer, which writes them (one-sided PUT) and notifies
    once every write is remotely complete (``pusher``, ``consumer/pushes``).
    Both engines must run the same mode: the handshake refuses a mismatch,
    naming both, and the request recomputes."""

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
            "ucx_net_devices": _net_devices(extra.get("ucx_net_devices"), ucx),
        }
        values["attention_backend"] = get("attention_backend", "", type=str)
        values["kv_cache_dtype"] = get("kv_cache_dtype", "", type=str)
        values["model_id"] = get("model_id", "", type=str)
        values["kv_cache_scales"] = get("kv_cache_scales", "", type=str)
        for name in ("auth_secret_env", "auth_secret_file"):
            value = get(name, None, type=str)
            if value is not None and not value.strip():
                raise ConfigError(f"kv_connector_extra_config[{name!r}] is empty; remove it or "
                                  "name an environment variable / a file")
            values[name] = value
        values["allow_unauthenticated"] = get("allow_unauthenticated", False, type=bool)
        values["mode"] = get("mode", "pull", type=str)
        values["push_layerwise"] = get("push_layerwise", True, type=bool)
        values["read_pin"] = get("read_pin", True, type=bool)
        values["held_words"] = get("held_words", True, type=bool)
        values["express"] = get("express", False, type=bool)
        for name in ("router_discovery_address", "router_http_address"):
            values[name] = get(name, None, type=str)
        if (values["router_discovery_address"] is None) != (values["router_http_address"] is None):
            raise ConfigError("router_discovery_address and router_http_address go together: the router "
                              "needs both this engine's registration and where to send it requests")
        if values["router_discovery_address"] is not None and config.is_kv_producer and config.is_kv_consumer:
            raise ConfigError("a router registers an engine as a prefill or a decode: kv_role kv_both cannot "
                              "use router_discovery_address")
        if config.is_kv_producer:
            _require_secret_off_loopback(host, values)
        for name, kind in (("tp_rank", int), ("tp_size", int), ("total_kv_heads", int), ("lease_ttl_s", float),
                           ("renew_interval_s", float), ("lease_max_s", float), ("lease_max_share", float), ("read_timeout_s", float),
                           ("load_timeout_s", float), ("connect_timeout_s", float),
                           ("rpc_timeout_s", float), ("rpc_retries", int), ("rpc_threads", int),
                           ("idle_wait_s", float),
                           ("side_channel_max_connections", int),
                           ("lanes", int)):
            if name in extra:
                values[name] = get(name, type=kind)
        settings = cls(**values)
        settings._validate()
        if config.is_kv_producer and settings.side_channel_max_connections:  # (a consumer serves none)
            check_max_connections(settings.side_channel_max_connections)
        return settings

    def _validate(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"kv_connector_extra_config['mode']={self.mode!r}: use one of {list(MODES)} "
                              "('pull': the decode reads; 'push': the producer writes), the same on both engines")
        if not 0 <= self.side_channel_port <= 65535:
            raise ConfigError(f"side_channel_port={self.side_channel_port} not in [0, 65535]")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank={self.tp_rank} must be in [0, tp_size={self.tp_size})")
        if self.total_kv_heads < 0:
            raise ConfigError(f"total_kv_heads={self.total_kv_heads} must be >= 0 (0: derived)")
        for name in ("model_id", "kv_cache_scales"):  # the handshake carries them (wiregeom.Str)
            if len(getattr(self, name)) > MAX_RECORD_CHARS:
                raise ConfigError(f"kv_connector_extra_config[{name!r}] has {len(getattr(self, name))} "
                                  f"characters; at most {MAX_RECORD_CHARS}")
        if self.side_channel_port == 0 and self.tp_size > 1:
            raise ConfigError("side_channel_port 0 (OS-chosen) works only with tp_size 1: "
                              "consumers dial port + rank")
        if self.side_channel_port and self.side_channel_port + self.tp_size - 1 > 65535:
            raise ConfigError(f"side_channel_port {self.side_channel_port} + tp_size exceeds 65535")
        if not 0 < self.lease_max_share <= 1:
            raise ConfigError(f"lease_max_share must be in (0, 1], got {self.lease_max_share}")
        if not MIN_LEASE_TTL_S <= self.lease_ttl_s <= MAX_LEASE_TTL_S:
            raise ConfigError(f"lease_ttl_s must be in [{MIN_LEASE_TTL_S:g}, {MAX_LEASE_TTL_S:g}] seconds, "
                              f"got {self.lease_ttl_s}")
        for name in ("lease_max_s", "read_timeout_s", "load_timeout_s", "connect_timeout_s",
                     "rpc_timeout_s"):
            # (written so that NaN fails too; the bound: past it a deadline overflows the
            # clocks and C fields it is kept in, and a dead peer would never be detected)
            if not 0 < getattr(self, name) <= MAX_TIMEOUT_S:
                raise ConfigError(f"{name} must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {getattr(self, name)}")
        if not 0 <= self.renew_interval_s <= MAX_TIMEOUT_S:  # (NaN: never renewed, every lease lapsed)
            raise ConfigError(f"renew_interval_s must be in [0, {MAX_TIMEOUT_S:g}] seconds (0: from the lease's "
                              f"TTL), got {self.renew_interval_s}")
        if not 0 <= self.idle_wait_s <= 1:
            raise ConfigError(f"idle_wait_s must be in [0, 1] seconds (0: never wait), got {self.idle_wait_s}")
        if self.side_channel_max_connections and self.side_channel_max_connections < 64:
            raise ConfigError(f"side_channel_max_connections must be 0 (sized from the file-descriptor "
                              f"limit) or at least 64 (the budget of connections not yet authenticated), "
                              f"got {self.side_channel_max_connections}")
        if not 0 <= self.rpc_retries <= MAX_RPC_RETRIES or not 1 <= self.rpc_threads <= MAX_RPC_THREADS:
            raise ConfigError(f"rpc_retries must be in [0, {MAX_RPC_RETRIES}] and rpc_threads in "
                              f"[1, {MAX_RPC_THREADS}], got {self.rpc_retries} and {self.rpc_threads}")
        if not 1 <= self.lanes <= MAX_LANES:
            raise ConfigError(f"lanes must be 1..{MAX_LANES}, got {self.lanes}")
        if isinstance(self.ucx_net_devices, Mapping):
            ranks = sorted(self.ucx_net_devices)
            if ranks != list(range(self.tp_size)):
                raise ConfigError(f"ucx_net_devices names ranks {ranks}; name every rank 0..{self.tp_size - 1} "
                                  f"(tp_size={self.tp_size}) exactly once, or use a template such as "
                                  '"mlx5_{local_rank}:1"')

    def for_device(self, device: str) -> RdmaSettings:
        """These settings for a rank whose KV cache lives on ``device``
        (``cuda:N`` or ``cpu``): ``ucx_options`` with its ``NET_DEVICES``."""
        spec = self.ucx_net_devices
        if spec is None:
            return self
        if isinstance(spec, str):
            kind, _, index = device.partition(":")
            local = int(index) if kind == "cuda" and index.isdigit() else self.tp_rank
            devices = spec.format(rank=self.tp_rank, local_rank=local)
        else:
            devices = spec[self.tp_rank]
        return dataclasses.replace(self, ucx_options={**self.ucx_options, "NET_DEVICES": devices})

    def renew_interval_for(self, remote_ttl_s: float) -> float:
        third = remote_ttl_s / 3.0
        return min(self.renew_interval_s, third) if self.renew_interval_s else third

    def renewal_due(self, renewed_at: float | None, now: float, remote_ttl_s: float) -> bool:
        """Whether a consumer renews a lease of TTL ``remote_ttl_s`` at ``now``:
        at once if it never renewed it (that first RENEW also claims the
        lease), then every ``renew_interval_for(remote_ttl_s)``. The one rule
        of the scheduler (requests waiting for admission) and of the workers
        (loads running)."""
        return renewed_at is None or now - renewed_at >= self.renew_interval_for(remote_ttl_s)


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine's loopback (a host name other than
    ``localhost`` may resolve anywhere: not loopback)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _require_secret_off_loopback(host: str, values: Mapping[str, Any]) -> None:
    """A producer hands out remote keys of its KV cache to whoever completes
    the side channel's opening: off loopback, only with a secret, or when
    the operator said explicitly that the network is trusted."""
    if values["auth_secret_env"] or values["auth_secret_file"] or values["allow_unauthenticated"]:
        return
    if not is_loopback(host):
        raise ConfigError(
            f"RdmaKVConnector: this producer's side channel listens on {host!r}, not a loopback address, "
            "and no shared secret is configured, so any peer that reaches it would get the remote keys "
            "of this engine's KV cache. Set kv_connector_extra_config 'auth_secret_file' (path of a "
            "mode-0600 file holding >= 16 random bytes, e.g. from `openssl rand -hex 32`) or "
            "'auth_secret_env' (name of an environment variable holding it) on every producer and "
            "consumer; or, on a network you trust, set 'allow_unauthenticated': true (docs/security.md)")


def _net_devices(value: Any, ucx_options: Mapping[str, str]) -> str | dict[int, str] | None:
    """``ucx_net_devices`` checked: a template naming only {rank} and
    {local_rank}, or a map from rank (an int, or its decimal string as JSON
    keys are) to a non-empty string."""
    if value is None:
        return None
    if "NET_DEVICES" in ucx_options:
        raise ConfigError("both ucx_net_devices and ucx_options['NET_DEVICES'] are set; keep one "
                          "(ucx_net_devices can differ per rank)")
    if isinstance(value, str):
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
        except ValueError as exc:
            raise ConfigError(f"ucx_net_devices template {value!r} is malformed: {exc}") from None
        if not value.strip() or not fields <= {"rank", "local_rank"}:
            raise ConfigError(f"ucx_net_devices template {value!r} may name only {{rank}} and {{local_rank}} "
                              '(e.g. "mlx5_{local_rank}:1")')
        if any(spec or conversion for _, name, spec, conversion in string.Formatter().parse(value)
               if name is not None):
            raise ConfigError(f"ucx_net_devices template {value!r}: write {{rank}} and {{local_rank}} plainly, "
                              'without a conversion or format spec (e.g. "mlx5_{local_rank}:1")')
        return value
    if isinstance(value, Mapping):
        out: dict[int, str] = {}
        for key, devices in value.items():
            rank = key if isinstance(key, int) and not isinstance(key, bool) else None
            if isinstance(key, str) and key.isdigit():
                rank = int(key)
            if rank is None or not isinstance(devices, str) or not devices.strip():
                raise ConfigError(f"ucx_net_devices maps rank {key!r} to {devices!r}; map each TP rank "
                                  'to its devices, e.g. {"0": "mlx5_0:1"}')
            out[rank] = devices
        return out
    raise ConfigError(f"ucx_net_devices must be a template string or a map from rank to devices, "
                      f"got {type(value).__name__} {value!r}")


EXTRA_KEYS = tuple(f.name for f in dataclasses.fields(RdmaSettings))

USER_KEYS = tuple(k for k in EXTRA_KEYS if k not in ("tp_rank", "tp_size", "total_kv_heads"))
"""The keys a user sets: the engine adapter sets ``tp_rank``/``tp_size``/``total_kv_heads`` from
the engine's parallel layout (vLLM refuses them from the user), so the
unknown-key error lists only these."""
