"""Block geometry: where block ``b`` of each layer lives, in bytes.

Owns the derivation of per-layer block geometry from the KV tensors an
engine hands to ``register_kv_caches`` (shape, strides and spec; a layout is
never assumed), the grouping of layers into allocations (*regions*: layers
that are views of one allocation are registered once).

A layer is a list of *segments*. Segment ``s`` of block ``b`` occupies
``[offset + b * block_stride_bytes, + block_nbytes)`` relative to its
region's base. Layouts seen in engines:

- blocks first, ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
  (vLLM CPU), ``[num_blocks, 2, block_size, heads, head]`` (FlashInfer),
  ``[num_blocks, block_size, head_size]`` (MLA): one segment, a whole block;
- KV first, ``[2, num_blocks, block_size, heads, head]`` with NHD or HND
  strides (FlashAttention): two segments, K and V.

Works on torch tensors and numpy arrays alike (duck-typed: torch is never
imported here unless a torch tensor is passed in). Imports numpy,
``rdma_kv.errors`` and ``rdma_kv.connector.specs``; never the transport.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from rdma_kv.connector.specs import AttentionSpec, KVCacheConfig, KVCacheSpec, normalize_dtype
from rdma_kv.errors import SpecError

__all__ = [
    "KVCacheGeometry",
    "LayerGeometry",
    "Layout",
    "Region",
    "Segment",
    "derive_geometry",
    "derive_layer_geometry",
    "region_bytes",
    "storage_address",
]


class Layout(str, enum.Enum):
    """Where the block dimension sits in a layer's tensor."""

    BLOCKS_FIRST = "blocks_first"  # [num_blocks, ...]: a block's K and V together
    KV_FIRST = "kv_first"  # [2, num_blocks, ...]: K blocks, then V blocks


@dataclasses.dataclass(frozen=True)
class Segment:
    """One contiguous piece of every block of a layer (K, V, or both)."""

    offset: int
    """Byte offset of block 0's piece from the region base."""
    block_stride_bytes: int
    """Bytes from block ``b``'s piece to block ``b + 1``'s."""
    block_nbytes: int
    """Length of the piece in bytes."""


@dataclasses.dataclass(frozen=True)
class Region:
    """One allocation that holds the KV of one or more layers."""

    base_address: int
    nbytes: int
    device: str
    layer_names: tuple[str, ...]

    @property
    def memory_type(self) -> str:
        """The transport's name for this memory: "cuda" (``device`` is
        ``cuda`` or ``cuda:N``) or "host" (``cpu``). Other devices cannot be
        registered."""
        kind = self.device.partition(":")[0]
        if kind not in ("cpu", "cuda"):
            raise SpecError(f"KV cache on device {self.device!r} cannot be registered; "
                            "rdma-kv moves KV caches in host (cpu) or CUDA memory")
        return "host" if kind == "cpu" else "cuda"


