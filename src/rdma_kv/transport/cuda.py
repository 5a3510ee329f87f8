"""The CUDA context the progress threads make current.

UCX's CUDA transports (``cuda_copy``, ``cuda_ipc``) call the driver during
``ucp_worker_progress`` (``cuEventQuery`` on their copy events), so a thread
that progresses a worker moving device memory needs a current CUDA context;
without one the driver call fails or crashes (NIXL's progress thread hit
this: ai-dynamo/nixl#2102). The agent records the context current on the
thread that creates it, and every C pump makes it current before its first
progress (``csrc/pump.c``), through ``cuCtxSetCurrent``'s address: the shim
has no link-time CUDA dependency. So does the service thread, which
helps pumps that get no CPU (``make_current``). A caller's thread that
progresses a worker (``progress()``, ``wait()`` helping a pump, a close)
gets the context pushed for the call and popped after it unless it is
already current there (``bound``), so the caller's own context, or its
having none, is what it was before.

"CUDA in use" means libcuda is already loaded in this process (torch loads
it when it initialises CUDA): it is looked up with ``RTLD_NOLOAD``, never
loaded here, and never at import.

May import: the standard library only.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

log = logging.getLogger(__name__)

LIBCUDA = "libcuda.so.1"  # the driver's soname (what torch and UCX load)
CUDA_SUCCESS = 0

_GET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))  # cuCtxGetCurrent, cuCtxPopCurrent_v2
_PUSH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)  # cuCtxSetCurrent, cuCtxPushCurrent_v2


@dataclass(frozen=True)
class CudaContext:
    """A ``CUcontext`` and the addresses of the driver calls that make it
    current: ``cuCtxSetCurrent`` (a thread of rdma-kv's own), and
    ``cuCtxGetCurrent`` / ``cuCtxPushCurrent_v2`` / ``cuCtxPopCurrent_v2``
    (a caller's thread, for one call: ``bound``; 0 where the driver lacks them)."""

    handle: int
    set_current: int
    get_current: int = 0
    push_current: int = 0
    pop_current: int = 0


def _address(libcuda: ctypes.CDLL, name: str) -> int:
    try:
        return int(ctypes.cast(getattr(libcuda, name), ctypes.c_void_p).value or 0)
    except AttributeError:
        return 0


def creator_context() -> CudaContext | None:
    """The calling thread's current CUDA context, or None when CUDA is not
    in use in this process or this thread has no current context."""
    try:
        libcuda = ctypes.CDLL(LIBCUDA, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None  # not loaded: no context can exist in this process
    set_current, get_current = _address(libcuda, "cuCtxSetCurrent"), _address(libcuda, "cuCtxGetCurrent")
    if not set_current or not get_current:
        log.warning("%s is loaded but has no cuCtxGetCurrent/cuCtxSetCurrent; progress threads get no "
                    "CUDA context", LIBCUDA)
        return None
    ctx = ctypes.c_void_p()
    status = _GET(get_current)(ctypes.byref(ctx))
    if status != CUDA_SUCCESS or not ctx.value:
        # CUDA_ERROR_NOT_INITIALIZED or no context on this thread: nothing
        # of this thread's is device memory UCX would touch.
        return None
    return CudaContext(int(ctx.value), set_current, get_current, _address(libcuda, "cuCtxPushCurrent_v2"),
                       _address(libcuda, "cuCtxPopCurrent_v2"))


def make_current(ctx: CudaContext) -> int:
    """Make ``ctx`` current on the calling thread (a Python thread that
    progresses a worker: the service thread); returns the ``CUresult``."""
    return int(_PUSH(ctx.set_current)(ctx.handle))


class Binder:
    """Makes a context current on a caller's thread for one call into UCX
    and restores the thread's own afterwards (``bound``). Made once per
    agent (``what`` names it in errors): the driver calls are resolved
    here, not per call."""

    def __init__(self, ctx: CudaContext, what: str) -> None:
        self.ctx = ctx
        self.what = what
        self._get = _GET(ctx.get_current) if ctx.get_current else None
        self._push = _PUSH(ctx.push_current) if ctx.push_current and ctx.pop_current else None
        self._pop = _GET(ctx.pop_current) if self._push is not None else None
        if self._get is None or self._push is None:
            log.warning("%s: %s has no cuCtxGetCurrent/cuCtxPushCurrent_v2/cuCtxPopCurrent_v2: a caller's "
                        "thread that progresses a worker must have CUDA context %#x current itself", what,
                        LIBCUDA, ctx.handle)

    def current(self) -> int:
        """The calling thread's current context (0: none)."""
        cur = ctypes.c_void_p()
        if self._get is None or self._get(ctypes.byref(cur)) != CUDA_SUCCESS:
            return 0
        return int(cur.value or 0)

    def bound(self) -> AbstractContextManager[None]:
        """The context current on this thread for a ``with`` block: pushed
        when another one, or none, was, and popped after, so the thread's
        own is current again. One driver call when it is current already."""
        if self._push is None or self.current() == self.ctx.handle:
            return _CURRENT
        return self._pushed()

    @contextmanager
    def _pushed(self) -> Iterator[None]:
        assert self._push is not None and self._pop is not None
        status = self._push(self.ctx.handle)
        if status != CUDA_SUCCESS:
            log.error("%s: cannot push CUDA context %#x on this thread (CUresult %d); progressing without it",
                      self.what, self.ctx.handle, status)
            yield
            return
        try:
            yield
        finally:
            popped = ctypes.c_void_p()
            if self._pop(ctypes.byref(popped)) != CUDA_SUCCESS or int(popped.value or 0) != self.ctx.handle:
                log.error("%s: popping CUDA context %#x failed or popped another (%#x): this thread's current "
                          "context may not be what it was", self.what, self.ctx.handle, int(popped.value or 0))


_CURRENT: AbstractContextManager[None] = nullcontext()
