"""The CUDA context the progress threads make current.

UCX's CUDA transports (``cuda_copy``, ``cuda_ipc``) call the driver during
``ucp_worker_progress`` (``cuEventQuery`` on their copy events), so a thread
that progresses a worker moving device memory needs a current CUDA context;
without one the driver call fails or crashes (NIXL's progress thread hit
this: ai-dynamo/nixl#2102). The agent records the context current on the
thread that creates it, and every C pump makes it current before its first
progress (``csrc/pump.c``), through ``cuCtxSetCurrent``'s address: the shim
has no link-time CUDA dependency. So does the service thread, which
helps pumps that get no CPU (``make_current``).

"CUDA in use" means libcuda is already loaded in this process (torch loads
it when it initialises CUDA): it is looked up with ``RTLD_NOLOAD``, never
loaded here, and never at import.

May import: the standard library only.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

LIBCUDA = "libcuda.so.1"  # the driver's soname (what torch and UCX load)
CUDA_SUCCESS = 0


@dataclass(frozen=True)
class CudaContext:
    """A ``CUcontext`` and the address of ``cuCtxSetCurrent`` to make it current."""

    handle: int
    set_current: int


def creator_context() -> CudaContext | None:
    """The calling thread's current CUDA context, or None when CUDA is not
    in use in this process or this thread has no current context."""
    try:
        libcuda = ctypes.CDLL(LIBCUDA, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None  # not loaded: no context can exist in this process
    try:
        get_current, set_current = libcuda.cuCtxGetCurrent, libcuda.cuCtxSetCurrent
    except AttributeError:
        log.warning("%s is loaded but has no cuCtxGetCurrent/cuCtxSetCurrent; progress threads get no "
                    "CUDA context", LIBCUDA)
        return None
    get_current.argtypes, get_current.restype = [ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int
    ctx = ctypes.c_void_p()
    status = get_current(ctypes.byref(ctx))
    if status != CUDA_SUCCESS or not ctx.value:
        # CUDA_ERROR_NOT_INITIALIZED or no context on this thread: nothing
        # of this thread's is device memory UCX would touch.
        return None
    return CudaContext(int(ctx.value), int(ctypes.cast(set_current, ctypes.c_void_p).value or 0))


def make_current(ctx: CudaContext) -> int:
    """Make ``ctx`` current on the calling thread (a Python thread that
    progresses a worker: the service thread); returns the ``CUresult``."""
    set_current = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(ctx.set_current)
    return int(set_current(ctx.handle))
