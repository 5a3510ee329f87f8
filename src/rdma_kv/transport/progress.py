"""Progress, completion and failure handling of an ``Agent``.

``ProgressEngine`` is the half of the agent that runs after operations are
posted: it has the UCX worker driven (by the shim's C pump, with a Python
thread asleep on an eventfd until the pump reports something, or by the
caller polling), drains the shim's completion and notification rings,
resolves transfer handles and runs their callbacks outside the lock,
enforces each transfer's deadline, and fails a peer -- force-closing its
endpoint -- when UCX reports it dead or a deadline passes.
``Agent`` (agent.py) inherits it and owns the attributes used here.

May import: rdma_kv.errors and the other rdma_kv.transport modules, never agent.py.
"""

from __future__ import annotations

import heapq
import logging
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rdma_kv.errors import ClosedError, TransferError, TransferTimeoutError
from rdma_kv.transport._lib import load, status_name
from rdma_kv.transport.peer import Peer
from rdma_kv.transport.transfer import Transfer

# Same logger name as the agent's: operators filter the transport's lines by it.
log = logging.getLogger("rdma_kv.transport.agent")


@dataclass(frozen=True)
class Notification:
    """A notification from ``peer``, delivered after its transfer completed."""

    peer: str
    payload: bytes


class ProgressEngine:
    """Progress and completion for ``Agent`` (which sets every attribute)."""

    _lock: threading.RLock
    _closed: bool
    _thread: threading.Thread | None
    _lib: Any
    _ctx: Any
    _wake_fd: int
    _pump: Any  # rk_pump_t * when a C thread progresses the worker (progress="thread", lanes), else None
    _last_event: float
    _inflight: dict[int, Transfer]
    _zombies: dict[int, Any]
    _deadlines: list[tuple[float, int]]
    _callbacks: list[tuple[Callable[[Transfer], None], Transfer]]
    _peers: dict[str, Peer]
    _retired: list[Peer]
    name: str

    # ----------------------------------------------------------------- progress

    @property
    def manual_progress(self) -> bool:
        return self._thread is None and self._pump is None

    @property
    def inflight(self) -> int:
        """Transfers in flight (a transfer striped over lanes counts once)."""
        return len(self._inflight)

    def progress(self) -> int:
        """Drive the worker once (polling mode). Returns UCX events handled."""
        self._require_open()
        return self._progress()

    def _progress(self) -> int:
        # Internal callers (Transfer.wait/done) may race with close(): then
        # their transfer has been failed by close() and they just return.
        with self._lock:
            if self._closed:
                return 0
            events = self._progress_locked()
            callbacks = self._take_callbacks()
        self._run_callbacks(callbacks)
        return events

    def _poll_if_manual(self) -> None:
        if self._thread is None:
            self._progress()

    def _progress_once(self, block_s: float | None) -> None:
        """Polling mode: progress; if idle, sleep on the event fd briefly --
        but with lanes keep polling for ``spin_s`` after the last event while
        transfers are in flight: the lanes' share may finish any moment (a
        pump signals this worker when it does, so a sleep ends then too, at
        the price of a wake-up)."""
        now = time.monotonic()
        if self._progress():
            self._last_event = now
            return
        if self._lanes and self._inflight and now - self._last_event < self.config.spin_s:  # type: ignore[attr-defined]
            return
        with self._lock:
            armed = not self._closed and self._worker.arm()
        if armed:
            wait = 0.001 if block_s is None else max(0.0, min(block_s, 0.001))
            select.select([self._worker.efd], [], [], wait)

    def _progress_locked(self) -> int:
        """Progress the worker, then settle what it (or a pump) finished.
        Returns events plus completions drained."""
        return self._worker.progress() + self._service_locked()

    def _service_locked(self) -> int:
        """Settle what progress produced: completions, notifications, failed
        endpoints, deadlines, retired peers. Returns completions drained."""
        drained = self._drain_completions()
        self._drain_notifications()
        for peer in list(self._peers.values()) + self._retired:
            if peer.ep is not None and peer.ep_state.failed:
                self._fail_peer(peer, f"endpoint error {status_name(peer.ep_state.status)}")
        self._expire()
        if self._retired:
            for peer in [p for p in self._retired if p.inflight == 0]:
                self._retired.remove(peer)
                peer.close(force=True)
        return drained

    def _drain_completions(self) -> int:
        """Resolve the batches the shim finished; returns how many."""
        head = self._lib.rk_done_head(self._ctx)
        drained = head - self._done_tail
        cap = self.config.max_inflight
        while self._done_tail < head:
            xid = self._done_ring[self._done_tail % cap]
            self._done_tail += 1
            if self._zombies.pop(xid, None) is not None:
                continue
            xfer = self._inflight.pop(xid)
            status = xfer._batch.status
            xfer._peer_ref.inflight -= 1
            error = None if status == 0 else self._error_for(xfer, status)
            self._queue(xfer, error)
        return drained

    def _error_for(self, xfer: Transfer, status: int) -> TransferError:
        if xfer._expired:
            return self._timeout_error(xfer)
        name = status_name(status)
        if self._closed:  # cancelled by our own close(), not by the peer
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

    def _take_callbacks(self) -> list[tuple[Callable[[Transfer], None], Transfer]]:
        callbacks, self._callbacks = self._callbacks, []
        return callbacks

    @staticmethod
    def _run_callbacks(callbacks: Iterable[tuple[Callable[[Transfer], None], Transfer]]) -> None:
        for cb, xfer in callbacks:
            try:
                cb(xfer)
            except Exception:  # a caller's callback must not kill progress
                log.exception("transfer completion callback %r raised", cb)

    def _drain_notifications(self) -> None:
        ctx = self._ctx
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

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, xid = heapq.heappop(self._deadlines)
            xfer = self._inflight.get(xid)
            if xfer is None:
                continue
            xfer._expired = True
            peer = xfer._peer_ref
            if peer.ep is not None:
                # Cancels every operation to the peer; completions are drained
                # inside and this transfer resolves with _timeout_error().
                self._fail_peer(peer, f"did not complete transfer {xid} within its deadline; "
                                      "the peer is considered dead and its endpoint was closed")
            if xid in self._inflight:  # UCX did not cancel it: resolve it anyway
                self._inflight.pop(xid)
                self._zombies[xid] = (xfer._batch, xfer._keepalive)
                peer.inflight -= 1
                self._queue(xfer, self._timeout_error(xfer))

    @staticmethod
    def _timeout_error(xfer: Transfer) -> TransferTimeoutError:
        return TransferTimeoutError(
            f"{xfer.op.value} transfer {xfer.id} with peer {xfer.peer!r} did not complete within "
            f"its deadline ({xfer.num_descs} descriptors, {xfer.nbytes} bytes); the peer's "
            "endpoint was closed: re-import its metadata with add_peer() once it is back",
            # Same convention as every other TransferError.status: UCX's own
            # ucs_status_string() text ("Operation timed out"), not an enum name.
            status=status_name(load()[1].UCS_ERR_TIMED_OUT))

    def _fail_peer(self, peer: Peer, reason: str) -> None:
        """Mark failed and force-close the endpoint; UCX cancels its operations,
        whose completions are drained right away."""
        self._invalidate_routes()  # type: ignore[attr-defined]
        if peer.failure is None:
            peer.failure = reason
            if peer.inflight:
                log.warning("peer %s failed with %d transfers in flight: %s", peer.name, peer.inflight, reason)
        if peer.ep is not None:
            peer.close(force=True)
        if self._lanes:  # type: ignore[attr-defined]
            self._fail_lane_eps(peer.name, reason)  # type: ignore[attr-defined]
        self._drain_completions()

    def _service_loop(self) -> None:
        """progress="thread": the pump (a C thread, csrc/pump.c) progresses
        the worker without the interpreter lock; this thread sleeps on the
        agent's eventfd until a pump reports something to settle (a batch
        published, a notification, an endpoint error) or the next deadline
        is due, and settles it: the GIL is taken per event, not per
        progress round."""
        poller = select.poll()
        poller.register(self._wake_fd, select.POLLIN)
        while True:
            with self._lock:
                if self._closed:
                    return
                try:
                    self._service_locked()
                except Exception:
                    log.exception("rdma-kv progress thread failed; failing in-flight transfers")
                    self._fail_all("the progress thread failed (see the log)")
                    return
                callbacks = self._take_callbacks()
                next_deadline = self._deadlines[0][0] if self._deadlines else time.monotonic() + 1.0
            self._run_callbacks(callbacks)
            timeout_ms = max(1, min(1000, int((next_deadline - time.monotonic()) * 1000) + 1))
            if poller.poll(timeout_ms):
                try:
                    os.eventfd_read(self._wake_fd)
                except BlockingIOError:  # another read took it
                    pass

    # ------------------------------------------------- failing what is in flight

    def _require_open(self) -> None:
        if self._closed:
            raise ClosedError(f"agent {self.name!r} is closed")

    def _fail_all(self, why: str) -> None:
        for peer in list(self._peers.values()):
            if peer.inflight:
                self._fail_peer(peer, why)
        for xid, xfer in list(self._inflight.items()):
            self._inflight.pop(xid)
            self._zombies[xid] = (xfer._batch, xfer._keepalive)
            xfer._peer_ref.inflight -= 1
            self._queue(xfer, TransferError(f"{xfer.op.value} transfer {xid} with {xfer.peer!r} aborted: {why}"))
