"""Memory: what a registrable object spans, registered regions, and the
vectorised check that descriptors lie inside them.

A ``MemoryRegion`` is one ``ucp_mem_map`` of one allocation. Views of an
allocation (the layers of a vLLM KV cache are views of one buffer) resolve
to the allocation, so they share one region. Regions never overlap.

May import: numpy, rdma_kv.errors, rdma_kv.transport._lib; torch only if the
caller passes a tensor (never imported here).
"""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rdma_kv.errors import DescriptorError, RegistrationError


class MemoryKind(str, enum.Enum):
    """Memory type as UCX reports it (``ucs_memory_type_t``)."""

    HOST = "host"
    CUDA = "cuda"
    CUDA_MANAGED = "cuda-managed"
    ROCM = "rocm"
    UNKNOWN = "unknown"


# ucs_memory_type_t values (stable since UCX 1.9): HOST=0, CUDA=1,
# CUDA_MANAGED=2, ROCM=3. Anything else is reported as UNKNOWN.
_UCS_KINDS = {0: MemoryKind.HOST, 1: MemoryKind.CUDA, 2: MemoryKind.CUDA_MANAGED, 3: MemoryKind.ROCM}


def kind_from_ucs(value: int) -> MemoryKind:
    return _UCS_KINDS.get(int(value), MemoryKind.UNKNOWN)


def kinds_in_mask(mask: int) -> list[MemoryKind]:
    """The kinds a ``ucs_memory_type_t`` bitmask holds (``ucp_context_attr_t.memory_types``)."""
    return [kind for value, kind in sorted(_UCS_KINDS.items()) if mask >> value & 1]


# What a caller may declare (``register(..., memory_type=...)``).
DECLARABLE = (MemoryKind.HOST, MemoryKind.CUDA)


def declared_kind(memory_type: str | MemoryKind) -> MemoryKind:
    """The ``MemoryKind`` a caller names ("host", "cuda"), or RegistrationError."""
    try:
        kind = MemoryKind(memory_type)
    except ValueError:
        kind = None
    if kind not in DECLARABLE:
        raise RegistrationError(
            f"memory_type {memory_type!r} is not valid; valid values: {', '.join(k.value for k in DECLARABLE)}"
        )
    return kind


def declared_span(obj: Any, memory_type: str | None) -> Span:
    """``span_of(obj)`` with the kind the caller declares: a tensor's or
    array's own, or ``memory_type`` ("host", "cuda"), which must agree."""
    span = span_of(obj)
    if memory_type is None:
        return span
    kind = declared_kind(memory_type)
    if span.kind is not None and span.kind is not kind:
        raise RegistrationError(f"memory_type={memory_type!r} contradicts the {span.kind.value} "
                                f"{type(obj).__name__} passed; omit memory_type for tensors and arrays")
    return Span(span.base, span.nbytes, kind)


def mismatch_error(base: int, nbytes: int, declared: MemoryKind, mapped: MemoryKind,
                   supported: list[MemoryKind], tls: str) -> RegistrationError:
    """The refusal of memory UCX mapped as ``mapped`` though declared ``declared``."""
    names = [k.value for k in supported]
    hint = ("this UCX context cannot detect device memory: enable a CUDA transport (cuda_copy in UCX_TLS) "
            "and use a UCX built with CUDA" if declared is not MemoryKind.HOST and declared not in supported
            else f"check that the address really is {declared.value} memory")
    return RegistrationError(
        f"[{base:#x}, +{nbytes}) is declared {declared.value} memory but UCX maps it as {mapped.value} "
        f"memory (this context supports: {', '.join(names)}; TLS={tls}); refusing to register it: {hint}")


def same_memory(declared: MemoryKind, mapped: MemoryKind) -> bool:
    """Whether UCX mapping memory declared ``declared`` as ``mapped`` is
    right. Managed memory is device memory UCX also reaches: accepted for a
    CUDA declaration (its pages may live on either side, and UCX's CUDA
    transports handle both)."""
    return mapped is declared or (declared is MemoryKind.CUDA and mapped is MemoryKind.CUDA_MANAGED)


@dataclass(frozen=True)
class Span:
    """The allocation an object lives in: base address, size, device kind."""

    base: int
    nbytes: int
    kind: MemoryKind | None  # None: let UCX detect