@dataclasses.dataclass(frozen=True)
class LayerGeometry:
    """Block geometry of one layer inside region ``region_index``."""

    name: str
    region_index: int
    num_blocks: int
    layout: Layout
    segments: tuple[Segment, ...]
    memory_order: str = ""
    """The tensor's logical shape (``B`` for the block dim) and its dims from
    outermost to innermost in memory, e.g. ``(2,B,16,8,128) order 0,1,2,3,4``
    (NHD) against ``... order 0,1,3,2,4`` (HND): what two engines must share
    to copy block for block. Independent of ``num_blocks``."""
    kv_layout: str = ""
    """``NHD`` (a block's tokens outside its heads), ``HND`` (heads outside
    tokens) or ``MLA``; empty when the sizes cannot tell (block size equal to
    the number of KV heads): ``memory_order`` still decides."""
    head_nbytes: int = 0
    """Bytes of one KV head in one K/V part of a block, when each head's share
    of a part is contiguous (heads are the outermost dim after K/V, as in
    vLLM's CPU and HND layouts); 0 when it is not (NHD) or for MLA. A
    segment then holds ``block_nbytes // (head_nbytes * num_kv_heads)``
    parts (1, or 2 when K and V sit side by side in one segment), and heads
    ``[a, b)`` of part ``k`` start at ``k * num_kv_heads * head_nbytes + a *
    head_nbytes``: what a reader of a head slice (heterogeneous tensor
    parallel) needs."""
    group: int = 0
    """The KV-cache group of the layer (``KVCacheConfig.group_index``): its
    blocks are indexed by that group's block ids."""

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of this layer, all segments together."""
        return sum(s.block_nbytes for s in self.segments)


@dataclasses.dataclass(frozen=True)
class KVCacheGeometry:
    """The geometry of a whole KV cache: its regions and its layers, the
    layers in the order of the ``KVCacheConfig`` (identical on every engine
    with the same model, so two sides plan matching ranges)."""

    regions: tuple[Region, ...]
    layers: tuple[LayerGeometry, ...]

    def layer(self, name: str) -> LayerGeometry:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise SpecError(f"no geometry for layer {name!r}; layers: {[l.name for l in self.layers]}")

    @property
    def num_blocks(self) -> int:
        """Blocks every layer has (block ids below it index every layer)."""
        return min(layer.num_blocks for layer in self.layers)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id across every layer."""
        return sum(layer.block_nbytes for layer in self.layers)


# --- reading tensors --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _TensorInfo:
    data_ptr: int
    base_address: int
    storage_nbytes: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # bytes
    itemsize: int
    dtype: str
    device: str


def _is_torch(tensor: Any) -> bool:
    return hasattr(tensor, "untyped_storage")


def _tensor_info(tensor: Any) -> _TensorInfo:
    if _is_torch(tensor):
        storage = tensor.untyped_storage()
        itemsize = tensor.element_size()
        return _TensorInfo(
            data_ptr=tensor.data_ptr(),
            base_address=storage.data_ptr(),
            storage_nbytes=storage.nbytes(),
            shape=tuple(tensor.shape),
            strides=tuple(s * itemsize for s in tensor.stride()),
            itemsize=itemsize,
            dtype=normalize_dtype(tensor.dtype),
            device=str(tensor.device),
        )
    if isinstance(tensor, np.ndarray):
        root = tensor
        while isinstance(root.base, np.ndarray):
            root = root.base
        start = root.__array_interface__["data"][0]
        low = sum((n - 1) * s for n, s in zip(root.shape, root.strides) if s < 0 and n > 0)
        high = sum((n - 1) * s for n, s in zip(root.shape, root.strides) if s > 0 and n > 0)
        return _TensorInfo(
            data_ptr=tensor.__array_interface__["data"][0],
            base_address=start + low,
            storage_nbytes=high - low + root.itemsize,
            shape=tuple(tensor.shape),
            strides=tuple(tensor.strides),
            itemsize=tensor.itemsize,
            dtype=normalize_dtype(tensor.dtype),
            device="cpu",
        )
    raise SpecError(
        f"KV caches must be torch tensors or numpy arrays, got {type(tensor).__name__}"
    )


def storage_address(tensor: Any) -> int:
    """Address of the first byte of the storage that holds ``tensor``: index
    ``0`` of ``region_bytes(tensor)``."""
    return _tensor_info(tensor).base_address


def region_bytes(tensor: Any) -> np.ndarray:
    """A writable uint8 view of the whole storage that holds ``tensor`` (host
    memory only). Byte ``i`` of it is at ``storage_address(tensor) + i``; a
    segment's offset indexes it after adding ``region.base_address -
    storage_address(tensor)`` (zero unless overlapping storages were merged)."""
    info = _tensor_info(tensor)
    if info.device != "cpu":
        raise SpecError(
            f"cannot view KV memory on device {info.device!r} from the host; "
            "copy blocks through the device API instead"
        )
    if _is_torch(tensor):
        import torch  # already imported by whoever made the tensor

        whole = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())
        return whole.numpy()
    root = tensor
    while isinstance(root.base, np.ndarray):
        root = root.base
    if root.flags.f_contiguous and not root.flags.c_contiguous:
        root = root.T  # same memory, same first byte, C order
    if not root.flags.c_contiguous:
        raise SpecError("the numpy array owning the KV memory is not contiguous")
    return root.reshape(-1).view(np.uint8)


