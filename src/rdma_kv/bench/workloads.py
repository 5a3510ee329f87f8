"""Benchmark workloads and the batches every backend executes.

Owns: ``Workload`` (what to move), ``Batch`` (the exact descriptors of one
repetition), the named presets (docs/benchmarks.md), and descriptor
coalescing. Every backend (cma, NIXL, rdma-kv) builds its transfers from
``batch(workload, rep)``, so all of them move the same bytes between the
same offsets in the same order.

Memory model: each side owns ONE buffer; all KV regions are views of it,
layer-outermost, the way vLLM's CPU KV cache is laid out::

    slot(layer, region, block) = (layer * regions + region) * pool_blocks + block
    offset(...)                = slot * block_nbytes

Imports numpy, the stdlib and ``rdma_kv.errors``; ``coalesce`` borrows the
transport's merge (``rdma_kv.transport.descriptors``) when called.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from rdma_kv.errors import ConfigError

KiB = 1024
MiB = 1024 * KiB

Kind = Literal["contiguous", "kv"]
BlockOrder = Literal["random", "contiguous"]
_KINDS = ("contiguous", "kv")
_ORDERS = ("random", "contiguous")


@dataclass(frozen=True)
class Workload:
    """One benchmark workload; ``kind`` selects which fields matter.

    kv: ``num_layers`` x ``regions_per_layer`` (2 = K and V) regions, each a
    pool of ``pool_blocks`` blocks of ``block_nbytes``; a request moves
    ``blocks_per_request`` blocks of every region. contiguous: one region
    of ``nbytes`` moved as one descriptor.
    """

    name: str
    kind: Kind
    num_layers: int = 0
    regions_per_layer: int = 2
    blocks_per_request: int = 0
    block_nbytes: int = 0
    pool_blocks: int = 0
    block_order: BlockOrder = "random"
    nbytes: int = 0
    repetitions: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"workload {self.name!r}: kind {self.kind!r} is not one of {_KINDS}")
        if self.repetitions < 1:
            raise ConfigError(f"workload {self.name!r}: repetitions must be >= 1, got {self.repetitions}")
        if self.kind == "contiguous":
            if self.nbytes <= 0 or self.nbytes % 8:
                raise ConfigError(
                    f"workload {self.name!r}: nbytes must be a positive multiple of 8, got {self.nbytes}"
                )
            return
        if self.block_order not in _ORDERS:
            raise ConfigError(
                f"workload {self.name!r}: block_order {self.block_order!r} is not one of {_ORDERS}"
            )
        for field in ("num_layers", "regions_per_layer", "blocks_per_request", "block_nbytes", "pool_blocks"):
            if getattr(self, field) <= 0:
                raise ConfigError(f"workload {self.name!r}: {field} must be > 0, got {getattr(self, field)}")
        if self.block_nbytes % 8:
            raise ConfigError(
                f"workload {self.name!r}: block_nbytes must be a multiple of 8, got {self.block_nbytes}"
            )
        if self.blocks_per_request > self.pool_blocks:
            raise ConfigError(
                f"workload {self.name!r}: blocks_per_request ({self.blocks_per_request}) exceeds "
                f"pool_blocks ({self.pool_blocks})"
            )

    @property
    def num_regions(self) -> int:
        return self.num_layers * self.regions_per_layer if self.kind == "kv" else 1

    @property
    def num_slots(self) -> int:
        """Descriptors in a full prepared list: one per (layer, region, pool block)."""
        return self.num_regions * self.pool_blocks if self.kind == "kv" else 1

    @property
    def descriptor_count(self) -> int:
        """Descriptors of one repetition, before coalescing."""
        return self.num_regions * self.blocks_per_request if self.kind == "kv" else 1

    @property
    def slot_nbytes(self) -> int:
        return self.block_nbytes if self.kind == "kv" else self.nbytes

    @property
    def buffer_nbytes(self) -> int:
        """Size of the one allocation each side registers."""
        return self.num_slots * self.slot_nbytes

    @property
    def transfer_nbytes(self) -> int:
        """Bytes moved by one repetition."""
        return self.descriptor_count * self.slot_nbytes

    def replace(self, **changes: Any) -> Workload:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workload:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown workload keys {unknown}; valid keys: {sorted(known)}")
        return cls(**data)


@dataclass(frozen=True, eq=False)
class Batch:
    """The descriptors of one repetition of a workload.

    ``local_slots``/``remote_slots`` (int32) index the full per-slot
    descriptor list of each side (what NIXL calls a prepared list);
    ``*_offsets`` and ``lengths`` (uint64) are the same descriptors as byte
    ranges inside each side's buffer of ``buffer_nbytes``.
    """

    workload: Workload
    rep: int
    buffer_nbytes: int
    local_slots: np.ndarray
    remote_slots: np.ndarray
    local_offsets: np.ndarray
    remote_offsets: np.ndarray
    lengths: np.ndarray

    @property
    def descriptor_count(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())


def _rep_rng(workload: Workload, rep: int) -> np.random.Generator:
    # One independent, reproducible stream per (seed, rep).
    return np.random.default_rng([workload.seed, rep])


def block_ids(workload: Workload, rep: int) -> tuple[np.ndarray, np.ndarray]:
    """(local, remote) pool block ids of one repetition's request."""
    n, pool = workload.blocks_per_request, workload.pool_blocks
    rng = _rep_rng(workload, rep)
    if workload.block_order == "random":
        local = rng.permutation(pool)[:n]
        remote = rng.permutation(pool)[:n]
    else:
        start = int(rng.integers(0, pool - n + 1))
        local = remote = np.arange(start, start + n)
    return local.astype(np.int64), remote.astype(np.int64)


