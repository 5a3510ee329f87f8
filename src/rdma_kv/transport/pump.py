"""A pump: the shim's C thread that progresses one UCX worker.

A pump progresses its worker without the interpreter lock (csrc/pump.c):
the agent's own worker with ``progress="thread"``, and every lane's. It
watches the agent's completion context (``rk_ctx_t``) and, when progress
changed it (a batch published, a notification received, an endpoint
error), wakes whoever settles it: the agent's service thread through an
eventfd, or a polling caller through the agent's own worker. The worker it
progresses must be ``UCS_THREAD_MODE_MULTI``: Python posts on it meanwhile.

May import: rdma_kv.errors, rdma_kv.transport._lib, .cuda, .ucx.
"""

from __future__ import annotations

import os
from typing import Any

from rdma_kv.errors import TransferError
from rdma_kv.transport._lib import load
from rdma_kv.transport.cuda import CudaContext
from rdma_kv.transport.ucx import Worker


class Pump:
    """A running pump; ``stop()`` joins its thread (idempotent)."""

    def __init__(self, worker: Worker, watch: Any, *, wake_worker: Worker | None, wake_fd: int,
                 spin_s: float, cuda: CudaContext | None, name: str, steer: bool) -> None:
        """Progress ``worker``; wake ``wake_worker`` (a polling owner) or
        write ``wake_fd`` (>= 0: the owner's service thread) when ``watch``,
        an ``rk_ctx_t *``, changes. With ``cuda``, the thread makes that
        context current before it progresses (cuda.py). With ``steer``, a
        post that kicks the pump first binds it to the CPUs the creating
        thread may use, minus the poster's (csrc/pump.c says why)."""
        ffi, lib = load()
        self._lib = lib
        set_ctx = ffi.cast("rk_cu_set_ctx_t", cuda.set_current) if cuda else ffi.NULL
        cu_status = ffi.new("int *")
        cpus = steer_mask() if steer else None
        self._cpus = ffi.new("uint64_t[]", cpus) if cpus else ffi.NULL
        handle = lib.rk_pump_start(worker.handle, worker.efd, watch,
                                   wake_worker.handle if wake_worker is not None else ffi.NULL, wake_fd,
                                   int(spin_s * 1e9), self._cpus, len(cpus or ()), set_ctx,
                                   ffi.cast("void *", cuda.handle) if cuda else ffi.NULL, cu_status)
        if handle == ffi.NULL:
            if cuda is not None and cu_status[0]:
                raise TransferError(f"the progress thread of {name!r} cannot make the creator's CUDA context "
                                    f"{cuda.handle:#x} current: cuCtxSetCurrent returned CUresult {cu_status[0]}")
            raise TransferError(f"cannot start the progress thread of {name!r} (pthread_create failed)")
        self.handle: Any = handle  # rk_pump_t *; None once stopped

    @property
    def tid(self) -> int:
        """The pump thread's kernel thread id."""
        return int(self._lib.rk_pump_tid(self.handle))

    def stop(self) -> None:
        """Stop and join the thread (bounded by one progress call and its wake-up)."""
        if self.handle is not None:
            self._lib.rk_pump_stop(self.handle)
            self.handle = None


def steer_mask() -> list[int] | None:
    """The CPUs the calling thread may run on as 64-bit words, or None when
    steering cannot help (one CPU, or no affinity API)."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None
    if len(cpus) < 2:
        return None
    words = [0] * (max(cpus) // 64 + 1)
    for cpu in cpus:
        words[cpu // 64] |= 1 << (cpu % 64)
    return words