# --- deriving geometry ------------------------------------------------------


def _block_piece(info: _TensorInfo, skip: set[int]) -> int | None:
    """Bytes of the dense piece spanned by the dims not in ``skip``, or None
    when those dims do not form one contiguous range."""
    dims = sorted(
        (info.strides[d], info.shape[d])
        for d in range(len(info.shape))
        if d not in skip and info.shape[d] != 1
    )
    expected = info.itemsize
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return expected


def _try_layout(
    info: _TensorInfo, block_dim: int, kv_dim: int | None, num_blocks: int
) -> tuple[Layout, tuple[Segment, ...]] | str:
    """Segments for the given block and K/V dimensions, or why not."""
    skip = {block_dim} if kv_dim is None else {block_dim, kv_dim}
    piece = _block_piece(info, skip)
    if piece is None:
        return (
            f"a block is not contiguous with block dim {block_dim}"
            + ("" if kv_dim is None else f" and K/V dim {kv_dim}")
            + f" (shape {info.shape}, byte strides {info.strides})"
        )
    block_stride = info.strides[block_dim]
    if block_stride < piece and num_blocks > 1:
        return f"block stride {block_stride} is smaller than a block's {piece} bytes"
    start = info.data_ptr - info.base_address
    parts = [start] if kv_dim is None else [start + k * info.strides[kv_dim] for k in (0, 1)]
    if min(parts) < 0:
        return f"negative strides are not supported (byte strides {info.strides})"
    parts.sort()
    segments = [Segment(parts[0], block_stride, piece)]
    for offset in parts[1:]:
        last = segments[-1]
        if offset == last.offset + last.block_nbytes:  # K and V adjacent: one piece
            segments[-1] = Segment(last.offset, block_stride, last.block_nbytes + piece)
        else:
            segments.append(Segment(offset, block_stride, piece))
    layout = Layout.BLOCKS_FIRST if block_dim == 0 else Layout.KV_FIRST
    return layout, tuple(segments)


