"""The wire form of what two engines compare and describe at the handshake:
the compatibility record (:class:`CompatInfo`, with its hash and a mismatch
report naming both sides' values) and a rank's block geometry
(:class:`GeometryWire`, bounds-checked on the way in so a peer cannot make
us read outside what it registered, nor prepare more descriptors than
``MAX_SLOTS``).

The side channel's messages (``wire``) carry these; nothing here knows of
sockets or of the messages themselves. Imports the standard library,
msgspec, ``rdma_kv.errors`` and the connector's ``geometry``.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

import msgspec

from rdma_kv.connector.geometry import KVCacheGeometry, LayerGeometry, Layout, Region, Segment
from rdma_kv.errors import MetadataError

__all__ = [
    "MAX_BLOCKS_PER_LAYER",
    "MAX_LAYERS",
    "MAX_SLOTS",
    "CompatInfo",
    "GeometryWire",
    "LayerWire",
    "RegionWire",
    "SegmentWire",
    "Str",
    "U64",
]

MAX_LAYERS = 4096
MAX_BLOCKS_PER_LAYER = 1 << 24
MAX_SLOTS = 1 << 26
"""Descriptors a peer's geometry may make us prepare (20 bytes each on the
consumer: 1.3 GB at this cap). Without it a producer could announce 2**40
blocks of stride 0 inside a one-byte region and exhaust the consumer's memory."""

U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at 2**64 anyway
Str = Annotated[str, msgspec.Meta(max_length=1024)]


class CompatInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What two engines must agree on to copy KV heads block for block,
    whatever their tensor-parallel sizes: the model's shape, not a rank's
    (a rank's share, its heads and TP size, travels in :class:`RankInfo`)."""

    num_layers: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)]
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    total_kv_heads: Annotated[int, msgspec.Meta(ge=0)]
    """The model's KV heads (1 for MLA), before tensor parallelism shards them."""
    head_size: Annotated[int, msgspec.Meta(ge=0)]
    dtype: Str
    spec: Str
    """The KV-cache spec's kind and block size, and its page size per KV head."""
    layouts: Annotated[list[Str], msgspec.Meta(max_length=MAX_LAYERS)]
    """Per layer: layout, segment bytes per KV head, bytes of one head's
    slice, and memory order with the heads dim written ``H``, e.g.
    ``blocks_first:4096:2048:(B,H,16,64) order 0,1,2,3``."""
    kv_layout: Str = ""
    """``NHD``, ``HND`` or ``MLA`` (geometry.LayerGeometry.kv_layout)."""
    attention_backend: Str = ""
    """The engine's attention backend (vLLM's name, e.g. ``FLASH_ATTN``); empty outside vLLM."""
    layer_groups: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_LAYERS)] = []
    """Per layer, its KV-cache group; empty for a single group (hybrid
    models: block ids travel per group, so both sides must group alike)."""
    transfer_mode: Str = "pull"
    """``pull`` (the decode reads) or ``push`` (the producer writes): both
    engines must run the same mode."""
    model_id: Str = ""
    """Which model's KV this is (``RdmaSettings.model_id``): two models of
    one shape must not exchange KV. Empty: not known (an engine outside
    vLLM that names none), compared with nothing."""
    kv_cache_scales: Str = ""
    """The per-layer k/v scales of a quantized (fp8) KV cache, or their
    digest (``RdmaSettings.kv_cache_scales``): the same bytes under other
    scales are other values. Empty: an unquantized cache, or an engine
    outside vLLM that names none."""

    def compat_hash(self) -> str:
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:32]

    def mismatches(self, other: CompatInfo, mine: str = "local", theirs: str = "remote") -> list[str]:
        """One line per differing field, naming both sides' values; no line
        means the two caches may exchange KV. A ``model_id`` is compared only
        when both sides name one."""
        out = []
        for name in self.__struct_fields__:
            a, b = getattr(self, name), getattr(other, name)
            if name == "model_id" and not (a and b):
                continue
            if a != b:
                if name == "layouts":
                    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                    a = f"{len(a)} layers, layer {first}: {a[first] if first < len(a) else '-'}"
                    b = f"{len(b)} layers, layer {first}: {b[first] if first < len(b) else '-'}"
                out.append(f"{name}: {mine} {_shown(a)} vs {theirs} {_shown(b)}")
                if name == "block_size":
                    out[-1] += (" (blocks are not remapped between block sizes: the KV is not "
                                "transferred and the request is computed locally, or fails under "
                                "kv_load_failure_policy=fail; start both engines with the same "
                                "--block-size)")
                elif name == "model_id":
                    out[-1] += (" (two different models: one would generate from the other's KV; if both "
                                "engines run one model, loaded from different paths, start both with the "
                                "same --served-model-name, or set the same kv_connector_extra_config "
                                "'model_id' on both)")
                elif name == "kv_cache_scales":
                    out[-1] += (" (the fp8 KV caches' per-layer k/v scales differ: the same bytes are other "
                                "values on each side; load both engines' scales from one checkpoint)")
        return out


