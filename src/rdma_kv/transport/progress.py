"""Completions: the life of a batch from its record to its resolved
``Transfer``, the progress that drives it, and notifications.

``Completions`` owns the agent's C completion context (``rk_ctx_t``: the
completion ring the shim publishes finished batches on, the notification
ring), the transfers in flight, their deadlines, and how the worker is
driven: by the shim's C pump with a Python thread asleep on an eventfd
until the pump reports something (``progress="thread"``), or by the caller
polling. It resolves transfer handles, runs their callbacks outside the
lock, enforces each transfer's deadline and, when a deadline passes or UCX
reports an endpoint failed, has the peer failed (``fail_peer``, the agent's:
it also closes the lanes' endpoints) so that UCX cancels its operations.

Its interfaces: the agent posts through ``new_batch`` / ``set_notif`` /
``track`` / ``posted`` (or ``untrack``); a ``Transfer`` waits through the
``transfer.Completer`` methods (``poll``, ``progress_once``,
``completion_event``, ``add_done_callback``, ``manual_progress``).
Every method runs under the agent's lock, which it is given (``lock``).

May import: rdma_kv.errors and the transport's lower modules (_lib, cuda,
metadata, peer, peers, pump, transfer, ucx); never agent.py.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import select
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rdma_kv.errors import ClosedError, ConfigError, TransferError, TransferTimeoutError
from rdma_kv.transport import metadata as wire
from rdma_kv.transport._lib import check_status, load, status_name
from rdma_kv.transport.config import AgentConfig
from rdma_kv.transport.cuda import CudaContext
from rdma_kv.transport.peer import Peer
from rdma_kv.transport.peers import PeerTable
from rdma_kv.transport.pump import Pump
from rdma_kv.transport.transfer import Transfer, XferOp, XferState
from rdma_kv.transport.ucx import Worker

# Same logger name as the agent's: operators filter the transport's lines by it.
log = logging.getLogger("rdma_kv.transport.agent")

NOTIF_AM_ID = 0x524B  # "RK": active-message id of rdma-kv notifications

Callbacks = list[tuple[Callable[[Transfer], None], Transfer]]


@dataclass(frozen=True)
class Notification:
    """A notification from ``peer``, delivered after its transfer completed."""

    peer: str
    payload: bytes


class Completions:
    """Batches in flight on one agent, and the progress that completes them.
    ``start`` begins progress once the agent's other parts exist."""

    def __init__(self, name: str, config: AgentConfig, worker: Worker, lock: threading.RLock,
                 has_lanes: bool) -> None:
        self.name = name
        self.config = cfg = config
        self.lock = lock
        self._worker = worker
        self._has_lanes = has_lanes  # polling with lanes spins a little (progress_once)
        self._ffi, self._lib = ffi, lib = load()
        self.closed = False
        # Caller-owned rings the shim writes into (see csrc/shim.h).
        self.ctx: Any = ffi.new("rk_ctx_t *")
        self._batch_t = ffi.typeof("rk_batch_t *")
        self._done_ring = ffi.new("uint64_t[]", cfg.max_inflight)
        self.ctx.done_ring = self._done_ring
        self.ctx.done_cap = cfg.max_inflight
        self.done_tail = 0
        slot = cfg.notif_max_bytes + wire.MAX_NAME_BYTES + 8
        self._notif_mem = ffi.new("uint8_t[]", cfg.notif_slots * slot)
        self._notif_view = memoryview(ffi.buffer(self._notif_mem))
        self.ctx.notif_slots = self._notif_mem
        self.ctx.notif_slot_size = slot
        self.ctx.notif_nslots = cfg.notif_slots
        self._notif_dropped = 0
        check_status(lib.rk_set_notif_handler(worker.handle, NOTIF_AM_ID, self.ctx),
                     "ucp_worker_set_am_recv_handler")
        self._name_c = ffi.new("char[]", name.encode())  # a notification's header
        self._name_len = len(name.encode())
        self.inflight: dict[int, Transfer] = {}
        # Batch records (and notification buffers) UCX may still touch after their
        # transfer was failed without UCX's completion: freed when it comes.
        self.zombies: dict[int, Any] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._ids = itertools.count(1)
        self._notifs: deque[Notification] = deque()
        self._callbacks: Callbacks = []
        self.stats = {"transfers": 0, "ops_posted": 0, "descs": 0, "bytes": 0, "failed": 0}
        self._last_event = 0.0
        self._thread: threading.Thread | None = None
        self.pump: Pump | None = None
        # The lanes' pumps (``rk_pump_t *``), set by the agent once they run and
        # cleared before they stop: a polling caller whose own worker is idle
        # progresses their workers itself (rk_pump_help).
        self.helpers: tuple[Any, ...] = ()
        # progress="thread": the eventfd the pumps wake the service thread on.
        self.wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK) if cfg.progress == "thread" else -1
        self._peers: PeerTable | None = None
        self._fail_peer: Callable[[Peer, str], None] | None = None

    def start(self, peers: PeerTable, fail_peer: Callable[[Peer, str], None], cuda: CudaContext | None) -> None:
        """Begin progress. ``peers`` is swept for failed endpoints and idle
        retired peers; ``fail_peer(peer, reason)`` fails a peer everywhere
        (a deadline passed, an endpoint failed). With progress="thread",
        start the pump and the service thread."""
        self._peers, self._fail_peer = peers, fail_peer
        if self.wake_fd >= 0:
            self.pump = Pump(self._worker, self.ctx, wake_worker=None, wake_fd=self.wake_fd,
                             spin_s=self.config.spin_s, cuda=cuda, name=self.name)
            self._thread = threading.Thread(target=self._service_loop, name=f"rdma-kv-progress-{self.name}",
                                            daemon=True)
            self._thread.start()

    @property
    def wake_worker(self) -> Worker | None:
        """What a lane's pump signals when it completes something: the own
        worker a polling caller sleeps on (None: the service thread's eventfd)."""
        return self._worker if self.wake_fd < 0 else None

    # ------------------------------------------------------------------ batches

    def new_batch(self, ep: Any) -> tuple[int, Any]:
        """A transfer id and its batch record (for endpoint ``ep``; None: a
        zeroed record that rk_submit fills in), if there is room."""
        cfg = self.config
        if len(self.inflight) + len(self.zombies) >= cfg.max_inflight:
            # UCX may still write the zombies' records: they count too.
            raise TransferError(f"{cfg.max_inflight} transfers already in flight on {self.name!r} "
                                "(AgentConfig.max_inflight); wait for some to complete")
        xid = next(self._ids)
        if ep is None:  # the request path fills the batch itself: skip cffi's initializer conversion
            return xid, self._ffi.new(self._batch_t)
        return xid, self._ffi.new(self._batch_t, (xid, self.ctx, ep))

    def set_notif(self, batch: Any, notify: bytes) -> tuple[Any, ...]:
        """Fill the notification into a batch record not yet posted; returns
        what must stay alive until UCX sent it."""
        if len(notify) > self.config.notif_max_bytes:
            raise ConfigError(f"notification of {len(notify)} bytes exceeds "
                              f"notif_max_bytes={self.config.notif_max_bytes}")
        data = self._ffi.from_buffer(bytes(notify)) if notify else self._ffi.NULL
        batch.has_notif = 1
        batch.am_id = NOTIF_AM_ID
        batch.notif_header = self._name_c
        batch.notif_header_len = self._name_len
        batch.notif_data = data
        batch.notif_data_len = len(notify)
        return (data,)

    def track(self, op: XferOp, p: Peer, xid: int, batch: Any, keep: tuple[Any, ...], nbytes: int,
              num_descs: int, timeout_s: float | None) -> Transfer:
        """The Transfer of a batch about to be posted, tracked from now on:
        UCX may write its record (and complete it on a pump) as soon as
        anything is posted."""
        deadline = time.monotonic() + (self.config.transfer_timeout_s if timeout_s is None else timeout_s)
        xfer = Transfer(self, xid, op, p.name, batch, keep, nbytes, num_descs, deadline)
        xfer._peer_ref = p
        self.inflight[xid] = xfer
        p.inflight += 1
        heapq.heappush(self._deadlines, (deadline, xid))  # _expire skips ids no longer in flight
        return xfer

    def untrack(self, xfer: Transfer) -> None:
        """Forget a tracked transfer whose batch was not posted at all."""
        del self.inflight[xfer.id]
        xfer._peer_ref.inflight -= 1

    def posted(self, xfer: Transfer, ops: int, post_s: float) -> Transfer:
        """Account for a tracked transfer's post (``ops`` operations)."""
        xfer.ops_posted = ops
        xfer.post_s = post_s
        s = self.stats
        s["transfers"] += 1
        s["ops_posted"] += ops
        s["descs"] += xfer.num_descs
        s["bytes"] += xfer.nbytes
        if self._lib.rk_done_head(self.ctx) != self.done_tail:  # some batch completed in place
            self.drain()
        if self._thread is not None and xfer.state is XferState.IN_PROGRESS:
            self._worker.signal()
        if self._callbacks:
            # Posting thread holds the (reentrant) lock; callbacks run now.
            self.run_callbacks(self.take_callbacks())
        return xfer

    # ------------------------------------------------------------------ progress

    @property
    def manual_progress(self) -> bool:
        return self._thread is None and self.pump is None

    def require_open(self) -> None:
        if self.closed:
            raise ClosedError(f"agent {self.name!r} is closed")

    def progress(self) -> int:
        """Drive the worker once and settle; returns UCX events handled.
        Internal callers (Transfer.wait/done) may race with close(): then
        their transfer has been failed by close() and they just return."""
        with self.lock:
            if self.closed:
                return 0
            events = self._progress_locked()
            callbacks = self.take_callbacks()
        self.run_callbacks(callbacks)
        return events

    def poll(self) -> None:
        """Progress unless a service thread does."""
        if self._thread is None:
            self.progress()

    def progress_once(self, block_s: float | None) -> None:
        """Polling mode: progress; if idle, sleep on the event fd briefly --
        but with lanes keep polling for ``spin_s`` after the last event while
        transfers are in flight: the lanes' share may finish any moment (a
        pump signals this worker when it does, so a sleep ends then too, at
        the price of a wake-up)."""
        now = time.monotonic()
        if self.progress():
            self._last_event = now
            return
        if self._has_lanes and self.inflight and now - self._last_event < self.config.spin_s:
            return
        with self.lock:
            armed = not self.closed and self._worker.arm()
        if armed:
            wait = 0.001 if block_s is None else max(0.0, min(block_s, 0.001))
            select.select([self._worker.efd], [], [], wait)

    def completion_event(self, xfer: Transfer) -> threading.Event:
        """``xfer``'s event, made on demand (a transfer nobody blocks on never
        pays for it) under the lock, as resolving runs: set if resolved."""
        with self.lock:
            if xfer._event is None:
                xfer._event = threading.Event()
                if xfer.state is not XferState.IN_PROGRESS:
                    xfer._event.set()
            return xfer._event

    def add_done_callback(self, xfer: Transfer, fn: Callable[[Transfer], None]) -> bool:
        """Queue ``fn`` for ``xfer``'s completion; False if it has completed already."""
        with self.lock:
            if xfer.state is XferState.IN_PROGRESS:
                xfer._callbacks.append(fn)
                return True
        return False

    def _progress_locked(self) -> int:
        """Progress the worker, then settle what it (or a pump) finished.
        Returns events plus completions drained.

        With lanes, once the own worker is idle (its part of a striped
        transfer is done) and transfers are in flight, the caller also
        progresses each lane's worker that its pump is not progressing at
        that moment: a pump asleep or not yet scheduled (a loaded host)
        would otherwise leave the caller waiting for its wake-up while its
        own CPU idles. A pump that is progressing is left alone."""
        events = self._worker.progress()
        if not events and self.helpers and self.inflight:
            help_ = self._lib.rk_pump_help
            for pump in self.helpers:
                events += help_(pump, 1024)
        return events + self._service_locked()

    def _service_locked(self) -> int:
        """Settle what progress produced: completions, notifications, failed
        endpoints, deadlines, retired peers. Returns completions drained."""
        assert self._peers is not None and self._fail_peer is not None, "start() binds them"
        drained = self.drain()
        self._drain_notifications()
        for peer in self._peers.failed_endpoints():
            self._fail_peer(peer, f"endpoint error {status_name(peer.ep_state.status)}")
        self._expire()
        self._peers.close_idle_retired()
        return drained

    def drain(self) -> int:
        """Resolve the batches the shim finished; returns how many."""
        head = self._lib.rk_done_head(self.ctx)
        drained: int = head - self.done_tail
        cap = self.config.max_inflight
        while self.done_tail < head:
            xid = self._done_ring[self.done_tail % cap]
            self.done_tail += 1
            if self.zombies.pop(xid, None) is not None:
                continue
            xfer = self.inflight.pop(xid)
            status = xfer._batch.status
            xfer._peer_ref.inflight -= 1
            error = None if status == 0 else self._error_for(xfer, status)
            self._queue(xfer, error)
        return drained

    def _error_for(self, xfer: Transfer, status: int) -> TransferError:
        if xfer._expired:
            return self._timeout_error(xfer)
        name = status_name(status)
        if self.closed:  # cancelled by our own close(), not by the peer
            return TransferError(
                f"{xfer.op.value} transfer {xfer.id} with peer {xfer.peer!r} aborted: agent "
                f"{self.name!r} was closed ({xfer.num_descs} descriptors, {xfer.nbytes} bytes)",
                status=name,
            )
        peer = xfer._peer_ref
        why = peer.failure
        if why is None and peer.ep_state.failed:
            why = f"endpoint error {status_name(peer.ep_state.status)}"
        detail = f"; peer {xfer.peer!r} {why}" if why else ""
        return TransferError(
            f"{xfer.op.value} transfer {xfer.id} with peer {xfer.peer!r} failed: {name}{detail} "
            f"({xfer.num_descs} descriptors, {xfer.nbytes} bytes); if the peer restarted, "
            "re-import its metadata with add_peer()",
            status=name,
        )

    def _queue(self, xfer: Transfer, error: TransferError | None) -> None:
        if error is not None:
            self.stats["failed"] += 1
        for cb in xfer._resolve(error):
            self._callbacks.append((cb, xfer))

    def take_callbacks(self) -> Callbacks:
        callbacks, self._callbacks = self._callbacks, []
        return callbacks

    @staticmethod
    def run_callbacks(callbacks: Iterable[tuple[Callable[[Transfer], None], Transfer]]) -> None:
        """Run callbacks taken under the lock; call with no lock held."""
        for cb, xfer in callbacks:
            try:
                cb(xfer)
            except Exception:  # a caller's callback must not kill progress
                log.exception("transfer completion callback %r raised", cb)

    # ------------------------------------------------------------ notifications

    def notifications(self) -> list[Notification]:
        """Notifications received since the last call, in arrival order."""
        self.poll()
        with self.lock:
            out = list(self._notifs)
            self._notifs.clear()
            return out

    def _drain_notifications(self) -> None:
        ctx = self.ctx
        head = ctx.notif_head
        if head != ctx.notif_tail:
            size, nslots, view = ctx.notif_slot_size, ctx.notif_nslots, self._notif_view
            tail = ctx.notif_tail
            while tail < head:
                off = (tail % nslots) * size
                hl, dl = struct.unpack_from("<II", view, off)
                sender = bytes(view[off + 8:off + 8 + hl]).decode("utf-8", "replace")
                self._notifs.append(Notification(sender, bytes(view[off + 8 + hl:off + 8 + hl + dl])))
                tail += 1
            ctx.notif_tail = tail
        dropped = ctx.notif_dropped_full + ctx.notif_dropped_rndv
        if dropped != self._notif_dropped:
            log.warning("agent %s dropped %d notifications (ring of %d full or oversized); "
                        "call get_notifications() more often or raise notif_slots",
                        self.name, dropped - self._notif_dropped, self.config.notif_slots)
            self._notif_dropped = dropped

    # ------------------------------------------------------------------ failure

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, xid = heapq.heappop(self._deadlines)
            xfer = self.inflight.get(xid)
            if xfer is None:
                continue
            xfer._expired = True
            peer = xfer._peer_ref
            if peer.ep is not None:
                # Cancels every operation to the peer; completions are drained
                # inside and this transfer resolves with _timeout_error().
                assert self._fail_peer is not None
                self._fail_peer(peer, f"did not complete transfer {xid} within its deadline; "
                                      "the peer is considered dead and its endpoint was closed")
            if xid in self.inflight:  # UCX did not cancel it: resolve it anyway
                self._abandon(xfer, self._timeout_error(xfer))

    def _abandon(self, xfer: Transfer, error: TransferError) -> None:
        """Resolve ``xfer`` before UCX completed it: its record becomes a zombie."""
        self.inflight.pop(xfer.id)
        self.zombies[xfer.id] = (xfer._batch, xfer._keepalive)
        xfer._peer_ref.inflight -= 1
        self._queue(xfer, error)

    @staticmethod
    def _timeout_error(xfer: Transfer) -> TransferTimeoutError:
        return TransferTimeoutError(
            f"{xfer.op.value} transfer {xfer.id} with peer {xfer.peer!r} did not complete within "
            f"its deadline ({xfer.num_descs} descriptors, {xfer.nbytes} bytes); the peer's "
            "endpoint was closed: re-import its metadata with add_peer() once it is back",
            # Same convention as every other TransferError.status: UCX's own
            # ucs_status_string() text ("Operation timed out"), not an enum name.
            status=status_name(load()[1].UCS_ERR_TIMED_OUT))

    def fail_all(self, why: str) -> None:
        """Fail every peer with work in flight, then resolve what is left."""
        if self._peers is not None and self._fail_peer is not None:
            for peer in self._peers.with_inflight():
                self._fail_peer(peer, why)
        for xfer in list(self.inflight.values()):
            self._abandon(xfer, TransferError(f"{xfer.op.value} transfer {xfer.id} with {xfer.peer!r} "
                                              f"aborted: {why}"))

    def _service_loop(self) -> None:
        """progress="thread": the pump (a C thread, csrc/pump.c) progresses
        the worker without the interpreter lock; this thread sleeps on the
        agent's eventfd until a pump reports something to settle (a batch
        published, a notification, an endpoint error) or the next deadline
        is due, and settles it: the GIL is taken per event, not per
        progress round."""
        poller = select.poll()
        poller.register(self.wake_fd, select.POLLIN)
        while True:
            with self.lock:
                if self.closed:
                    return
                try:
                    self._service_locked()
                except Exception:
                    log.exception("rdma-kv progress thread failed; failing in-flight transfers")
                    self.fail_all("the progress thread failed (see the log)")
                    return
                callbacks = self.take_callbacks()
                next_deadline = self._deadlines[0][0] if self._deadlines else time.monotonic() + 1.0
            self.run_callbacks(callbacks)
            timeout_ms = max(1, min(1000, int((next_deadline - time.monotonic()) * 1000) + 1))
            if poller.poll(timeout_ms):
                try:
                    os.eventfd_read(self.wake_fd)
                except BlockingIOError:  # another read took it
                    pass

    # ------------------------------------------------------------------ closing

    def begin_close(self) -> bool:
        """Mark closed and wake every sleeper; False if already closed. Caller holds the lock."""
        if self.closed:
            return False
        self.closed = True
        self._worker.signal()  # a caller sleeping in wait() (polling mode)
        if self.wake_fd >= 0:
            os.eventfd_write(self.wake_fd, 1)  # the service thread
        return True

    def stop_progress(self) -> None:
        """Join the service thread and stop the pump: from here on, the
        closing caller progresses. Call with no lock held."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if self.pump is not None:
            self.pump.stop()
            self.pump = None

    def drain_for_close(self, why: str) -> Callbacks:
        """Let what is in flight finish (at most ``close_drain_s``; lanes'
        pumps still progress their share), then fail the rest. Caller holds
        the lock; returns the callbacks to run once it is released."""
        end = time.monotonic() + self.config.close_drain_s
        while self.inflight and time.monotonic() < end:
            if not self._progress_locked():
                time.sleep(0.0001)
        self.fail_all(why)
        return self.take_callbacks()

    def close(self) -> Callbacks:
        """Settle the last completions and release the eventfd, once every
        pump writing to it has stopped. Caller holds the lock."""
        self.drain()
        if self.wake_fd >= 0:
            os.close(self.wake_fd)
            self.wake_fd = -1
        return self.take_callbacks()
