"""Progress: how an agent's workers are driven and what settles is woken.

``progress="thread"``: a *pump* (a C thread of the shim, pump.py)
progresses the agent's own worker without the interpreter lock, and a
Python *service thread* sleeps in C on an eventfd (``Wake``) until a pump
reports something to settle (a slot published, a notification, an
endpoint error) that no caller has settled within ``settle_delay_s``, or
the next deadline is due, and settles it (the agent's ``service``: the
in-flight table, the notifications, failed endpoints, deadlines). It also
progresses, itself, the worker of any pump (the own one, the lanes') that
has not progressed it for ``HELP_STALE_NS`` (a pump given no CPU: found
under load, a lane pump, runnable and not scheduled, held a push's writes
for 60 s): looking every ``HELP_STALE_NS`` while transfers are in flight,
and every ``HELP_IDLE_NS`` otherwise, then only at workers with events
waiting (a target's, whose peers' operations it answers). Callers
settle whenever they are there anyway (``wait()``, ``settle()``,
``get_notifications()``), so that a busy caller and the service thread do
not trade the interpreter lock once per completion. A caller blocked in
``Transfer.wait`` does not wait for that thread: ``block`` sleeps in C on
the transfer's own slot (``rk_await``), which the completing thread
wakes, and first, for ``spin_s``, moves the work of any pump that is not
running (asleep, or not given a CPU yet).

``progress="poll"``: the caller drives: ``progress()``, and ``wait()`` /
``done()`` do so too; a pump that completes a lane's part signals the own
worker, which an idle poller sleeps on. With lanes, a poller whose own
worker is idle progresses each lane's worker whose pump is not
progressing it (``helpers``; ``rk_pump_help``).

``ProgressDriver`` owns the own pump, the service thread and ``Wake``; the
lanes' pumps it may help are given to it when it is made. It runs the
agent's ``service`` under the agent's lock, and completion callbacks after
the lock is released.

May import: rdma_kv.transport._lib, .config, .cuda, .inflight, .pump,
.transfer, .ucx; never agent.py.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from rdma_kv.transport._lib import load
from rdma_kv.transport.config import AgentConfig
from rdma_kv.transport.cuda import CUDA_SUCCESS, Binder, CudaContext, make_current
from rdma_kv.transport.inflight import Callbacks, InFlight
from rdma_kv.transport.pump import STATE_WORDS, Pump
from rdma_kv.transport.transfer import Transfer, XferState
from rdma_kv.transport.ucx import Worker

log = logging.getLogger("rdma_kv.transport.agent")

HELP_STALE_NS = 20_000_000
"""The service thread progresses the worker of a pump (the own one, a lane's)
that has not done so for this long while transfers are in flight (a healthy pump loops within
microseconds when busy and every 100 ms when asleep)."""

SERVICE_SLEEP_S = 1.0
"""The longest the service thread sleeps when nothing wakes it and no deadline comes sooner (a
deadline posted during the sleep is seen at its next look at the pumps: ``rk_service_wait``)."""

HELP_IDLE_NS = 100_000_000
"""How often the service thread looks at the pumps while none of the agent's own transfers is in
flight: it progresses the worker of one that has events waiting and has not progressed it for
``HELP_STALE_NS`` (over TCP a target's worker answers its peers' reads, writes and flushes; a
push's decode and a pull's producer are such targets). Ten looks a second, each a ``poll`` per
pump without the interpreter lock."""

CLOSE_HELP_WAIT_S = 30.0
"""How long a close waits for threads inside a help round (each is at most 64 progress rounds; a
thread given no CPU can take seconds on a loaded host)."""

CLOSE_BLOCKED_WAIT_S = 5.0
"""How long a close waits for callers blocked in ``rk_await`` to leave it, and for the service
thread to end. One still there after it may yet reach a pump: then the pumps are not freed (the
agent closes as a wedged one)."""

_UNBOUND: AbstractContextManager[None] = nullcontext()

Service = Callable[[], int]  # the agent's settling round (caller holds the lock): completions drained


class Wake:
    """Where a pump reports something to settle: an eventfd the service
    thread sleeps on (``progress="thread"``), or the agent's own ``worker``,
    which a polling caller sleeps on."""

    def __init__(self, progress: str, worker: Worker) -> None:
        pumped = progress == "thread"
        self.fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK) if pumped else -1
        self.worker: Worker | None = None if pumped else worker

    def close(self) -> None:
        """Once every pump that writes to it has stopped."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ProgressDriver:
    """Drives the worker of the agent ``name`` and settles through
    ``service`` (``fail_all(why)`` if that ever raises). ``helpers`` are the
    lanes' pumps (``rk_pump_t *``) a caller may help; ``cuda`` the context
    the own pump makes current, and a caller's thread gets for each call
    that progresses a worker (``bound``)."""

    def __init__(self, name: str, config: AgentConfig, worker: Worker, lock: threading.RLock,
                 inflight: InFlight, wake: Wake, helpers: tuple[Any, ...], cuda: CudaContext | None,
                 service: Service, fail_all: Callable[[str], None]) -> None:
        self._ffi, self._lib = ffi, lib = load()
        self._rk_progress = lib.rk_progress
        self.name = name
        self.config = config
        self.lock = lock
        self._worker = worker
        self._inflight = inflight
        self._ctx = inflight.ctx
        self._wake = wake
        self._service = service
        self._fail_all = fail_all
        self._last_event = 0.0
        self._spin_ns = int(config.spin_s * 1e9)
        self.helpers = helpers
        self._cuda = cuda
        self._binder = Binder(cuda, f"agent {name!r}") if cuda is not None else None
        self._blocked = 0  # callers inside rk_await (they may be helping the pumps)
        self.stragglers = 0  # threads still in the shim when stop() gave up waiting for them
        self.pump: Pump | None = None
        self._thread: threading.Thread | None = None
        if wake.fd >= 0:
            # Not steered: with the lanes steered off the poster's CPU, the own
            # pump is what runs on it once the poster sleeps.
            self.pump = Pump(worker, self._ctx, wake_worker=None, wake_fd=wake.fd, spin_s=config.spin_s,
                             cuda=cuda, name=name, steer=False)
        # What a blocked caller helps (rk_await): every pump, own first.
        self._pumps = ((self.pump.handle,) if self.pump is not None else ()) + helpers
        self._await_help = ffi.new("rk_pump_t *[]", list(self._pumps) or [ffi.NULL])
        self._await_nhelp = len(self._pumps)
        if wake.fd >= 0:
            try:
                self._thread = threading.Thread(target=self._service_loop, name=f"rdma-kv-progress-{name}",
                                                daemon=True)
                self._thread.start()
            except BaseException:
                # The agent tears the worker down next (it never knew this
                # driver): the pump must not be progressing it then.
                self._thread = None
                if self.pump is not None:
                    self.pump.stop()
                raise

    def bound(self) -> AbstractContextManager[None]:
        """Around a caller's call that may progress a worker (itself, or a
        pump's it helps, or closing endpoints): the creator's CUDA context
        current on the calling thread for the call, the thread's own (or
        none) after it. Nothing without CUDA."""
        return _UNBOUND if self._binder is None else self._binder.bound()

    # ------------------------------------------------------------------ modes

    @property
    def manual_progress(self) -> bool:
        return self._thread is None and self.pump is None

    def progress(self) -> int:
        """Drive the worker once and settle; returns UCX events handled.
        Internal callers (Transfer.wait/done) may race with close(): then
        their transfer has been failed by close() and they just return."""
        if self._binder is not None:
            with self._binder.bound():
                return self._progress()
        return self._progress()

    def _progress(self) -> int:
        # Written for a cold cache, as the request path is (prepared.py): the
        # lock taken without ``with``, no callbacks no call.
        inflight, lock = self._inflight, self.lock
        lock.acquire()
        try:
            if inflight.closed:
                return 0
            events = self.progress_locked()
            callbacks = inflight.take_callbacks()
        finally:
            lock.release()
        if callbacks:
            inflight.run_callbacks(callbacks)
        return events

    def poll(self) -> None:
        """Progress unless a service thread does."""
        if self._thread is None:
            self.progress()

    def settle(self) -> None:
        """Settle on the caller's thread what is finished, and run its
        callbacks here. Pumped mode: the batches and notifications the
        pumps have published and the service thread has not settled yet
        (it leaves them to a caller for ``settle_delay_s``, and then needs
        the interpreter lock, which a caller that steps an engine back to
        back holds most of the time); an unlocked look at the rings first,
        so that nothing finished costs no lock. Polling mode: one progress
        round."""
        ctx = self._ctx
        if self._thread is None:
            self.progress()
        elif ctx.done_head != ctx.done_tail or ctx.notif_head != ctx.notif_tail:
            self.progress_settle()

    def progress_once(self, block_s: float) -> None:
        """Polling mode: progress; if idle, sleep on the event fd briefly --
        but with lanes keep polling for ``spin_s`` after the last event while
        transfers are in flight: the lanes' share may finish any moment (a
        pump signals this worker when it does, so a sleep ends then too, at
        the price of a wake-up)."""
        now = time.monotonic()
        if self.progress():
            self._last_event = now
            return
        if self.helpers and self._ctx.live and now - self._last_event < self.config.spin_s:
            return
        with self.lock:
            armed = not self._inflight.closed and self._worker.arm()
        if armed:
            select.select([self._worker.efd], [], [], max(0.0, min(block_s, 0.001)))

    def block(self, xfer: Transfer, block_s: float) -> None:
        """Pumped mode: sleep in C on ``xfer``'s slot until it completes (or
        ``block_s`` passes), helping idle pumps for ``spin_s`` first, then
        settle it here rather than wait for the service thread."""
        with self.lock:
            if self._inflight.closed:  # close() settles it; pumps may be gone
                closing = True
            else:
                closing = False
                self._blocked += 1
                nhelp = self._await_nhelp
        if closing:
            time.sleep(min(block_s, 0.001))
            return
        try:
            with self.bound():
                self._lib.rk_await(self._ctx, xfer._slot, xfer.id, self._await_help, nhelp, self.pump is not None,
                                   self._spin_ns,
                                   max(1, int(block_s * 1e9)))
        finally:
            with self.lock:
                self._blocked -= 1
        if xfer.state is XferState.IN_PROGRESS:
            self.progress_settle()

    def progress_settle(self) -> None:
        """Settle what the pumps finished (pumped mode), then run callbacks."""
        inflight = self._inflight
        with self.bound(), self.lock:  # (failing a peer closes its endpoints: progress)
            if inflight.closed:
                return
            self._service()
            callbacks = inflight.take_callbacks()
        inflight.run_callbacks(callbacks)

    def add_done_callback(self, xfer: Transfer, fn: Callable[[Transfer], None]) -> bool:
        with self.lock:
            return self._inflight.add_done_callback(xfer, fn)

    def progress_locked(self) -> int:
        """Progress the worker, then settle what it (or a pump) finished.
        Returns events plus completions drained. Caller holds the lock.

        With lanes, once the own worker is idle (its part of a striped
        transfer is done) and transfers are in flight, the caller also
        progresses each lane's worker that its pump is not progressing at
        that moment: a pump asleep or not yet scheduled (a loaded host)
        would otherwise leave the caller waiting for its wake-up while its
        own CPU idles. A pump that is progressing is left alone."""
        events: int = self._rk_progress(self._worker.handle, 1024)
        if not events and self.helpers and self._ctx.live:
            help_ = self._lib.rk_pump_help
            for pump in self.helpers:
                events += help_(pump, 1024)
        return events + self._service()

    def _service_loop(self) -> None:
        """progress="thread": the pump (a C thread, csrc/pump.c) progresses
        the worker without the interpreter lock; this thread sleeps in C
        (``rk_service_wait``, no interpreter lock either) until a pump has
        published something to settle (a slot, a notification, an endpoint
        error) that no caller settled within ``settle_delay_s``, or the next
        deadline is due, and settles it: the GIL is taken only for work a
        caller left, at most once per ``settle_delay_s``."""
        inflight, ctx, lib = self._inflight, self._ctx, self._lib
        delay_ns = int(self.config.settle_delay_s * 1e9)
        helps = True  # the pumps' work this thread does needs their CUDA context, as theirs does
        if self._cuda is not None and (status := make_current(self._cuda)) != CUDA_SUCCESS:
            helps = False
            log.warning("agent %r: the progress thread could not make CUDA context %#x current (CUresult %d); "
                        "it leaves a pump that gets no CPU to a blocked caller", self.name, self._cuda.handle,
                        status)
        while True:
            with self.lock:
                if inflight.closed:
                    return
                errors = ctx.ep_errors  # before service: an error after it wakes the next wait
                try:
                    self._service()
                    failed = False
                except Exception:
                    # A bug: said, and what was in flight fails (its callbacks
                    # run below). The thread goes on: nothing else settles a
                    # pumped agent's completions or enforces its deadlines.
                    log.exception("rdma-kv progress thread: settling failed; failing in-flight transfers")
                    try:
                        self._fail_all("the progress thread failed (see the log)")
                    except Exception:
                        log.exception("rdma-kv progress thread: failing in-flight transfers failed too")
                    failed = True
                callbacks = inflight.take_callbacks()
                due = inflight.next_deadline()
            inflight.run_callbacks(callbacks)
            if failed:
                time.sleep(0.1)  # a bug that repeats logs at most ten times a second
            left = SERVICE_SLEEP_S if due is None else min(SERVICE_SLEEP_S, due - time.monotonic())
            # The pumps a blocked caller helps are the ones this thread helps when stale (none
            # once closing: wake_all empties the list, and the shim checks closing too).
            lib.rk_service_wait(ctx, self._wake.fd, errors, delay_ns, max(1, int(left * 1e9)), self._await_help,
                                self._await_nhelp if helps else 0, HELP_STALE_NS, HELP_IDLE_NS)

    # ------------------------------------------------------------------ closing

    def wake_all(self) -> None:
        """Wake every sleeper (closing): a polling caller, the service thread.
        Caller holds the lock."""
        self._await_nhelp = 0  # callers blocked from now on help no pump
        self._worker.signal()
        if self._wake.fd >= 0:
            os.eventfd_write(self._wake.fd, 1)

    def stop(self) -> bool:
        """Release every caller blocked in C, join the service thread and stop
        the own pump: from here on, the closing caller progresses. Call with
        no lock held, after ``wake_all``. False when the own pump's thread
        is stuck in the worker (``Pump.stop``): then nothing may progress it."""
        self._lib.rk_wake_waiters(self._ctx)  # they leave C within one help round
        if self._wake.fd >= 0:  # and the service thread's wait, which looks at closing when woken
            os.eventfd_write(self._wake.fd, 1)
        end = time.monotonic() + CLOSE_BLOCKED_WAIT_S
        while self._blocked and time.monotonic() < end:
            time.sleep(0.0001)
        service = self._thread if self._thread is not threading.current_thread() else None
        if service is not None:
            service.join(timeout=CLOSE_BLOCKED_WAIT_S)
        # No pump stops and no worker goes while a thread is inside a help round (closing is
        # set, so none starts one): one preempted there would use them after they were freed.
        end = time.monotonic() + CLOSE_HELP_WAIT_S
        while (inside := self._helpers_inside()) and time.monotonic() < end:
            time.sleep(0.0001)
        # A thread still blocked in C past these bounds (descheduled for
        # seconds on a loaded host, or the service thread not joined) may yet
        # look at a pump or the completion context: nothing it can reach is
        # freed (the agent closes as a wedged one, its pumps kept).
        service_alive = service is not None and service.is_alive()
        self.stragglers = inside + self._blocked + service_alive
        if self.stragglers:
            log.error("agent %r closing: %d thread(s) inside a help round, %d blocked caller(s) and %s service "
                      "thread still in the shim after their bounds; leaving what they can reach in place",
                      self.name, inside, self._blocked, "a" if service_alive else "no")
        stopped = True
        if self.pump is not None:
            stopped = self.pump.stop(free=not self.stragglers)
            self.pump = None
        return stopped and not self.stragglers

    def _helpers_inside(self) -> int:
        """Threads holding one of the pumps (posts are over once closing: helpers)."""
        state = self._ffi.new(f"uint64_t[{STATE_WORDS}]")
        inside = 0
        for pump in self._pumps:
            self._lib.rk_pump_state(pump, state)
            inside += int(state[0])
        return inside

    def stop_helping(self) -> None:
        """The lanes' pumps stop next: help them no more. Caller holds the lock."""
        self.helpers = ()

    def drain_for_close(self) -> Callbacks:
        """Let what is in flight finish (at most ``close_drain_s``; lanes'
        pumps still progress their share), then return the callbacks due.
        Caller holds the lock."""
        end = time.monotonic() + self.config.close_drain_s
        while self._ctx.live and time.monotonic() < end:
            if not self.progress_locked():
                time.sleep(0.0001)
        return self._inflight.take_callbacks()

    def close(self) -> None:
        """Release the eventfd, once every pump writing to it has stopped."""
        self._wake.close()