def _shown(value: object, limit: int = 160) -> str:
    """``repr(value)``, cut at ``limit`` characters (a peer's field may be
    thousands of them: a mismatch line names the values, not all of them)."""
    shown = repr(value)
    return shown if len(shown) <= limit else f"{shown[:limit]}... ({len(shown)} characters)"


class SegmentWire(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    offset: U64
    block_stride_bytes: U64
    block_nbytes: Annotated[int, msgspec.Meta(ge=1)]


class LayerWire(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    name: Str
    region_index: Annotated[int, msgspec.Meta(ge=0)]
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCKS_PER_LAYER)]
    layout: Layout
    segments: Annotated[list[SegmentWire], msgspec.Meta(min_length=1, max_length=8)]
    head_nbytes: U64 = 0
    """``LayerGeometry.head_nbytes``: lets a reader slice heads out of a block."""
    group: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)] = 0
    """The layer's KV-cache group (last, with a default: a single-group peer's layers need not send it)."""


class RegionWire(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    base_address: U64
    nbytes: Annotated[int, msgspec.Meta(ge=1)]


class GeometryWire(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    regions: Annotated[list[RegionWire], msgspec.Meta(min_length=1, max_length=MAX_LAYERS)]
    layers: Annotated[list[LayerWire], msgspec.Meta(max_length=MAX_LAYERS)]

    @classmethod
    def from_geometry(cls, geometry: KVCacheGeometry) -> GeometryWire:
        return cls(
            [RegionWire(r.base_address, r.nbytes) for r in geometry.regions],
            [
                LayerWire(
                    layer.name, layer.region_index, layer.num_blocks, layer.layout,
                    [SegmentWire(s.offset, s.block_stride_bytes, s.block_nbytes)
                     for s in layer.segments],
                    layer.head_nbytes,
                    layer.group,
                )
                for layer in geometry.layers
            ],
        )

    def to_geometry(self) -> KVCacheGeometry:
        """Checked: every block of every segment lies inside its region, so a
        peer cannot make us read outside what it registered."""
        regions = tuple(Region(r.base_address, r.nbytes, "remote", ()) for r in self.regions)
        slots = sum(layer.num_blocks * len(layer.segments) for layer in self.layers)
        if slots > MAX_SLOTS:
            raise MetadataError(
                f"peer geometry lists {slots} block descriptors, over the limit of {MAX_SLOTS}"
            )
        layers = []
        for layer in self.layers:
            if layer.region_index >= len(regions):
                raise MetadataError(
                    f"peer geometry: layer {layer.name!r} names region {layer.region_index}, "
                    f"but only {len(regions)} regions were sent"
                )
            region = regions[layer.region_index]
            size = region.nbytes
            if region.base_address + size >= 2**64:
                raise MetadataError(f"peer geometry: region {layer.region_index} ends past the "
                                    "64-bit address space")
            for seg in layer.segments:
                end = seg.offset + (layer.num_blocks - 1) * seg.block_stride_bytes + seg.block_nbytes
                if end > size:
                    raise MetadataError(
                        f"peer geometry: layer {layer.name!r} block {layer.num_blocks - 1} ends at "
                        f"byte {end}, beyond its region of {size} bytes"
                    )
            layers.append(LayerGeometry(
                layer.name, layer.region_index, layer.num_blocks, layer.layout,
                tuple(Segment(s.offset, s.block_stride_bytes, s.block_nbytes) for s in layer.segments),
                head_nbytes=layer.head_nbytes,
                group=layer.group,
            ))
        return KVCacheGeometry(regions, tuple(layers))
