"""KVTransferConfig: the parsed, validated configuration of KV transfer.

Owns the configuration an engine hands to rdma-kv (the same fields as
vLLM's ``--kv-transfer-config``), its validation, its JSON form and its
``compute_hash``. Configuration is parsed once, here, at the edge: inner code
receives a ``KVTransferConfig``, never a raw dict. Unknown keys are rejected
with the list of valid ones.

Imports only the standard library and ``rdma_kv.errors``.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import uuid
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, TypeVar, cast

from rdma_kv.errors import ConfigError

__all__ = [
    "KVBufferDevice",
    "KVLoadFailurePolicy",
    "KVRole",
    "KVTransferConfig",
]

T = TypeVar("T")
_MISSING: Any = object()


class KVRole(str, enum.Enum):
    """What an engine instance does with KV: produce (prefill), consume
    (decode) or both. A ``str`` enum so it compares equal to the JSON value."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"


class KVBufferDevice(str, enum.Enum):
    """Where the connector buffers KV."""

    CUDA = "cuda"
    CPU = "cpu"


class KVLoadFailurePolicy(str, enum.Enum):
    """What the engine does with blocks that failed to load."""

    RECOMPUTE = "recompute"  # reschedule; recompute from the first failed block
    FAIL = "fail"  # finish the request with an error


def _values(enum_cls: type[enum.Enum]) -> list[str]:
    return [member.value for member in enum_cls]


def _parse_enum(field: str, value: Any, enum_cls: type[enum.Enum]) -> Any:
    try:
        return enum_cls(value)
    except ValueError:
        raise ConfigError(
            f"{field}={value!r} is not valid; expected one of {_values(enum_cls)}"
        ) from None


def _check_int(field: str, value: Any, *, minimum: int, maximum: int | None = None) -> int:
    # bool is an int in Python; a JSON `true` for a port is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{field} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{field}={value} is out of range; expected an integer {bounds}")
    return value


def _freeze(value: Any, where: str) -> Any:
    """Deep-copy JSON-like data into an immutable form (mapping proxies and
    tuples), so neither the caller nor a connector can mutate the config."""
    if isinstance(value, Mapping):
        frozen = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(f"{where} keys must be strings, got {key!r}")
            frozen[key] = _freeze(item, f"{where}[{key!r}]")
        return MappingProxyType(frozen)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(item, f"{where}[{i}]") for i, item in enumerate(value))
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise ConfigError(
        f"{where} must hold JSON-compatible values (dict, list, str, number, bool, "
        f"null), got {type(value).__name__}"
    )


