"""KV-cache specs: what one layer's KV looks like, and how layers share blocks.

Owns ``KVCacheSpec`` and its family (``AttentionSpec``, ``FullAttentionSpec``,
``MLAAttentionSpec``, ``SlidingWindowSpec``), their byte math
(``page_size_bytes``, ``max_memory_usage_bytes``), ``type_id`` and ``merge``,
and the engine's allocation plan (``KVCacheTensor``, ``KVCacheGroupSpec``,
``KVCacheConfig``). A dtype is held as a canonical name plus its item size, so
specs work without torch; ``torch_dtype`` converts when torch is installed.

Imports only the standard library and ``rdma_kv.errors`` (torch lazily).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from rdma_kv.errors import SpecError

__all__ = [
    "AttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "SlidingWindowSpec",
    "dtype_itemsize",
    "normalize_dtype",
]

# Canonical dtype names (torch's spelling) and their sizes in bytes.
_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
_ALIASES = {
    "double": "float64",
    "float": "float32",
    "fp32": "float32",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def normalize_dtype(dtype: Any) -> str:
    """Canonical name of ``dtype``: a name or alias ("half", "bf16"), a
    ``torch.dtype`` or a numpy dtype. Raises :class:`SpecError` otherwise."""
    if isinstance(dtype, type):  # a numpy scalar type such as np.float16
        import numpy

        dtype = numpy.dtype(dtype)
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None)
    if name is None:  # torch.dtype has no .name; str() is "torch.float16"
        name = str(dtype)
    name = name.removeprefix("torch.").lower()
    name = _ALIASES.get(name, name)
    if name not in _ITEMSIZE:
        raise SpecError(f"unsupported KV dtype {dtype!r}; expected one of {sorted(_ITEMSIZE)}")
    return name


def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype`` (anything ``normalize_dtype`` accepts)."""
    return _ITEMSIZE[normalize_dtype(dtype)]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_positive(owner: str, **values: Any) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise SpecError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """The KV format of one layer; ``block_size`` tokens fill one page."""

    block_size: int

    def __post_init__(self) -> None:
        _check_positive(type(self).__name__, block_size=self.block_size)

    @property
    def type_id(self) -> str:
        """Equal for two specs exactly when their KV can share one block pool."""
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block (page) of this layer."""
        raise NotImplementedError

    def max_memory_usage_bytes(
        self, max_model_len: int, *, max_num_batched_tokens: int | None = None
    ) -> int:
        """Bytes one request of ``max_model_len`` tokens can occupy in this layer."""
        raise NotImplementedError

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks of a request the engine no longer keeps once
        ``num_computed_tokens`` tokens are computed: none, unless the layer
        only attends to a window (``SlidingWindowSpec``)."""
        return 0

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
        """One spec for the layers of a group; they must all be equal."""
        first = _first(specs)
        for spec in specs[1:]:
            if spec != first:
                raise SpecError(
                    f"layers of one KV-cache group must have equal specs: "
                    f"{_diff(first, spec)}"
                )
        return first


