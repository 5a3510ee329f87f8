"""The memory registry of one agent: its registered regions, their memory
handles and packed remote keys, and the table local descriptors are checked
against.

One ``ucp_mem_map`` per allocation (memory.py says what an object spans);
registering a view of a registered allocation takes a reference on its
region. Every change of the mapped set moves the registry's
``generation`` (local prepared lists made before no longer match) and
calls ``stale()`` (the agent's routes hold memory handles and tables).

Not thread-safe on its own: the agent calls it under its lock.

May import: numpy, rdma_kv.errors, rdma_kv.transport._lib, .descriptors,
.memory, .metadata, .ucx.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rdma_kv.errors import RegistrationError
from rdma_kv.transport._lib import check_status, load
from rdma_kv.transport.descriptors import new_generation
from rdma_kv.transport.memory import (
    MemoryKind,
    MemoryRegion,
    RegionTable,
    declared_span,
    kind_from_ucs,
    kinds_in_mask,
    mismatch_error,
    same_memory,
)
from rdma_kv.transport.metadata import RegionInfo
from rdma_kv.transport.ucx import Context


class MemoryRegistry:
    """Regions mapped into one UCP context for one agent (``owner`` names it
    in errors). ``stale`` is called whenever the mapped set changes."""

    def __init__(self, context: Context, owner: str, tls: Callable[[], str | None],
                 stale: Callable[[], None]) -> None:
        self._ffi, self._lib = load()
        self._context = context
        self._owner = owner
        # The context's UCX_TLS (None: UCX's default), for the error of a memory-type
        # mismatch: asked only then (reading UCX's configuration files is not free).
        self._tls = tls
        self._stale = stale
        self._regions: list[MemoryRegion] = []
        self.table = RegionTable([], owner)
        self.generation = new_generation()
        self.memhs: Any = self._ffi.new("ucp_mem_h[]", 1)  # kept alive by routes that point at it
        self.memhs_c: Any = self._ffi.NULL  # memhs once a region is registered (what rk_post_indexed gets)

    @property
    def regions(self) -> tuple[MemoryRegion, ...]:
        return tuple(self._regions)

    def register(self, obj: Any, memory_type: str | None) -> MemoryRegion:
        """The region of ``obj`` (agent.register has the contract)."""
        span = declared_span(obj, memory_type)
        kind = span.kind
        owner = None if isinstance(obj, tuple) else obj
        for region in self._regions:
            if region.contains(span.base, span.nbytes):
                if kind is not None and not same_memory(kind, region.kind):
                    raise RegistrationError(
                        f"[{span.base:#x}, +{span.nbytes}) is declared {kind.value} memory but lies in "
                        f"{region}, which UCX mapped as {region.kind.value}")
                region.refs += 1
                if owner is not None:
                    region.owners.append(owner)
                return region
            if span.base < region.end and region.base < span.base + span.nbytes:
                raise RegistrationError(
                    f"[{span.base:#x}, +{span.nbytes}) overlaps registered region "
                    f"[{region.base:#x}, +{region.nbytes}) without lying inside it; "
                    "register the enclosing allocation once instead"
                )
        region = self._map(span.base, span.nbytes, kind)
        if owner is not None:
            region.owners.append(owner)
        self._regions.append(region)
        self._rebuild()
        return region

    def _map(self, base: int, nbytes: int, kind: MemoryKind | None) -> MemoryRegion:
        """``ucp_mem_map`` without a memory-type hint: UCX detects the type
        through the memory domains of its enabled transports (a hint would be
        trusted and echoed by ucp_mem_query, hiding a UCX that cannot reach
        device memory). The detected type must be the declared ``kind``."""
        ffi, lib = self._ffi, self._lib
        params = ffi.new("ucp_mem_map_params_t *")
        params.field_mask = lib.UCP_MEM_MAP_PARAM_FIELD_ADDRESS | lib.UCP_MEM_MAP_PARAM_FIELD_LENGTH
        params.address = ffi.cast("void *", base)
        params.length = nbytes
        memh_p = ffi.new("ucp_mem_h *")
        check_status(lib.ucp_mem_map(self._context.handle, params, memh_p), f"ucp_mem_map of [{base:#x}, +{nbytes})")
        memh = memh_p[0]
        try:
            attr = ffi.new("ucp_mem_attr_t *")
            attr.field_mask = lib.UCP_MEM_ATTR_FIELD_MEM_TYPE
            check_status(lib.ucp_mem_query(memh, attr), "ucp_mem_query")
            ucx_kind = kind_from_ucs(attr.mem_type)
            if kind is not None and not same_memory(kind, ucx_kind):
                tls = self._tls() or "all (default)"
                raise mismatch_error(base, nbytes, kind, ucx_kind, kinds_in_mask(self._context.memory_types()), tls)
            buf = ffi.new("void **")
            size = ffi.new("size_t *")
            check_status(lib.ucp_rkey_pack(self._context.handle, memh, buf, size), "ucp_rkey_pack")
            packed = bytes(ffi.buffer(buf[0], size[0]))
            lib.ucp_rkey_buffer_release(buf[0])
        except BaseException:
            lib.ucp_mem_unmap(self._context.handle, memh)
            raise
        return MemoryRegion(base, nbytes, ucx_kind, memh, packed)

    def deregister(self, region: MemoryRegion, inflight: int, abandoned: int) -> None:
        """Drop one reference; unmap when the last one goes, which ``inflight``
        transfers forbid, and so do ``abandoned`` ones: failed by the agent
        (their peer failed, its endpoint left open while a flush of it was
        outstanding), not yet handed back by UCX, so their data may still be
        written into local memory (over TCP, into the unmapped and freed
        buffer: 65,536 bytes landed in a new array at the old address)."""
        if region not in self._regions:
            raise RegistrationError(f"{region} is not registered with {self._owner}")
        if region.refs > 1:
            region.refs -= 1
            return
        if inflight:
            raise RegistrationError(
                f"cannot deregister {region}: {inflight} transfers in flight; wait for them first"
            )
        if abandoned:
            raise RegistrationError(
                f"cannot deregister {region}: {abandoned} transfers failed by {self._owner} are still held by "
                "UCX (a peer that stopped answering, its endpoint left open until the agent closes) and may "
                "still write into local memory; close the agent to end them"
            )
        # Unmapped first: a failure leaves the region registered everywhere
        # (listed, published, in the table, unmapped by a retry or close),
        # where removing it first left it listed nowhere yet still accepted.
        check_status(self._lib.ucp_mem_unmap(self._context.handle, region.memh), "ucp_mem_unmap")
        self._regions.remove(region)
        region.owners.clear()  # unmapped: the memory may go now
        self.generation = new_generation()
        self._rebuild()

    def _rebuild(self) -> None:
        self._stale()  # routes hold the memory handles and the table
        self.table = RegionTable([(r.base, r.nbytes) for r in self._regions], self._owner)
        self.memhs = self._ffi.new("ucp_mem_h[]", [r.memh for r in self._regions] or 1)
        self.memhs_c = self.memhs if self._regions else self._ffi.NULL

    def infos(self) -> list[RegionInfo]:
        """The regions as the agent's metadata publishes them."""
        return [RegionInfo(r.base, r.nbytes, r.kind, r.packed_rkey) for r in self._regions]

    def close(self) -> None:
        """Unmap every region (nothing may be in flight any more)."""
        for region in self._regions:
            self._lib.ucp_mem_unmap(self._context.handle, region.memh)
            region.owners.clear()
        self._regions.clear()
