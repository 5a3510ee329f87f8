"""A pump: a thread that progresses one UCX worker in the shim's loop.

A pump progresses its worker without the interpreter lock: its thread is a
Python thread that makes the creator's CUDA context current (cuda.py) and
then runs the shim's loop (``rk_pump_run``, csrc/pump.c), which cffi calls
without the interpreter lock; the agent's own worker with
``progress="thread"``, and every lane's. It
watches the agent's completion context (``rk_ctx_t``) and, when progress
changed it (a batch published, a notification received, an endpoint
error), wakes whoever settles it: the agent's service thread through an
eventfd, or a polling caller through the agent's own worker. The worker it
progresses must be ``UCS_THREAD_MODE_MULTI``: Python posts on it meanwhile.

Its thread is joined with a bound (``PUMP_STOP_S``): a loop that does not
return (stuck in ``ucp_worker_progress``) is reported, its pump is left
allocated and ``stop()`` says so; the close goes on rather than hang here,
and leaves alone what the stuck thread may still use (agent.py, "wedged").

May import: rdma_kv.errors, rdma_kv.transport._lib, .cuda, .ucx.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Any

from rdma_kv.errors import TransferError
from rdma_kv.transport._lib import load
from rdma_kv.transport.cuda import CUDA_SUCCESS, CudaContext, make_current
from rdma_kv.transport.ucx import Worker

log = logging.getLogger("rdma_kv.transport.agent")

THREAD_NAME = b"rdma-kv-pump"  # what top -H and /proc/PID/task/TID/comm show
PR_SET_NAME = 15  # <linux/prctl.h>

PUMP_START_S = 60.0
"""How long a new pump's thread may take to start and make the CUDA context current (a thread
waits seconds for a CPU on a loaded host)."""

START_POLL_S = 0.0002
"""How often a new pump checks that its thread entered the loop (a few checks at most)."""

STATE_WORDS = 5
"""What ``rk_pump_state`` writes (shim.h): hold, busy, asleep (2: dozing), ran_ns, taken; its ``out`` holds at
least this many."""

PUMP_STOP_S = 30.0
"""How long a stop waits for the pump's loop to return (one progress call and its wake-up; a
thread given no CPU can take seconds on a loaded host)."""


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
        self.name = name
        cpus = steer_mask() if steer else None
        self._cpus = ffi.new("uint64_t[]", cpus) if cpus else ffi.NULL
        handle = lib.rk_pump_new(worker.handle, worker.efd, watch,
                                 wake_worker.handle if wake_worker is not None else ffi.NULL, wake_fd,
                                 int(spin_s * 1e9), self._cpus, len(cpus or ()))
        if handle == ffi.NULL:
            raise TransferError(f"cannot allocate the progress thread of {name!r} (out of memory)")
        self.handle: Any = handle  # rk_pump_t *; None once stopped
        self.stuck = False  # stop() gave up on the thread
        self._cuda = cuda
        self._cu_status = CUDA_SUCCESS
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rdma-kv-pump-{name}", daemon=True)
        try:
            self._thread.start()
        except RuntimeError as exc:  # can't start new thread
            lib.rk_pump_free(handle)
            raise TransferError(f"cannot start the progress thread of {name!r}: {exc}") from exc
        deadline = time.monotonic() + PUMP_START_S
        if not self._ready.wait(PUMP_START_S) or not self._entered_loop(deadline):
            self.stop()
            raise TransferError(f"the progress thread of {name!r} did not start within {PUMP_START_S:.0f} s")
        if self._cu_status != CUDA_SUCCESS:
            self._thread.join()  # it returned without running the loop
            lib.rk_pump_free(handle)
            self.handle = None
            assert cuda is not None
            raise TransferError(f"the progress thread of {name!r} cannot make the creator's CUDA context "
                                f"{cuda.handle:#x} current: cuCtxSetCurrent returned CUresult {self._cu_status}")

    def _entered_loop(self, deadline: float) -> bool:
        """Wait (until ``deadline``) for the thread to enter the shim's loop,
        which publishes its kernel thread id: a pump is born running, so
        steering and the stall reports have its thread from the first post
        on. True at once when it returned without running (a CUDA error)."""
        while self._lib.rk_pump_tid(self.handle) == 0 and self._cu_status == CUDA_SUCCESS:
            if not self._thread.is_alive() or time.monotonic() >= deadline:
                return not self._thread.is_alive()
            time.sleep(START_POLL_S)
        return True

    def _run(self) -> None:
        """The pump's thread: the creator's CUDA context first (UCX's CUDA
        transports call the driver from progress), then the shim's loop."""
        name_this_thread(THREAD_NAME)
        if self._cuda is not None:
            self._cu_status = make_current(self._cuda)
        self._ready.set()
        if self._cu_status == CUDA_SUCCESS:
            self._lib.rk_pump_run(self.handle)

    @property
    def tid(self) -> int:
        """The pump thread's kernel thread id."""
        return self._thread.native_id or 0

    def stop(self, free: bool = True) -> bool:
        """Stop the loop, join the thread (at most ``PUMP_STOP_S``) and free
        the pump (unless ``free`` is False: another thread may still reach
        it); idempotent. False when the loop did not return: it is
        reported and its pump left allocated (its thread still reads it),
        and the caller must leave its worker alone (the thread may be
        inside it, holding its lock)."""
        if self.handle is not None:
            self._lib.rk_pump_stop(self.handle)
            self._thread.join(PUMP_STOP_S)
            if self._thread.is_alive():
                self.stuck = True
                log.error("the progress thread of %r (tid %d) did not stop within %.0f s: stuck in UCX progress? "
                          "Leaving its pump and worker as they are and closing on", self.name, self.tid,
                          PUMP_STOP_S)
            elif free:
                self._lib.rk_pump_free(self.handle)
            self.handle = None
        return not self.stuck


def name_this_thread(name: bytes) -> None:
    """Name the calling thread as the kernel shows it (15 bytes at most;
    Python before 3.14 names no OS thread). Best effort."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


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