def derive_layer_geometry(
    name: str, tensor: Any, spec: KVCacheSpec, num_blocks: int, region_index: int = 0
) -> LayerGeometry:
    """Geometry of one layer's KV tensor, checked against ``spec``.

    Accepts ``[2, num_blocks, ...]`` (K/V first), ``[num_blocks, 2, ...]``
    and ``[num_blocks, ...]`` whenever the remaining dims hold exactly one
    block's K, V (or both, or the MLA latent) and are dense in memory in
    some order (so NHD and HND strides both work). Raises
    :class:`SpecError` naming the shape, strides and what was expected.
    """
    if not isinstance(spec, AttentionSpec):
        raise SpecError(
            f"layer {name!r}: geometry needs an AttentionSpec, got {type(spec).__name__}"
        )
    info = _tensor_info(tensor)
    if info.dtype != spec.dtype:
        raise SpecError(
            f"layer {name!r}: tensor dtype {info.dtype} does not match spec dtype {spec.dtype}"
        )
    shape = info.shape
    per_kv = spec.block_size * spec.num_kv_heads * spec.head_size
    per_block = spec.num_kv_tensors * per_kv
    candidates: list[tuple[int, int | None]] = []
    if len(shape) >= 2 and shape[0] == num_blocks and math.prod(shape[1:]) == per_block:
        candidates.append((0, None))
    if not spec.use_mla and len(shape) >= 3 and math.prod(shape[2:]) == per_kv:
        if shape[0] == 2 and shape[1] == num_blocks:
            candidates.append((1, 0))
        if shape[0] == num_blocks and shape[1] == 2:
            candidates.append((0, 1))
    if not candidates:
        raise SpecError(
            f"layer {name!r}: KV tensor of shape {shape} does not hold {num_blocks} blocks of "
            f"{spec.block_size} tokens x {spec.num_kv_heads} heads x {spec.head_size} "
            f"({'MLA latent' if spec.use_mla else 'K and V'}); expected [num_blocks, ...], "
            "[2, num_blocks, ...] or [num_blocks, 2, ...]"
        )
    found: dict[tuple[Layout, tuple[Segment, ...]], None] = {}
    reasons = []
    for block_dim, kv_dim in candidates:
        result = _try_layout(info, block_dim, kv_dim, num_blocks)
        if isinstance(result, str):
            reasons.append(result)
        else:
            found[result] = None
    # [num_blocks, 2, ...] read with and without its K/V dim gives the same
    # segments once adjacent K and V merge; only different answers conflict.
    distinct = {segs for _, segs in found}
    if not found:
        raise SpecError(f"layer {name!r}: unsupported KV layout: {'; '.join(reasons)}")
    if len(distinct) > 1:
        raise SpecError(
            f"layer {name!r}: shape {shape} is ambiguous with num_blocks={num_blocks} "
            f"(it reads as several layouts: {[l.value for l, _ in found]})"
        )
    layout, segments = next(iter(found))
    for seg in segments:
        end = seg.offset + (num_blocks - 1) * seg.block_stride_bytes + seg.block_nbytes
        if end > info.storage_nbytes:
            raise SpecError(
                f"layer {name!r}: block {num_blocks - 1} ends at byte {end}, past the "
                f"{info.storage_nbytes}-byte allocation"
            )
    block_dim = 0 if layout is Layout.BLOCKS_FIRST else 1
    kv, heads = _kv_and_heads_dims(info, spec, block_dim)
    return LayerGeometry(name, region_index, num_blocks, layout, segments,
                         _memory_order(info, block_dim, heads), _kv_layout(info, spec, block_dim, kv, heads),
                         _head_nbytes(info, spec, block_dim, kv, heads))


def _kv_and_heads_dims(info: _TensorInfo, spec: AttentionSpec, block_dim: int) -> tuple[int | None, int | None]:
    """The K/V dim (size 2) and the KV-heads dim of a layer's tensor, each
    None when absent (MLA has neither). The heads dim is the one of size
    ``num_kv_heads``, the outermost in memory when sizes collide; a size-2
    dim next to the block dim is K/V only if another dim holds the heads
    (vLLM's CPU layout ``[blocks, heads, block_size, 2 * head]`` with 2
    heads would otherwise read as K/V)."""
    if spec.use_mla:
        return None, None
    shape, n = info.shape, spec.num_kv_heads
    per_kv = spec.block_size * n * spec.head_size
    kv = None
    if block_dim == 1 and shape[0] == 2:
        kv = 0
    elif block_dim == 0 and len(shape) >= 3 and shape[1] == 2 and math.prod(shape[2:]) == per_kv:
        kv = 1
    dims = [d for d in range(len(shape)) if d not in (block_dim, kv) and shape[d] == n]
    if not dims and kv is not None and n == 2 and block_dim == 0:
        return None, kv
    return kv, (max(dims, key=lambda d: info.strides[d]) if dims else None)


def _head_nbytes(info: _TensorInfo, spec: AttentionSpec, block_dim: int, kv: int | None,
                 heads: int | None) -> int:
    if heads is None:
        return 0
    if spec.num_kv_heads == 1:
        return spec.block_size * spec.head_size * info.itemsize * (2 if kv is None else 1)
    stride = info.strides[heads]
    inner = [d for d in range(len(info.shape))
             if d not in (block_dim, kv, heads) and info.shape[d] != 1]
    # Contiguous per head iff every other dim of the (dense) part lies inside
    # one head's stride: heads are then the part's outermost dim.
    if any(info.strides[d] >= stride for d in inner):
        return 0
    return stride


