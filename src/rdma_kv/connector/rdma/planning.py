"""Block ids to descriptor indices, and the compatibility record of a KV cache.

Owns the *slot table* of one side's KV cache: one descriptor per (layer,
segment, block), listed layer-major, prepared once with the transport at
startup (local) or handshake (remote). A request's blocks then become an
index array (vectorised, no Python loop per block), and the transport
merges descriptors contiguous on both sides into one operation: ops per
request = contiguous runs. This is NIXL's prepared-list design; it costs
20 bytes per slot per side (32 layers x 100k blocks: 64 MB).

Also owns :func:`compat_info`, what two engines must agree on.

Imports numpy, ``rdma_kv.errors``, ``rdma_kv.runs``, the connector's ``geometry`` and
``specs``, ``rdma.wire``, and the transport's ``DescList`` (plain numpy)
through ``rdma.transport_api``.
"""

from __future__ import annotations

import numpy as np

from rdma_kv.connector.geometry import KVCacheGeometry
from rdma_kv.connector.rdma.transport_api import DescList
from rdma_kv.connector.rdma.wire import CompatInfo
from rdma_kv.connector.specs import AttentionSpec, KVCacheConfig
from rdma_kv.errors import DescriptorError
from rdma_kv.runs import run_starts

__all__ = ["SlotTable", "compat_info", "count_runs"]


class SlotTable:
    """Descriptor ``row_base[r] + b`` is block ``b`` of row ``r`` (a layer's segment)."""

    def __init__(self, geometry: KVCacheGeometry) -> None:
        rows = [(layer, seg) for layer in geometry.layers for seg in layer.segments]
        if not rows:
            raise DescriptorError("a KV cache with no layers has nothing to transfer")
        self.num_blocks = min(layer.num_blocks for layer in geometry.layers)
        counts = np.array([layer.num_blocks for layer, _ in rows], dtype=np.int64)
        self.row_base = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        addrs, lengths = [], []
        for layer, seg in rows:
            base = geometry.regions[layer.region_index].base_address + seg.offset
            blocks = np.arange(layer.num_blocks, dtype=np.uint64)
            addrs.append(np.uint64(base) + blocks * np.uint64(seg.block_stride_bytes))
            lengths.append(np.full(layer.num_blocks, seg.block_nbytes, dtype=np.uint64))
        self.descs = DescList(np.concatenate(addrs), np.concatenate(lengths))
        self.row_nbytes = np.array([seg.block_nbytes for _, seg in rows], dtype=np.int64)
        self.bytes_per_block = int(self.row_nbytes.sum())

    @property
    def num_rows(self) -> int:
        return len(self.row_base)

    def indices(self, block_ids: np.ndarray, side: str) -> np.ndarray:
        """Descriptor indices of ``block_ids`` in every row, row-major."""
        if block_ids.size and (int(block_ids.min()) < 0 or int(block_ids.max()) >= self.num_blocks):
            bad = block_ids[(block_ids < 0) | (block_ids >= self.num_blocks)]
            raise DescriptorError(
                f"{side} block ids {bad[:8].tolist()} are outside [0, {self.num_blocks}) "
                f"of the {side} KV cache"
            )
        return (self.row_base[:, None] + block_ids[None, :]).ravel()


def count_runs(local_ids: np.ndarray, remote_ids: np.ndarray, rows: int) -> int:
    """Operations a read of these blocks needs when blocks are adjacent in
    memory (blocks-first layouts): runs contiguous on both sides, per row."""
    ones = np.ones(local_ids.size, dtype=np.int64)  # a block is one unit long in block ids
    return rows * len(run_starts(ones, ((local_ids, None), (remote_ids, None))))


def compat_info(kv_cache_config: KVCacheConfig, geometry: KVCacheGeometry, tp_size: int,
                attention_backend: str = "") -> CompatInfo:
    """What this engine's KV cache is, for the handshake to compare: model
    shape, dtype, block size, spec, TP size, the attention backend, and per
    layer the layout, segment sizes and memory order (so an NHD and an HND
    cache of one shape differ)."""
    spec = kv_cache_config.single_group().kv_cache_spec
    layouts = [
        f"{layer.layout.value}:" + ",".join(str(s.block_nbytes) for s in layer.segments)
        + (f":{layer.memory_order}" if layer.memory_order else "")
        for layer in geometry.layers
    ]
    heads, head_size, dtype = ((spec.num_kv_heads, spec.head_size, spec.dtype)
                               if isinstance(spec, AttentionSpec) else (0, 0, ""))
    return CompatInfo(
        num_layers=len(geometry.layers),
        block_size=spec.block_size,
        num_kv_heads=heads,
        head_size=head_size,
        dtype=dtype,
        spec=spec.type_id,
        layouts=layouts,
        tp_size=tp_size,
        kv_layout="/".join(sorted({layer.kv_layout for layer in geometry.layers})),
        attention_backend=attention_backend,
    )