def _thaw(value: Any) -> Any:
    """The inverse of ``_freeze``: plain dicts and lists, ready for JSON."""
    if isinstance(value, Mapping):
        return {key: _thaw(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [_thaw(item) for item in value]
    return value


@dataclasses.dataclass(frozen=True, eq=True)
class KVTransferConfig:
    """Configuration for KV transfer between engine instances.

    Every field is validated at construction; a bad value raises
    :class:`~rdma_kv.errors.ConfigError` naming the field and the valid values.
    ``kv_connector_extra_config`` is deep-frozen: read it with
    :meth:`get_extra`.
    """

    kv_connector: str | None = None
    """Name of the connector (a registered name, or a class name inside
    ``kv_connector_module_path``)."""
    engine_id: str | None = None
    """Identity of this engine instance in transfers; a UUID when unset."""
    kv_buffer_device: KVBufferDevice = KVBufferDevice.CUDA
    """Device on which the connector buffers KV."""
    kv_buffer_size: float = 1e9
    """Buffer size in bytes, for connectors that stage KV in a buffer."""
    kv_role: KVRole | None = None
    """Producer (prefill), consumer (decode) or both; required with a connector."""
    kv_rank: int | None = None
    """Rank of this instance in the transfer: 0 prefill, 1 decode in 1P1D."""
    kv_parallel_size: int = 1
    """Number of instances taking part in the transfer."""
    kv_ip: str = "127.0.0.1"
    """Host of the connector's side channel."""
    kv_port: int = 14579
    """Port of the connector's side channel; 0 lets the OS choose one."""
    kv_connector_extra_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Connector-specific settings (JSON-compatible)."""
    kv_connector_module_path: str | None = None
    """Python module to load ``kv_connector`` from; wins over the registry."""
    kv_load_failure_policy: KVLoadFailurePolicy = KVLoadFailurePolicy.FAIL
    """What to do with blocks that failed to load: recompute them or fail."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place, once

        if self.kv_connector is not None and (
            not isinstance(self.kv_connector, str) or not self.kv_connector.strip()
        ):
            raise ConfigError(
                f"kv_connector must be a non-empty connector name or null, "
                f"got {self.kv_connector!r}"
            )
        if self.engine_id is None:
            set_(self, "engine_id", str(uuid.uuid4()))
        elif not isinstance(self.engine_id, str) or not self.engine_id:
            raise ConfigError(f"engine_id must be a non-empty string, got {self.engine_id!r}")

        set_(self, "kv_buffer_device",
             _parse_enum("kv_buffer_device", self.kv_buffer_device, KVBufferDevice))
        if self.kv_role is not None:
            set_(self, "kv_role", _parse_enum("kv_role", self.kv_role, KVRole))
        elif self.kv_connector is not None:
            raise ConfigError(
                f"kv_role must be set when kv_connector is set "
                f"(kv_connector={self.kv_connector!r}); expected one of {_values(KVRole)}"
            )
        set_(self, "kv_load_failure_policy",
             _parse_enum("kv_load_failure_policy", self.kv_load_failure_policy,
                         KVLoadFailurePolicy))

        size = self.kv_buffer_size
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise ConfigError(f"kv_buffer_size must be a positive number of bytes, got {size!r}")
        if self.kv_rank is not None:
            _check_int("kv_rank", self.kv_rank, minimum=0)
        _check_int("kv_parallel_size", self.kv_parallel_size, minimum=1)
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ConfigError(f"kv_ip must be a non-empty host string, got {self.kv_ip!r}")
        _check_int("kv_port", self.kv_port, minimum=0, maximum=65535)

        if not isinstance(self.kv_connector_extra_config, Mapping):
            raise ConfigError(
                "kv_connector_extra_config must be a mapping, got "
                f"{type(self.kv_connector_extra_config).__name__}"
            )
        set_(self, "kv_connector_extra_config",
             _freeze(self.kv_connector_extra_config, "kv_connector_extra_config"))

        path = self.kv_connector_module_path
        if path is not None:
            parts = path.split(".") if isinstance(path, str) else []
            if not parts or not all(part.isidentifier() for part in parts):
                raise ConfigError(
                    "kv_connector_module_path must be a dotted Python module path "
                    f"such as 'my_pkg.my_connector', got {path!r}"
                )

    # --- role helpers ---------------------------------------------------------

    @property
    def is_kv_transfer_instance(self) -> bool:
        """A connector is configured (with a role, which validation enforces)."""
        return self.kv_connector is not None and self.kv_role is not None

    @property
    def is_kv_producer(self) -> bool:
        """This instance produces KV for others (role producer or both)."""
        return self.kv_connector is not None and self.kv_role in (KVRole.PRODUCER, KVRole.BOTH)

    @property
    def is_kv_consumer(self) -> bool:
        """This instance consumes KV from others (role consumer or both)."""
        return self.kv_connector is not None and self.kv_role in (KVRole.CONSUMER, KVRole.BOTH)

    # --- extra config ---------------------------------------------------------

    def get_extra(self, key: str, default: Any = _MISSING, type: type[T] | None = None) -> T:
        """Read ``kv_connector_extra_config[key]``, checked against ``type``.

        Without ``default`` a missing key raises :class:`ConfigError` listing
        the keys present. With ``type``, a value of another type raises
        :class:`ConfigError` (an ``int`` is accepted for ``float``; a ``bool``
        is never an ``int``). Lists come back as tuples and dicts as read-only
        mappings; ask for ``type=tuple`` or ``type=Mapping`` accordingly.
        """
        if key not in self.kv_connector_extra_config:
            if default is _MISSING:
                raise ConfigError(
                    f"kv_connector_extra_config has no key {key!r} required by "
                    f"connector {self.kv_connector!r}; keys present: "
                    f"{sorted(self.kv_connector_extra_config)}"
                )
            return default
        value = self.kv_connector_extra_config[key]
        if type is not None and not _is_instance(value, type):
            raise ConfigError(
                f"kv_connector_extra_config[{key!r}] must be {type.__name__}, "
                f"got {value.__class__.__name__} {value!r}"
            )
        if type is float and isinstance(value, int):
            return cast(T, float(value))  # the caller asked for a float: T is float
        return value

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        """vLLM's spelling of ``get_extra(key, default)``, without a type check."""
        return self.get_extra(key, default)

    # --- hashing --------------------------------------------------------------

    def compute_hash(self) -> str:
        """Hash of the fields that change the engine's computation graph.

        A connector adds per-layer hooks to the forward step: a producer calls
        ``save_kv_layer`` after each attention layer, a consumer calls
        ``wait_for_layer_load`` before it. A graph captured or compiled with
        one set of hooks cannot be reused with another, so the factors are
        exactly: whether a connector is configured, and ``kv_role``.

        Everything else leaves the graph unchanged and is excluded on purpose:
        ``kv_connector`` (which class sits behind the hook is opaque to the
        graph), ``engine_id`` (unique per instance: including it would make
        every compile-cache lookup miss), ``kv_buffer_device``,
        ``kv_buffer_size``, ``kv_rank``, ``kv_parallel_size``, ``kv_ip``,
        ``kv_port``, ``kv_connector_extra_config``,
        ``kv_connector_module_path`` and ``kv_load_failure_policy``.
        (vLLM hashes no factors at all; its hooks live inside opaque custom
        ops. rdma-kv does not assume every engine does that.)
        """
        factors = [
            self.kv_connector is not None,
            None if self.kv_role is None else self.kv_role.value,
        ]
        return hashlib.sha256(json.dumps(factors).encode()).hexdigest()

    # --- conversions ----------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVTransferConfig:
        """Build from a mapping, rejecting unknown keys with the valid ones."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"KV transfer config must be a mapping, got {type(data).__name__}")
        valid = cls.field_names()
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ConfigError(
                f"unknown KV transfer config key(s) {unknown}; valid keys are {list(valid)}"
            )
        return cls(**data)

    @classmethod
    def from_json(cls, text: str | bytes) -> KVTransferConfig:
        """Build from a JSON object, as a ``--kv-transfer-config`` flag carries it."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"KV transfer config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"KV transfer config JSON must be an object, got {type(data).__name__}"
            )
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-compatible dict; ``from_dict(to_dict())`` round-trips."""
        out: dict[str, Any] = {}
        for name in self.field_names():
            value = getattr(self, name)
            out[name] = value.value if isinstance(value, enum.Enum) else _thaw(value)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def replace(self, **changes: Any) -> KVTransferConfig:
        """A copy with ``changes`` applied and validated (unknown names rejected)."""
        return self.from_dict({**self.to_dict(), **changes})


def _is_instance(value: Any, expected: type) -> bool:
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)