def _memory_order(info: _TensorInfo, block_dim: int, heads: int | None = None) -> str:
    # Dims of size 1 have no meaningful stride (torch gives them any). The
    # heads dim is written ``H``, so ranks of one model at different TP
    # sizes (different heads per rank) describe the same order.
    dims = sorted((d for d in range(len(info.shape)) if info.shape[d] != 1 or d == heads),
                  key=lambda d: -info.strides[d])
    shape = ",".join("B" if d == block_dim else "H" if d == heads else str(n) for d, n in enumerate(info.shape))
    return f"({shape}) order {','.join(map(str, dims))}"


def _kv_layout(info: _TensorInfo, spec: AttentionSpec, block_dim: int, kv: int | None,
               heads: int | None) -> str:
    if spec.use_mla:
        return "MLA"
    if heads is None:
        return "NHD" if spec.num_kv_heads == 1 else ""  # one head: both orders are the same bytes
    tokens = [d for d in range(len(info.shape))
              if d not in (block_dim, kv, heads) and info.shape[d] == spec.block_size]
    if len(tokens) != 1:
        return ""
    return "NHD" if info.strides[tokens[0]] > info.strides[heads] else "HND"


def derive_geometry(
    kv_caches: Mapping[str, Any], kv_cache_config: KVCacheConfig
) -> KVCacheGeometry:
    """Geometry of every layer in ``kv_caches``, grouped by allocation.

    Layers that are views of one allocation (same device and storage base
    address) share one :class:`Region`, so the allocation is registered
    once. Storages whose byte ranges overlap (e.g. torch tensors made from
    numpy views of one array, each with its own storage object) are merged
    into one region too; merely adjacent ones are not, since separate device
    allocations cannot be registered as one. Layers are ordered as in
    ``kv_cache_config``, so both sides of a transfer list them identically.
    """
    expected = kv_cache_config.layer_names
    missing = [n for n in expected if n not in kv_caches]
    extra = [n for n in kv_caches if n not in set(expected)]
    if missing or extra:
        raise SpecError(
            f"KV caches do not match the KV-cache config: missing layers {missing}, "
            f"unknown layers {extra}"
        )
    infos = {name: _tensor_info(kv_caches[name]) for name in expected}
    # Union overlapping [base, base + nbytes) ranges per device.
    spans = sorted({(i.device, i.base_address, i.storage_nbytes) for i in infos.values()})
    merged: list[list[Any]] = []  # [device, start, end]
    for device, base, nbytes in spans:
        if merged and merged[-1][0] == device and base < merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], base + nbytes)
        else:
            merged.append([device, base, base + nbytes])
    order: dict[int, int] = {}  # merged index -> region index, in layer order
    layers = []
    for name in expected:
        info = infos[name]
        span = next(
            k for k, (dev, lo, hi) in enumerate(merged)
            if dev == info.device and lo <= info.base_address < hi
        )
        index = order.setdefault(span, len(order))
        layer = derive_layer_geometry(
            name, kv_caches[name], kv_cache_config.spec_for(name), kv_cache_config.num_blocks, index
        )
        shift = info.base_address - merged[span][1]
        segments = tuple(dataclasses.replace(s, offset=s.offset + shift) for s in layer.segments)
        layers.append(dataclasses.replace(layer, segments=segments,
                                          group=kv_cache_config.group_index(name)))
    regions = []
    for span, index in sorted(order.items(), key=lambda item: item[1]):
        device, lo, hi = merged[span]
        names = tuple(layer.name for layer in layers if layer.region_index == index)
        regions.append(Region(lo, hi - lo, device, names))
    return KVCacheGeometry(tuple(regions), tuple(layers))
