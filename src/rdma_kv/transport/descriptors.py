"""Descriptor lists (numpy-backed), prepared lists addressed by index, and
merging of descriptors that are contiguous on both sides.

A descriptor is ``(address, nbytes)``. A ``PreparedDescList`` has been checked
against the registered regions of one side once, so a transfer built from it
by index (``block table -> descriptor index``) does no per-descriptor work in
Python: gathering, merging and posting are vectorised or in C.

May import: numpy, rdma_kv.errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rdma_kv.errors import DescriptorError


def _u64(values: Any, what: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise DescriptorError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "ui":
        raise DescriptorError(f"{what} must be integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise DescriptorError(f"{what} must be non-negative, got {int(arr.min())}")
    return np.ascontiguousarray(arr, dtype=np.uint64)


class DescList:
    """``n`` descriptors: parallel uint64 arrays of addresses and lengths."""

    __slots__ = ("addrs", "lengths")

    def __init__(self, addrs: Any, lengths: Any) -> None:
        self.addrs = _u64(addrs, "addrs")
        lens = np.asarray(lengths)
        if lens.ndim == 0:
            lens = np.full(len(self.addrs), int(lens), dtype=np.uint64)
        self.lengths = _u64(lens, "lengths")
        if len(self.addrs) != len(self.lengths):
            raise DescriptorError(
                f"addrs has {len(self.addrs)} entries but lengths has {len(self.lengths)}"
            )

    @classmethod
    def from_regions(cls, base: int, offsets: Any, nbytes: Any) -> DescList:
        return cls(np.uint64(base) + _u64(offsets, "offsets"), nbytes)

    def __len__(self) -> int:
        return len(self.addrs)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def __repr__(self) -> str:
        return f"DescList({len(self)} descriptors, {self.nbytes} bytes)"


@dataclass(frozen=True, eq=False)
class PreparedDescList:
    """A DescList checked against one side's regions; ``regions[i]`` is the
    region index of descriptor ``i``. ``peer`` is None for the local side.
    ``generation`` ties it to the peer incarnation it was checked against."""

    descs: DescList
    regions: np.ndarray
    peer: str | None
    generation: int

    def __len__(self) -> int:
        return len(self.descs)

    def take(self, index: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        idx = np.asarray(index)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "ui"):
            raise DescriptorError(f"descriptor index must be a 1-D integer array, got {idx.dtype}{idx.shape}")
        n = len(self.descs)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            bad = idx[(idx < 0) | (idx >= n)][0]
            raise DescriptorError(
                f"descriptor index {int(bad)} out of range for a prepared list of {n} "
                f"{'remote (' + self.peer + ')' if self.peer else 'local'} descriptors"
            )
        return self.descs.addrs[idx], self.descs.lengths[idx], self.regions[idx]


def coalesce(
    laddr: np.ndarray,
    raddr: np.ndarray,
    lengths: np.ndarray,
    lreg: np.ndarray,
    rreg: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Merge consecutive descriptors contiguous on both sides (same regions).

    Order is kept: descriptor i+1 joins i's operation when it starts where i
    ends, locally and remotely. Contiguous block ids of a paged KV cache thus
    become one operation per run.
    """
    n = len(laddr)
    if n < 2:
        return laddr, raddr, lengths, lreg, rreg
    brk = np.empty(n, dtype=bool)
    brk[0] = True
    prev_end = laddr[:-1] + lengths[:-1]
    np.not_equal(laddr[1:], prev_end, out=brk[1:])
    brk[1:] |= raddr[1:] != raddr[:-1] + lengths[:-1]
    brk[1:] |= lreg[1:] != lreg[:-1]
    brk[1:] |= rreg[1:] != rreg[:-1]
    starts = np.flatnonzero(brk)
    if len(starts) == n:
        return laddr, raddr, lengths, lreg, rreg
    return (
        laddr[starts],
        raddr[starts],
        np.add.reduceat(lengths, starts),
        lreg[starts],
        rreg[starts],
    )