def span_of(obj: Any) -> Span:
    """Resolve a torch tensor, numpy array or ``(address, nbytes)`` pair to the
    allocation to register (the whole storage, not just the view)."""
    if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(v, numbers.Integral) for v in obj):
        base, nbytes = int(obj[0]), int(obj[1])  # numpy integers too
        return _checked(Span(base, nbytes, None), "(address, nbytes)")
    if isinstance(obj, np.ndarray):
        root = obj
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root.base is None and root.flags.owndata:
            return _checked(Span(root.__array_interface__["data"][0], root.nbytes, MemoryKind.HOST), "numpy array")
        # Wraps foreign memory (mmap, buffer): register what the array spans.
        lo, hi = _byte_bounds(obj)
        return _checked(Span(lo, hi - lo, MemoryKind.HOST), "numpy array")
    storage = getattr(obj, "untyped_storage", None)
    if callable(storage):  # torch.Tensor, without importing torch
        st = storage()
        device = getattr(obj, "device", None)
        dtype = getattr(device, "type", "cpu")
        kind = {"cpu": MemoryKind.HOST, "cuda": MemoryKind.CUDA}.get(dtype)
        if kind is None:
            raise RegistrationError(
                f"tensors on device {device} cannot be registered; use CPU or CUDA tensors"
            )
        return _checked(Span(int(st.data_ptr()), int(st.nbytes()), kind), f"{dtype} tensor")
    raise RegistrationError(
        f"cannot register {type(obj).__name__}: pass a torch tensor, a numpy "
        "array or an (address, nbytes) tuple of ints"
    )


def _byte_bounds(arr: np.ndarray) -> tuple[int, int]:
    lo = hi = arr.__array_interface__["data"][0]
    for dim, stride in zip(arr.shape, arr.strides):
        if dim == 0:
            return lo, lo
        if stride < 0:
            lo += (dim - 1) * stride
        else:
            hi += (dim - 1) * stride
    return lo, hi + arr.itemsize


def _checked(span: Span, what: str) -> Span:
    # The end must fit in uint64 too: RegionTable keeps region ends as uint64.
    if span.base <= 0 or span.nbytes <= 0 or span.base + span.nbytes >= 2**64:
        raise RegistrationError(
            f"{what} spans [{span.base:#x}, +{span.nbytes}): address and size must be "
            "positive and inside the 64-bit address space"
        )
    return span


@dataclass(eq=False)
class MemoryRegion:
    """One registered allocation. ``refs`` counts register() calls on it.

    ``owners`` holds the tensors / arrays registered onto it until it is
    unmapped: memory freed while still mapped (a temporary passed to
    register()) would be read and written by peers, and UCX itself crashes
    on it (seen here: a segfault in ucp_worker_progress / ucp_worker_destroy).
    An ``(address, nbytes)`` registration has no owner; its caller keeps
    the memory alive.
    """

    base: int
    nbytes: int
    kind: MemoryKind
    memh: Any = field(repr=False)
    packed_rkey: bytes = field(repr=False)
    refs: int = 1
    owners: list[Any] = field(default_factory=list, repr=False)

    @property
    def end(self) -> int:
        return self.base + self.nbytes

    def contains(self, base: int, nbytes: int) -> bool:
        return self.base <= base and base + nbytes <= self.end


class RegionTable:
    """Sorted, non-overlapping regions with vectorised descriptor lookup."""

    def __init__(self, spans: list[tuple[int, int]], owner: str) -> None:
        order = sorted(range(len(spans)), key=lambda i: spans[i][0])
        self.owner = owner
        self.order = np.asarray(order, dtype=np.uint32)  # sorted position -> region index
        self.bases = np.asarray([spans[i][0] for i in order], dtype=np.uint64)
        self.ends = np.asarray([spans[i][0] + spans[i][1] for i in order], dtype=np.uint64)
        if len(order) > 1 and np.any(self.bases[1:] < self.ends[:-1]):
            raise RegistrationError(f"{owner}: registered regions overlap")

    def __len__(self) -> int:
        return len(self.bases)

    def locate(self, addrs: np.ndarray, lengths: np.ndarray, what: str) -> np.ndarray:
        """Region index (uint32) of every descriptor; DescriptorError naming the
        first descriptor that is empty or not wholly inside one region."""
        n = len(addrs)
        if n == 0:
            return np.empty(0, dtype=np.uint32)
        if len(self.bases) == 0:
            raise DescriptorError(f"{what}: {self.owner} has no registered memory")
        pos = np.searchsorted(self.bases, addrs, side="right").astype(np.int64) - 1
        inside = pos >= 0
        p = np.maximum(pos, 0)
        end = self.ends[p]
        inside &= addrs < end
        room = np.where(inside, end - np.where(inside, addrs, 0), 0)
        ok = inside & (lengths > 0) & (lengths <= room)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise DescriptorError(
                f"{what}: descriptor {i} [{int(addrs[i]):#x}, +{int(lengths[i])} bytes) is "
                f"{'empty' if lengths[i] == 0 else 'not inside any registered region'} of "
                f"{self.owner} ({self.describe()}); {n} descriptors were checked and "
                "nothing was posted"
            )
        return self.order[p]

    def describe(self, limit: int = 4) -> str:
        parts = [f"[{int(b):#x}, {int(e):#x})" for b, e in zip(self.bases[:limit], self.ends[:limit])]
        more = f" and {len(self.bases) - limit} more" if len(self.bases) > limit else ""
        return "regions " + ", ".join(parts) + more
