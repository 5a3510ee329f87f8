"""Block ids to slot indices: the slot tables of a KV cache.

Owns the *slot table* of one side's KV cache: one descriptor per (layer,
segment, block), listed layer-major, prepared once with the transport at
startup (local) or handshake (remote). A request's blocks then become an
index array (vectorised, no Python loop per block), and the transport
merges descriptors contiguous on both sides into one operation: ops per
request = contiguous runs. This is NIXL's prepared-list design; it costs
20 bytes per slot per side (32 layers x 100k blocks: 64 MB).

A slot table may cover a *head slice* of every block (heads ``[first,
first + count)`` of a rank's ``of``): then each (layer, segment, K/V part)
row describes only those heads' bytes. That is how a consumer rank reads
the heads it owns out of a producer rank that holds more, or into a block
that holds more (heterogeneous tensor parallel, ``topology``). It needs
each head's share of a block part to be contiguous
(``LayerGeometry.head_nbytes``; vLLM's CPU and HND layouts): an NHD cache
is refused with an error saying so.

Hybrid models have several KV-cache groups, each with its own block table:
a row belongs to its layer's group and takes that group's block ids, so a
load's block ids travel per group (a sliding-window group's list is shorter:
only the blocks inside the window are read).

Also owns :class:`BlockPairs`, a load's block ids in the one form the
slot tables take (per group, int64 arrays, local and remote paired), made
once per load.

Imports numpy, ``rdma_kv.errors``, ``rdma_kv.runs``, the connector's ``geometry``
and ``types``, and the transport's ``DescList`` (plain numpy) through
``rdma.transport_api``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Union

import numpy as np

from rdma_kv.connector.geometry import KVCacheGeometry, LayerGeometry, Segment
from rdma_kv.connector.rdma.transport_api import DescList
from rdma_kv.connector.types import GroupBlockIds
from rdma_kv.errors import DescriptorError
from rdma_kv.runs import run_starts

__all__ = ["BlockPairs", "HeadSlice", "SlotTable", "block_arrays", "count_runs"]


@dataclasses.dataclass(frozen=True)
class HeadSlice:
    """Heads ``[first, first + count)`` of the ``of`` KV heads a rank holds."""

    first: int
    count: int
    of: int

    def __post_init__(self) -> None:
        if not (0 <= self.first and 1 <= self.count and self.first + self.count <= self.of):
            raise DescriptorError(f"head slice [{self.first}, {self.first + self.count}) is outside "
                                  f"the {self.of} KV heads of the rank")

    @property
    def whole(self) -> bool:
        return self.count == self.of


def _pieces(layer: LayerGeometry, seg: Segment, heads: HeadSlice | None) -> list[tuple[int, int]]:
    """(offset from the segment's block start, length) of the bytes of ``heads`` in one block."""
    hb = layer.head_nbytes
    if heads is None or heads.whole and (hb == 0 or seg.block_nbytes % (hb * heads.of)):
        return [(0, seg.block_nbytes)]
    # A whole slice is cut per K/V part too: its rows then pair with a peer's
    # that holds more heads (FlashInfer's [blocks, 2, heads, ...] keeps K and
    # V of a block in one segment, two parts).
    if hb == 0 or seg.block_nbytes % (hb * heads.of):
        raise DescriptorError(
            f"layer {layer.name!r} ({layer.kv_layout or layer.layout.value}, {layer.memory_order}): a KV "
            "head's share of a block is not contiguous, so heads cannot be read out of a block; "
            "tensor-parallel sizes that split heads differently need the heads outside the tokens "
            "(vLLM's CPU layout, or HND on GPU: VLLM_KV_CACHE_LAYOUT=HND on both engines), or "
            "equal TP sizes")
    part = hb * heads.of
    return [(k * part + heads.first * hb, heads.count * hb) for k in range(seg.block_nbytes // part)]


class SlotTable:
    """Descriptor ``row_base[r] + b`` is block ``b`` of row ``r``: a layer's
    segment, or with ``heads`` one K/V part of it cut to those heads; row
    ``r`` belongs to KV-cache group ``row_group[r]`` (its layer's), whose
    block ids index it."""

    def __init__(self, geometry: KVCacheGeometry, heads: HeadSlice | None = None) -> None:
        rows = [(layer, seg.offset + offset, seg.block_stride_bytes, length)
                for layer in geometry.layers for seg in layer.segments
                for offset, length in _pieces(layer, seg, heads)]
        if not rows:
            raise DescriptorError("a KV cache with no layers has nothing to transfer")
        self.heads = heads
        self.num_blocks = geometry.num_blocks
        counts = np.array([layer.num_blocks for layer, *_ in rows], dtype=np.int64)
        self.row_base = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.row_group = np.array([layer.group for layer, *_ in rows], dtype=np.int64)
        names = [layer.name for layer in geometry.layers]
        self.row_layer = np.array([names.index(layer.name) for layer, *_ in rows], dtype=np.int64)
        """Per row, its layer's index in ``geometry.layers`` (push mode writes a layer's rows)."""
        self.layer_index = {name: i for i, name in enumerate(names)}
        self.num_groups = int(self.row_group.max()) + 1
        addrs, lengths = [], []
        for layer, offset, stride, length in rows:
            base = geometry.regions[layer.region_index].base_address + offset
            blocks = np.arange(layer.num_blocks, dtype=np.uint64)
            addrs.append(np.uint64(base) + blocks * np.uint64(stride))
            lengths.append(np.full(layer.num_blocks, length, dtype=np.uint64))
        self.descs = DescList(np.concatenate(addrs), np.concatenate(lengths))
        self.row_nbytes = np.array([length for *_, length in rows], dtype=np.int64)
        self.bytes_per_block = int(self.row_nbytes.sum())
        self.group_nbytes = np.bincount(self.row_group, weights=self.row_nbytes,
                                        minlength=self.num_groups).astype(np.int64)
        """Bytes of one block id of each group, over the group's layers."""
        self.group_rows = np.bincount(self.row_group, minlength=self.num_groups)
        """Rows of each group (a run of block ids is one operation per row)."""

    @property
    def num_rows(self) -> int:
        return len(self.row_base)

    def mismatch(self, other: SlotTable) -> str | None:
        """Why ``other`` (a peer's table, from the geometry it announced)
        cannot be paired row for row with this one, or None. Rows pair by
        position: each must be of the same layer index, KV-cache group and
        bytes per block on both sides, or the slot indices of the two sides
        would pair one layer's (or group's) blocks with another's."""
        if not np.array_equal(self.row_nbytes, other.row_nbytes):
            return "their slot tables differ in bytes per block; the KV layouts do not match"
        if not np.array_equal(self.row_layer, other.row_layer):
            return "their layers are cut into segments differently; the KV layouts do not match"
        if not np.array_equal(self.row_group, other.row_group):
            return (f"their layers are in other KV-cache groups (per layer here "
                    f"{[int(g) for g in self.row_group[_first_rows(self.row_layer)]][:64]}, there "
                    f"{[int(g) for g in other.row_group[_first_rows(other.row_layer)]][:64]})")
        return None

    def indices(self, block_ids: GroupIds, side: str) -> np.ndarray:
        """Slot indices (into ``descs``, and the list prepared from it) of the
        per-group ``block_ids`` (one 1-D array or sequence per group; a bare
        1-D array is the one group of a single-group cache), row-major: row
        ``r`` contributes ``block_ids[row_group[r]]``."""
        return self._indices(_as_groups(block_ids), side)

    def check_ids(self, ids: np.ndarray, side: str) -> None:
        """DescriptorError unless every one of ``ids`` (int64) is a block of this table."""
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            bad = ids[(ids < 0) | (ids >= self.num_blocks)]
            raise DescriptorError(f"{side} block ids {bad[:8].tolist()} are outside [0, {self.num_blocks}) "
                                  f"of the {side} KV cache")

    def _indices(self, groups: Sequence[np.ndarray], side: str) -> np.ndarray:
        """:meth:`indices` of per-group int64 arrays, taken as they are."""
        if len(groups) != self.num_groups:
            raise DescriptorError(f"{len(groups)} groups of {side} block ids for a {side} KV cache "
                                  f"of {self.num_groups} KV-cache group(s)")
        for ids in groups:
            self.check_ids(ids, side)
        if len(groups) == 1:
            flat: np.ndarray = (self.row_base[:, None] + groups[0][None, :]).ravel()
            return flat
        # Rows of one group take the same ids: one broadcast per group, scattered
        # to where the group's rows start in the row-major output.
        sizes = np.array([ids.size for ids in groups], dtype=np.int64)[self.row_group]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        out = np.empty(int(sizes.sum()), dtype=np.int64)
        for g, ids in enumerate(groups):
            rows = np.flatnonzero(self.row_group == g)
            if ids.size and rows.size:
                where = starts[rows][:, None] + np.arange(ids.size)[None, :]
                out[where.ravel()] = (self.row_base[rows][:, None] + ids[None, :]).ravel()
        return out

    def skipped_nbytes(self, num_skipped_blocks: Sequence[int]) -> int:
        """Bytes of ``num_skipped_blocks[g]`` blocks of each group ``g`` (blocks
        a sliding window kept from being read)."""
        if not any(num_skipped_blocks):  # (every layer attends to the whole prompt: the usual case)
            return 0
        counts = np.asarray(num_skipped_blocks, dtype=np.int64)
        return int((counts * self.group_nbytes[: counts.size]).sum())


def _first_rows(row_layer: np.ndarray) -> np.ndarray:
    """The first row of each layer (rows are listed layer-major)."""
    return np.flatnonzero(np.concatenate([[True], row_layer[1:] != row_layer[:-1]]))


GroupIds = Union[np.ndarray, Sequence[Any]]
"""Block ids per group: a sequence of 1-D arrays or sequences, or one 1-D array (one group)."""


def _as_groups(block_ids: GroupIds) -> list[np.ndarray]:
    if isinstance(block_ids, np.ndarray) and block_ids.ndim == 1:
        return [block_ids.astype(np.int64, copy=False)]
    return [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in block_ids]


def block_arrays(local_block_ids: GroupIds, remote_block_ids: GroupIds
                 ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-group int64 arrays of a load's local and remote block ids, checked
    to pair up: the same number of groups, and of blocks in each group."""
    local, remote = _as_groups(local_block_ids), _as_groups(remote_block_ids)
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} groups of local block ids but {len(remote)} of remote ones")
    for g, (a, b) in enumerate(zip(local, remote)):
        if a.shape != b.shape:
            raise ValueError(f"{a.size} local blocks but {b.size} remote blocks"
                             + (f" in KV-cache group {g}" if len(local) > 1 else ""))
    return local, remote


def count_runs(local_ids: GroupIds, remote_ids: GroupIds, rows: int | SlotTable) -> int:
    """Operations a read of these blocks needs when blocks are adjacent in
    memory (blocks-first layouts): runs contiguous on both sides, per row.
    ``rows`` is a row count (one group) or the slot table (its rows per group)."""
    return _runs(*block_arrays(local_ids, remote_ids), rows)


def _runs(local: Sequence[np.ndarray], remote: Sequence[np.ndarray], rows: int | SlotTable) -> int:
    if isinstance(rows, SlotTable):
        per_group = rows.group_rows
        if len(per_group) < len(local):  # (more groups of ids than the table has: none of their rows)
            per_group = np.bincount(rows.row_group, minlength=len(local))
    else:
        per_group = np.full(len(local), rows)
    total = 0
    for g, (a, b) in enumerate(zip(local, remote)):
        ones = np.ones(a.size, dtype=np.int64)  # a block is one unit long in block ids
        total += int(per_group[g]) * len(run_starts(ones, ((a, None), (b, None))))
    return total


@dataclasses.dataclass(frozen=True, eq=False)
class BlockPairs:
    """A load's block ids as the slot tables take them: per KV-cache group,
    an int64 array of local ids and one of remote ids, of equal length
    (``local[g][i]`` is read from ``remote[g][i]``). Made once per load
    (:meth:`of`); :meth:`slots` turns them into slot indices as they are."""

    local: tuple[np.ndarray, ...]
    remote: tuple[np.ndarray, ...]

    @classmethod
    def of(cls, local_block_ids: GroupBlockIds, remote_block_ids: GroupBlockIds) -> BlockPairs:
        """Raises ``ValueError`` when the two sides do not pair up."""
        local, remote = block_arrays(local_block_ids, remote_block_ids)
        return cls(tuple(local), tuple(remote))

    @property
    def num_blocks(self) -> int:
        return sum(int(ids.size) for ids in self.local)

    def slots(self, local: SlotTable, remote: SlotTable) -> tuple[np.ndarray, np.ndarray]:
        """The slot indices of both sides in ``local`` and ``remote``: what
        one ``read_prepared`` call takes."""
        return local._indices(self.local, "local"), remote._indices(self.remote, "remote")

    def runs(self, table: SlotTable) -> int:
        """:func:`count_runs` of these pairs over ``table``'s rows."""
        return _runs(self.local, self.remote, table)