def batch(workload: Workload, rep: int) -> Batch:
    """The descriptors of repetition ``rep`` (deterministic in seed and rep)."""
    if rep < 0:
        raise ConfigError(f"rep must be >= 0, got {rep}")
    if workload.kind == "contiguous":
        zero = np.zeros(1, dtype=np.uint64)
        return Batch(
            workload, rep, workload.buffer_nbytes,
            np.zeros(1, np.int32), np.zeros(1, np.int32),
            zero, zero.copy(), np.full(1, workload.nbytes, dtype=np.uint64),
        )
    local_ids, remote_ids = block_ids(workload, rep)
    # Region-major, block-minor: the order a connector walks a block table.
    region_base = (np.arange(workload.num_regions, dtype=np.int64) * workload.pool_blocks)[:, None]
    local_slots = (region_base + local_ids[None, :]).ravel()
    remote_slots = (region_base + remote_ids[None, :]).ravel()
    size = np.uint64(workload.block_nbytes)
    return Batch(
        workload, rep, workload.buffer_nbytes,
        local_slots.astype(np.int32), remote_slots.astype(np.int32),
        local_slots.astype(np.uint64) * size, remote_slots.astype(np.uint64) * size,
        np.full(local_slots.shape[0], workload.block_nbytes, dtype=np.uint64),
    )


def coalesce(
    local_offsets: np.ndarray, remote_offsets: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge runs of descriptors that are contiguous on BOTH sides, in order.

    Descriptor i+1 joins i's run when it starts where i ends locally and
    remotely. Order is kept (no sorting), so merging never reorders data.
    """
    # The transport's merge, so the baselines merge exactly as rdma-kv does
    # (imported here: the bench modules load without the transport).
    from rdma_kv.transport.descriptors import coalesce as merge_runs

    lo = np.ascontiguousarray(local_offsets, dtype=np.uint64)
    ro = np.ascontiguousarray(remote_offsets, dtype=np.uint64)
    ln = np.ascontiguousarray(lengths, dtype=np.uint64)
    if lo.shape != ro.shape or lo.shape != ln.shape or lo.ndim != 1:
        raise ConfigError(f"descriptor arrays disagree: shapes {lo.shape}, {ro.shape}, {ln.shape}")
    lo, ro, ln, _, _ = merge_runs(lo, ro, ln, None, None)
    return lo, ro, ln


def op_count(p: Batch) -> int:
    """Operations left after coalescing the batch's descriptors."""
    return int(coalesce(p.local_offsets, p.remote_offsets, p.lengths)[2].shape[0])


# Llama-3-8B-like KV: 32 layers, K and V, 32 KiB per block per region.
# Pool of 512 blocks per region -> 1 GiB per side (under the ~1.2 GiB budget);
# a request moves 256 blocks = 16,384 descriptors = 512 MiB.
_KV = dict(num_layers=32, regions_per_layer=2, block_nbytes=32 * KiB, pool_blocks=512)

PRESETS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("kv-random", "kv", blocks_per_request=256, block_order="random", **_KV),
        Workload("kv-contiguous", "kv", blocks_per_request=256, block_order="contiguous", **_KV),
        Workload("kv-one-block", "kv", blocks_per_request=1, block_order="random", **_KV),
        Workload("contiguous-256m", "contiguous", nbytes=256 * MiB),
    )
}


def preset(name: str, **changes: object) -> Workload:
    """A named preset, optionally with fields replaced (e.g. ``repetitions``)."""
    try:
        workload = PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown workload {name!r}; presets: {sorted(PRESETS)}") from None
    return workload.replace(**changes) if changes else workload
