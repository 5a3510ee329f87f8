"""Stand-ins for CUDA in tests that need no GPU.

- Fake CUDA tensors: objects with the storage, stride and device interfaces
  of ``torch.Tensor`` (what rdma-kv reads from a tensor, duck-typed), laid
  over a host tensor's memory. The device says ``cuda:N``; the bytes are
  host memory, so UCX detects them as host memory.
- ``QueryAnswers``: an agent's cffi library whose ``ucp_mem_query`` answers
  the memory type a test chooses (``agent._core.memory._lib = QueryAnswers(...)``).

Importable from every test directory (tests/ is on sys.path through its
conftest.py).
"""

from __future__ import annotations

from typing import Any


class FakeDevice:
    def __init__(self, index: int) -> None:
        self.type, self.index = "cuda", index

    def __str__(self) -> str:
        return f"cuda:{self.index}"

    __repr__ = __str__


class FakeStorage:
    def __init__(self, storage: Any) -> None:
        self._storage = storage

    def data_ptr(self) -> int:
        return self._storage.data_ptr()

    def nbytes(self) -> int:
        return self._storage.nbytes()


class FakeCudaTensor:
    """A view of ``host`` (a CPU ``torch.Tensor``) that claims to live on ``cuda:index``."""

    def __init__(self, host: Any, index: int = 0) -> None:
        self._host = host
        self.device = FakeDevice(index)
        self.dtype = host.dtype
        self.shape = host.shape

    def untyped_storage(self) -> FakeStorage:
        return FakeStorage(self._host.untyped_storage())

    def data_ptr(self) -> int:
        return self._host.data_ptr()

    def element_size(self) -> int:
        return self._host.element_size()

    def stride(self) -> tuple[int, ...]:
        return self._host.stride()

    def __getitem__(self, index: Any) -> FakeCudaTensor:
        return FakeCudaTensor(self._host[index], self.device.index)


def load_ffi():
    from rdma_kv.transport._lib import load

    return load()[0]


class QueryAnswers:
    """The agent's cffi library, except that ``ucp_mem_query`` reports
    ``mem_type`` (a ``ucs_memory_type_t`` name): for every mapping, or, with
    ``within=(base, nbytes)``, for the mappings that start in that range
    (the KV cache; the connector's own host arrays, its held words and
    their scratch, keep UCX's answer). Counts unmaps."""

    def __init__(self, lib, mem_type: str, within: tuple[int, int] | None = None) -> None:
        self._lib, self._mem_type, self.unmapped = lib, mem_type, 0
        self._within = within
        self._inside: set[int] = set()

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def ucp_mem_map(self, context, params, memh_p):
        status = self._lib.ucp_mem_map(context, params, memh_p)
        if self._within is not None:
            ffi = load_ffi()
            base, nbytes = self._within
            if base <= int(ffi.cast("uintptr_t", params.address)) < base + nbytes:
                self._inside.add(int(ffi.cast("uintptr_t", memh_p[0])))
        return status

    def ucp_mem_query(self, memh, attr):
        status = self._lib.ucp_mem_query(memh, attr)
        if self._within is None or int(load_ffi().cast("uintptr_t", memh)) in self._inside:
            attr.mem_type = getattr(self._lib, f"UCS_MEMORY_TYPE_{self._mem_type}")
        return status

    def ucp_mem_unmap(self, context, memh):
        self.unmapped += 1
        return self._lib.ucp_mem_unmap(context, memh)
