"""Descriptor lists (numpy-backed), prepared lists addressed by index, and
merging of descriptors that are contiguous on both sides.

A descriptor is ``(address, nbytes)``. A ``PreparedList`` has been checked
against the registered regions of one side once, so a transfer built from it
by index (``block table -> descriptor index``) does no per-descriptor work in
Python: gathering, merging and posting are vectorised or in C.

May import: numpy, rdma_kv.errors, rdma_kv.runs (the run-merging rule).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from rdma_kv.errors import DescriptorError
from rdma_kv.runs import run_starts


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
        """Descriptors at ``base + offsets[i]``, of ``nbytes`` (one length or one each)."""
        return cls(np.uint64(base) + _u64(offsets, "offsets"), nbytes)

    @classmethod
    def slots(cls, base: int, count: int, nbytes: int) -> DescList:
        """A slot table: ``count`` descriptors of ``nbytes`` each, back to back from ``base``."""
        if count < 0 or nbytes <= 0:
            raise DescriptorError(f"a slot table needs count >= 0 and nbytes > 0, got {count} x {nbytes}")
        return cls(np.uint64(base) + np.arange(count, dtype=np.uint64) * np.uint64(nbytes), nbytes)

    def __len__(self) -> int:
        return len(self.addrs)

    @property
    def nbytes(self) -> int:
        return int(self.lengths.sum())

    def __repr__(self) -> str:
        return f"DescList({len(self)} descriptors, {self.nbytes} bytes)"


# Generations of prepared lists (a registry's, a peer incarnation's) come
# from one process-wide counter, so a list prepared by another Agent never
# matches: its region indices would address that agent's memory handles and
# remote keys, not ours (the C post loop indexes memhs[] / rkeys[] with them
# unchecked).
_generations = itertools.count(1)


def new_generation() -> int:
    """A generation no prepared list of this process has seen."""
    return next(_generations)


_INT64 = np.dtype(np.int64)
INT32 = np.dtype(np.int32)


def _integer_index(index: Any) -> np.ndarray:
    """``index`` as a 1-D integer array (its own dtype); DescriptorError otherwise."""
    idx = np.asarray(index)
    if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "ui"):
        raise DescriptorError(f"descriptor index must be a 1-D integer array, got {idx.dtype}{idx.shape}")
    return idx


@dataclass(frozen=True, eq=False)
class PreparedList:
    """A DescList checked against one side's regions; ``regions[i]`` is the
    region index of descriptor ``i``. ``peer`` is None for the local side.
    ``generation`` ties it to the peer incarnation it was checked against.

    ``uniform_length`` (every descriptor the same size, as for the blocks of
    a paged KV cache) and ``single_region`` are computed once here, so that a
    transfer by index skips gathering and comparing lengths and regions."""

    descs: DescList
    regions: np.ndarray
    peer: str | None
    generation: int
    uniform_length: int | None = field(init=False)
    single_region: bool = field(init=False)
    c_tables: Any = field(default=None, init=False, repr=False)
    """The agent's C views of (addrs, lengths, regions or NULL) and the count, made once at
    prep time so that a transfer does not rebuild them."""
    route: Any = field(default=None, init=False, repr=False)
    """A remote list's route (prepared.py) for the local list it was last
    used with: the request path's C record, rebuilt when stale."""

    def __post_init__(self) -> None:
        lengths, regions = self.descs.lengths, self.regions
        uniform = len(lengths) > 0 and int(lengths.min()) == int(lengths.max())
        object.__setattr__(self, "uniform_length", int(lengths[0]) if uniform else None)
        object.__setattr__(self, "single_region", len(regions) == 0 or int(regions.min()) == int(regions.max()))

    def __len__(self) -> int:
        return len(self.descs)

    def attach_c_tables(self, ffi: Any) -> PreparedList:
        """Attach ``c_tables`` (C views made once, at prep time, so that a
        transfer does not rebuild them) and return this list."""
        # NULL means region 0 for every descriptor: only then may the table be skipped.
        region_zero = self.single_region and (len(self.regions) == 0 or int(self.regions[0]) == 0)
        regions = ffi.NULL if region_zero else ffi.from_buffer("uint32_t[]", self.regions)
        tables = (ffi.from_buffer("uint64_t[]", self.descs.addrs),
                  ffi.from_buffer("uint64_t[]", self.descs.lengths), regions, len(self))
        object.__setattr__(self, "c_tables", tables)
        return self

    def index(self, index: Any) -> np.ndarray:
        """``index`` as a checked 1-D integer array (DescriptorError if out of range)."""
        idx = _integer_index(index)
        n = len(self.descs)
        if idx.size:
            # One pass: viewed as unsigned, a negative index is huge, so max() finds both.
            unsigned = idx.view(idx.dtype.str.replace("i", "u")) if idx.dtype.kind == "i" else idx
            if int(unsigned.max()) >= n:
                bad = idx[(idx < 0) | (idx >= n)][0]
                raise DescriptorError(
                    f"descriptor index {int(bad)} out of range for a prepared list of {n} "
                    f"{'remote (' + self.peer + ')' if self.peer else 'local'} descriptors"
                )
        return idx

    def take(self, index: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        idx = self.index(index)
        return self.descs.addrs[idx], self.descs.lengths[idx], self.regions[idx]


class ChainedRead(NamedTuple):
    """A read to post once another has landed: ``read_prepared(...,
    then=ChainedRead(local, local_index, remote, remote_index))`` reads
    ``remote[remote_index]`` into ``local[local_index]`` (both prepared
    lists, ``remote`` of the same peer) as soon as every operation of that
    transfer completed without error, posted by the shim on the thread
    that completed the last one, and the transfer completes when this read
    does. The pattern of a read vouched for after it landed (a version or
    ownership word read behind the data): the second read starts a wire
    round trip after the first ends, with no Python between them.
    ``Transfer.chained`` says whether it was posted. (A named tuple: made
    per request, often with the caches cold.)"""

    local: PreparedList
    local_index: Any
    remote: PreparedList
    remote_index: Any


# The name before the transport's re-cut (issue 28); one object, two names
# only so that code written against the old name keeps importing.
PreparedDescList = PreparedList


def as_index(index: Any) -> np.ndarray:
    """``index`` as a contiguous 1-D int32 or int64 array (the C side reads
    both), without a copy (or any numpy call) when it already is one; other
    integer input becomes int64. Ranges are not checked here: the agent
    checks every pair in C before posting (``rk_check_indexed``)."""
    if (type(index) is np.ndarray and (index.dtype is _INT64 or index.dtype is INT32)
            and index.ndim == 1 and index.flags.c_contiguous):
        return index
    idx = _integer_index(index)
    if idx.dtype.kind == "u" and idx.size and int(idx.max()) > np.iinfo(np.int64).max:
        idx = np.where(idx > np.iinfo(np.int64).max, -1, idx)  # out of range either way, reported as such
    return np.ascontiguousarray(idx, dtype=np.int64)


def pair_indices(
    local: PreparedList, local_index: Any, remote: PreparedList, remote_index: Any
) -> tuple[np.ndarray, np.ndarray, int]:
    """Checked int64 index arrays of a transfer between prepared lists, and its
    byte count. Paired lengths must match: with uniform lists that is one
    comparison, otherwise one vectorised check."""
    li, ri = local.index(local_index), remote.index(remote_index)
    if len(li) != len(ri):
        raise DescriptorError(f"selected descriptors must pair up: {len(li)} local vs {len(ri)} remote")
    size = local.uniform_length
    if size is not None and size == remote.uniform_length:
        nbytes = size * len(li)
    else:
        lengths = local.descs.lengths[li]
        if not np.array_equal(lengths, remote.descs.lengths[ri]):
            raise DescriptorError(f"selected descriptors must pair up: {len(li)} pairs, but their lengths differ")
        nbytes = int(lengths.sum())
    return (np.ascontiguousarray(li, dtype=np.int64), np.ascontiguousarray(ri, dtype=np.int64), nbytes)


def coalesce(
    laddr: np.ndarray,
    raddr: np.ndarray,
    lengths: np.ndarray,
    lreg: np.ndarray | None,
    rreg: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Merge consecutive descriptors contiguous on both sides (same regions).

    Order is kept: descriptor i+1 joins i's operation when it starts where i
    ends, locally and remotely. Contiguous block ids of a paged KV cache thus
    become one operation per run. A region array of None means "all in
    region 0" and is not compared.
    """
    n = len(laddr)
    if n < 2:
        return laddr, raddr, lengths, lreg, rreg
    starts = run_starts(lengths, ((laddr, lreg), (raddr, rreg)))
    if len(starts) == n:
        return laddr, raddr, lengths, lreg, rreg
    return (
        laddr[starts],
        raddr[starts],
        np.add.reduceat(lengths, starts),
        None if lreg is None else lreg[starts],
        None if rreg is None else rreg[starts],
    )