def _first(specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
    if not specs:
        raise SpecError("cannot merge an empty list of KV-cache specs")
    return specs[0]


def _diff(a: KVCacheSpec, b: KVCacheSpec) -> str:
    if type(a) is not type(b):
        return f"{type(a).__name__} vs {type(b).__name__}"
    fields = [f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)]
    return ", ".join(f"{n}={getattr(a, n)!r} vs {getattr(b, n)!r}" for n in fields)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """Paged attention KV: per token and head, a K and a V vector of
    ``head_size`` elements (with ``use_mla`` a single latent vector)."""

    num_kv_heads: int
    head_size: int
    dtype: str
    """Canonical dtype name; any accepted spelling is normalised."""
    use_mla: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _check_positive(owner, num_kv_heads=self.num_kv_heads, head_size=self.head_size)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if not isinstance(self.use_mla, bool):
            raise SpecError(f"{owner}.use_mla must be a bool, got {self.use_mla!r}")

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def torch_dtype(self) -> Any:
        """The ``torch.dtype``; imports torch (which must be installed)."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def num_kv_tensors(self) -> int:
        """2 (K and V) for standard attention, 1 for MLA's latent cache."""
        return 1 if self.use_mla else 2

    @property
    def page_size_bytes(self) -> int:
        return (
            self.num_kv_tensors * self.block_size * self.num_kv_heads * self.head_size
            * self.itemsize
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Attention over every past token: memory grows with the length.

    ``sliding_window`` is recorded when a sliding-window layer is managed as
    full attention (the hybrid allocator is off): blocks are allocated for all
    tokens, the window applies only to compute.
    """

    sliding_window: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window is not None:
            _check_positive(type(self).__name__, sliding_window=self.sliding_window)

    @property
    def type_id(self) -> str:
        kind = "mla_attention" if self.use_mla else "full_attention"
        return f"{kind}_{self.block_size}_{self.page_size_bytes}"

    def max_memory_usage_bytes(
        self, max_model_len: int, *, max_num_batched_tokens: int | None = None
    ) -> int:
        _check_positive(type(self).__name__, max_model_len=max_model_len)
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes

    @classmethod
    def merge(cls, specs: Sequence[KVCacheSpec]) -> KVCacheSpec:
        """Merge full-attention layers; the attention fields must agree and
        the recorded sliding windows (where set) must be one value."""
        first = _first(specs)
        for spec in specs:
            if type(spec) is not type(first):
                raise SpecError(
                    f"cannot merge {type(spec).__name__} into a group of "
                    f"{type(first).__name__}"
                )
        full = [s for s in specs if isinstance(s, FullAttentionSpec)]  # all of them (types checked above)
        windows = {s.sliding_window for s in full if s.sliding_window is not None}
        if len(windows) > 1:
            raise SpecError(
                f"layers of one KV-cache group must share one sliding window, got {sorted(windows)}"
            )
        merged = dataclasses.replace(full[0], sliding_window=next(iter(windows), None))
        for spec in full:
            other = dataclasses.replace(spec, sliding_window=merged.sliding_window)
            if other != merged:
                raise SpecError(
                    f"layers of one KV-cache group must have equal attention specs: "
                    f"{_diff(merged, other)}"
                )
        return merged


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one compressed latent vector per token
    (``num_kv_heads`` is 1, ``head_size`` is the latent width plus the rope
    dims), no separate K and V."""

    use_mla: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.use_mla:
            raise SpecError("MLAAttentionSpec.use_mla must be True")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last ``sliding_window`` tokens: blocks that fall
    out of the window are freed, so memory is capped by the window."""

    sliding_window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(type(self).__name__, sliding_window=self.sliding_window)
        if self.use_mla:
            raise SpecError("SlidingWindowSpec does not support use_mla")

    @property
    def type_id(self) -> str:
        return f"sliding_window_{self.sliding_window}_{self.block_size}_{self.page_size_bytes}"

    def num_skipped_blocks(self, num_computed_tokens: int) -> int:
        """Blocks wholly before the window of the next token: once ``n``
        tokens are computed, token ``n`` attends to tokens ``[n - w + 1, n]``
        (``w = sliding_window``), so every block that ends before token
        ``n - w + 1`` can be freed (vLLM replaces them with its null block).
        After a prompt of ``n`` tokens these are the blocks a decoder never
        reads, so a transfer skips them."""
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def max_memory_usage_bytes(
        self, max_model_len: int, *, max_num_batched_tokens: int | None = None
    ) -> int:
        """Blocks for the last ``sliding_window - 1`` computed tokens plus the
        tokens scheduled in one step, at most ``max_model_len``, plus one
        block because the window need not start on a block boundary.

        Without ``max_num_batched_tokens`` a whole prompt may be computed in
        one step, whose KV must all be written before attention drops it: the
        worst case is then ``max_model_len`` tokens, and the window caps
        nothing. Pass the engine's per-step token budget to get the cap.
        """
        _check_positive(type(self).__name__, max_model_len=max_model_len)
        step_tokens = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        _check_positive(type(self).__name__, max_num_batched_tokens=step_tokens)
        num_tokens = min(self.sliding_window - 1 + step_tokens, max_model_len)
        return (cdiv(num_tokens, self.block_size) + 1) * self.page_size_bytes


# --- the engine's allocation plan ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class KVCacheTensor:
    """One KV allocation of ``size`` bytes, shared by the layers in ``shared_by``."""

    size: int
    shared_by: tuple[str, ...]

    def __post_init__(self) -> None:
        _check_positive("KVCacheTensor", size=self.size)
        object.__setattr__(self, "shared_by", tuple(self.shared_by))
        if not self.shared_by:
            raise SpecError("KVCacheTensor.shared_by must name at least one layer")


@dataclasses.dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table (block ``i`` means the same tokens
    in each of them) and their merged spec."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        if not self.layer_names:
            raise SpecError("KVCacheGroupSpec.layer_names must not be empty")
        if len(set(self.layer_names)) != len(self.layer_names):
            raise SpecError(f"KVCacheGroupSpec lists a layer twice: {list(self.layer_names)}")


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
    """How the engine laid out its KV cache: ``num_blocks`` blocks per layer,
    the allocations and the groups. Validated so that every allocation is
    large enough for the layers that share it."""

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]

    _layer_group: dict[str, int] = dataclasses.field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        _check_positive("KVCacheConfig", num_blocks=self.num_blocks)
        object.__setattr__(self, "kv_cache_tensors", tuple(self.kv_cache_tensors))
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))
        for index, group in enumerate(self.kv_cache_groups):
            for name in group.layer_names:
                if name in self._layer_group:
                    raise SpecError(
                        f"layer {name!r} is in KV-cache groups {self._layer_group[name]} "
                        f"and {index}; a layer belongs to exactly one group"
                    )
                self._layer_group[name] = index
        for tensor in self.kv_cache_tensors:
            for name in tensor.shared_by:
                if name not in self._layer_group:
                    raise SpecError(
                        f"KVCacheTensor is shared by layer {name!r}, which is in no "
                        f"KV-cache group; layers: {sorted(self._layer_group)}"
                    )
                needed = self.num_blocks * self.spec_for(name).page_size_bytes
                if tensor.size < needed:
                    raise SpecError(
                        f"KVCacheTensor of {tensor.size} bytes is too small for layer "
                        f"{name!r}: {self.num_blocks} blocks x "
                        f"{self.spec_for(name).page_size_bytes} bytes = {needed}"
                    )

    @classmethod
    def uniform(
        cls, num_blocks: int, layer_names: Iterable[str], spec: KVCacheSpec
    ) -> KVCacheConfig:
        """One group of identical layers, one allocation per layer."""
        names = tuple(layer_names)
        tensors = tuple(
            KVCacheTensor(size=num_blocks * spec.page_size_bytes, shared_by=(n,)) for n in names
        )
        return cls(num_blocks, tensors, (KVCacheGroupSpec(names, spec),))

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Every layer, in group order."""
        return tuple(n for g in self.kv_cache_groups for n in g.layer_names)

    def group_index(self, layer_name: str) -> int:
        try:
            return self._layer_group[layer_name]
        except KeyError:
            raise SpecError(
                f"layer {layer_name!r} is in no KV-cache group; layers: {sorted(self._layer_group)}"
            ) from None

    def spec_for(self, layer_name: str) -> KVCacheSpec:
        return self.kv_cache_groups[self.group_index(layer_name)].kv_cache_spec

    def single_group(self) -> KVCacheGroupSpec:
        """The one group, for connectors that support no hybrid models."""
        if len(self.kv_cache_groups) != 1:
            raise SpecError(
                "this connector supports exactly one KV-cache group, "
                f"got {len(self.kv_cache_groups)}"
            )
        return self.kv_cache_groups[0]
