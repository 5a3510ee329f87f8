"""The in-flight table: every transfer from its submission to its settlement.

``InFlight`` owns the agent's C context (``rk_ctx_t``) and, in it, the slab
of batch records (one slot per transfer in flight, ``max_inflight`` of
them), its free stack and the completion ring; and in Python the table of
``Transfer`` handles by slot. It is the only code that settles a
``Transfer`` (``Transfer._settle``) and the one submit path every transfer
takes: ``submit`` is one C call (``rk_submit``) on a route (route.py) that
checks the request, takes a slot (its id, its deadline, its notification),
chooses the workers and posts; then one ``Transfer`` for the slot.

Settling: ``drain`` resolves what the shim published on the completion
ring; ``expire`` fails what outlived its deadline (the shim keeps the
deadlines and finds the expired ones), having the peer failed
(``fail_peer``, the agent's) so that UCX cancels its operations, and
*abandons* what UCX does not hand back: resolved now, its slot kept (a
zombie, with the notification bytes UCX may still read) until UCX does.
Callbacks of settled transfers are queued here and run outside the lock.

Every method runs under the agent's lock. May import: rdma_kv.errors and
the transport's lower modules (_lib, config, peer, route, stall, transfer).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from rdma_kv.errors import ConfigError, TransferError, TransferTimeoutError
from rdma_kv.transport import stall
from rdma_kv.transport._lib import load, status_name
from rdma_kv.transport.config import AgentConfig
from rdma_kv.transport.peer import Peer
from rdma_kv.transport.route import Route
from rdma_kv.transport.transfer import Callback, Owner, Transfer, XferOp, XferState

# Same logger name as the agent's: operators filter the transport's lines by it.
log = logging.getLogger("rdma_kv.transport.agent")

Callbacks = list[tuple[Callback, Transfer]]
FailPeer = Callable[[Peer, str], None]

_EXPIRED_MAX = 256  # slots rk_expired reports per call (the rest on the next round)
_SLOT_MASK = 0xFFFFFFFF


@dataclass(frozen=True)
class AgentStats:
    """What one agent has done so far (a snapshot: ``Agent.stats``)."""

    transfers: int
    ops_posted: int
    descs: int
    bytes: int
    failed: int


# Mirrors of csrc/shim.h's enums (checked against the shim in InFlight()).
OP_GET, OP_PUT, OP_FLUSH = 0, 1, 2
IDX_L32, IDX_R32, LIST, NOTIFY = 1, 2, 4, 8
SUBMIT_STALE, SUBMIT_PEER_FAILED, SUBMIT_BAD_PAIR, SUBMIT_FULL, SUBMIT_NOTIF_SIZE, SUBMIT_BAD_THEN = -1, -2, -3, -4, -5, -6
OPCODE = {XferOp.READ: OP_GET, XferOp.WRITE: OP_PUT, XferOp.FLUSH: OP_FLUSH}


class InFlight:
    """Transfers in flight on the agent ``name``; ``owner`` is what their
    handles wait through (the agent's)."""

    def __init__(self, name: str, config: AgentConfig, owner: Owner) -> None:
        self.name = name
        self.config = cfg = config
        self._owner = owner
        ffi, lib = load()
        assert (lib.RK_OP_GET, lib.RK_OP_PUT, lib.RK_OP_FLUSH, lib.RK_IDX_L32, lib.RK_IDX_R32, lib.RK_LIST,
                lib.RK_NOTIFY, lib.RK_SUBMIT_STALE, lib.RK_SUBMIT_PEER_FAILED, lib.RK_SUBMIT_BAD_PAIR,
                lib.RK_SUBMIT_FULL, lib.RK_SUBMIT_NOTIF_SIZE, lib.RK_SUBMIT_BAD_THEN) == (
            OP_GET, OP_PUT, OP_FLUSH, IDX_L32, IDX_R32, LIST, NOTIFY, SUBMIT_STALE, SUBMIT_PEER_FAILED,
            SUBMIT_BAD_PAIR, SUBMIT_FULL, SUBMIT_NOTIF_SIZE, SUBMIT_BAD_THEN), \
            "inflight.py's constants differ from csrc/shim.h"
        self._null = ffi.NULL
        self._unpack = ffi.unpack
        self.rk_submit = lib.rk_submit
        self._rk_drain = lib.rk_drain
        self._lib = lib
        self.closed = False
        n = cfg.max_inflight
        # The C context and the slab it points at: caller-owned, they live
        # as long as this table (UCX may write a record until it hands the
        # slot back; the agent closes its worker before this goes).
        self.ctx: Any = ffi.new("rk_ctx_t *")
        self._slots = ffi.new("rk_batch_t[]", n)
        self._free = ffi.new("uint32_t[]", n)
        self._ring = ffi.new("uint32_t[]", n)
        lib.rk_ctx_init(self.ctx, self._slots, self._free, n, self._ring, n)
        self.ctx.timeout_ns = int(cfg.transfer_timeout_s * 1e9)
        self._table: list[Transfer | None] = [None] * n
        # slot -> what the shim may still read when UCX completes it late: the
        # notification's bytes, the peer (its endpoint state: the completion
        # enters it to send the notification or post the chained read) and
        # the chained read's record, arrays and route, kept alive until then
        self._zombies: dict[int, tuple[bytes | None, Any, Any]] = {}
        self._drained = ffi.new("uint64_t[]", 2 * n)  # rk_drain: (slot | status, completed at) pairs
        self._expired = ffi.new("uint32_t[]", _EXPIRED_MAX)
        self.out = ffi.new("uint64_t[]", 9 + 16)  # rk_submit's out: 9 fields + one per worker (MAX_LANES)
        self._callbacks: Callbacks = []
        self._failed = 0

    # ------------------------------------------------------------------ submit

    def submit(self, route: Route, op: XferOp, code: int, n: int, local: Any, remote: Any, llen: Any, rlen: Any,
               flags: int, notify: bytes | None, timeout_s: float | None,
               then: tuple[Any, ...] | None = None) -> Transfer | int:
        """The one submit path: ``rk_submit`` on ``route`` (see csrc/shim.h for
        the arguments; ``then``: a chained read's record first, then what it
        needs kept alive), then ``track``. Returns the negative RK_SUBMIT_* code
        of a request the route could not post (stale route, failed peer, a
        bad pair: nothing was posted). ``code`` is ``op``'s OP_* (an enum's
        hash is a Python call: the caller knows it). The prepared path makes
        the same two calls itself, one Python frame fewer (prepared.py)."""
        if notify is not None and type(notify) is not bytes:
            notify = bytes(notify)
        slot = self.rk_submit(route.c, code, n, local, remote, llen, rlen,
                              flags if notify is None else flags | NOTIFY, notify or self._null,
                              0 if notify is None else len(notify),
                              0 if timeout_s is None else max(1, int(timeout_s * 1e9)),
                              self._null if then is None else then[0], self.out)
        return self.track(slot, route, op, n, notify, then)

    def track(self, slot: int, route: Route, op: XferOp, n: int, notify: bytes | None,
              then: Any = None) -> Transfer | int:
        """The ``Transfer`` of what ``rk_submit`` just posted in ``slot`` (its
        record is in ``out``), or the negative code of a refusal; raises when
        the table is full or the notification too long. ``then``: what a
        chained read's C record needs kept alive (prepared.py)."""
        if slot < 0:
            if slot == SUBMIT_FULL or slot == SUBMIT_NOTIF_SIZE:
                self._refuse(slot, notify)
            return int(slot)
        out = self.out
        rec = self._unpack(out, 9)
        xfer = Transfer(self._owner, slot, op, route.peer, n, rec, notify)
        if then is not None:
            xfer._then = then
        if rec[3] > 1:
            xfer.worker_ops = tuple(self._unpack(out + 9, rec[3]))
        self._table[slot] = xfer
        if rec[8]:  # something on the completion ring (done in place, or a pump's): settle it now
            self.drain()  # its callbacks wait for the poster to release the lock (take_due)
        return xfer

    @property
    def bad_pair(self) -> int:
        """After SUBMIT_BAD_PAIR: the position of the first pair that failed."""
        return int(self.out[0])

    def _refuse(self, code: int, notify: bytes | None) -> None:
        cfg = self.config
        if code == SUBMIT_NOTIF_SIZE:
            raise ConfigError(f"notification of {len(notify or b'')} bytes exceeds "
                              f"notif_max_bytes={cfg.notif_max_bytes}")
        # UCX may still write the zombies' records: they count too.
        raise TransferError(f"{cfg.max_inflight} transfers already in flight on {self.name!r} "
                            "(AgentConfig.max_inflight); wait for some to complete")

    # ------------------------------------------------------------------ settle

    @property
    def live(self) -> int:
        """Transfers in flight (a transfer striped over lanes counts once)."""
        return int(self.ctx.live)

    def drain(self) -> int:
        """Settle the slots the shim published; returns how many.

        ``rk_drain`` has freed them in C (no longer live, back on the free
        stack): every one leaves the table before any is settled, so that
        nothing can fail (``abandon``) a slot already freed, even if settling
        raised part-way (before, the rest of the batch stayed in the table,
        was abandoned a second time, and the counters wrapped)."""
        n = self._rk_drain(self.ctx, self._drained, len(self._table))
        if n:
            now = time.perf_counter()
            table = self._table
            pairs = self._unpack(self._drained, 2 * n)
            drained = []
            for i in range(0, 2 * n, 2):
                v = pairs[i]
                slot = v & _SLOT_MASK
                xfer = table[slot]
                if xfer is None:  # abandoned earlier; UCX is done with it now
                    self._zombies.pop(slot, None)
                    continue
                table[slot] = None
                if xfer._then is not None:  # (the slot is reused only by a submit: under this lock)
                    xfer.chained = bool(self._slots[slot].then_sent)
                drained.append((xfer, v >> 32, pairs[i + 1] * 1e-9))
            for xfer, status, finished in drained:
                try:
                    self._settle(xfer, None if status == 0 else self._error_for(xfer, status - (1 << 32)), now,
                                 finished)
                except Exception as exc:  # a bug: the transfer still ends, failed, and says why
                    log.exception("settling %s transfer %d failed", xfer.op.value, xfer.id)
                    if xfer.state is XferState.IN_PROGRESS:
                        self._settle(xfer, TransferError(f"{xfer.op.value} transfer {xfer.id} with {xfer.peer!r}: "
                                                         f"settling its completion failed: {exc!r}"), now)
        return int(n)

    def _settle(self, xfer: Transfer, error: TransferError | None, now: float, finished: float | None = None) -> None:
        if error is not None:
            self._failed += 1
        callbacks = xfer._settle(error, now if finished is None else finished, now)
        if callbacks:
            self._callbacks.extend((cb, xfer) for cb in callbacks)

    def abandon(self, xfer: Transfer, error: TransferError) -> None:
        """Settle ``xfer`` before UCX completed it: its slot becomes a zombie."""
        self._lib.rk_abandon(self.ctx, xfer._slot)
        xfer.abandoned = True
        self._table[xfer._slot] = None
        self._zombies[xfer._slot] = (xfer._notify, xfer._peer, xfer._then)
        if xfer._then is not None:
            xfer.chained = bool(self._slots[xfer._slot].then_sent)
        self._settle(xfer, error, time.perf_counter())

    def expire(self, fail_peer: FailPeer) -> None:
        """Fail every transfer past its deadline (the shim finds them)."""
        n = self._lib.rk_expired(self.ctx, time.monotonic_ns(), self._expired, _EXPIRED_MAX)
        for slot in self._unpack(self._expired, n) if n else ():
            xfer = self._table[slot]
            if xfer is None:
                continue
            xfer._expired = True
            peer = xfer._peer
            try:
                waiting = stall.describe(self.ctx.slots[slot], peer.paths.pumps if peer.paths else None,
                                         time.monotonic_ns())
            except Exception as exc:  # a diagnostic never stands in the way of failing the peer
                waiting = f"(not readable: {exc!r})"
            log.warning("%s transfer %d with peer %r passed its deadline: %s", xfer.op.value, xfer.id, xfer.peer,
                        waiting)
            if peer.ep is not None:
                # Cancels every operation to the peer; completions are drained
                # inside and this transfer settles with a timeout error.
                fail_peer(peer, f"did not complete transfer {xfer.id} within its deadline; "
                                "the peer is considered dead and its endpoint was closed")
            if self._table[slot] is xfer:  # UCX did not cancel it: settle it anyway
                self.abandon(xfer, self._timeout_error(xfer))

    def fail_all(self, why: str) -> None:
        """Settle every transfer still in flight as failed (closing)."""
        for xfer in [x for x in self._table if x is not None]:
            self.abandon(xfer, TransferError(f"{xfer.op.value} transfer {xfer.id} with {xfer.peer!r} "
                                             f"aborted: {why}"))

    def next_deadline(self) -> float | None:
        """The earliest deadline in flight (``time.monotonic()`` seconds), or None."""
        ctx = self.ctx
        return ctx.next_deadline_ns * 1e-9 if ctx.live else None

    # ------------------------------------------------------------------ errors

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
        peer = xfer._peer
        why = peer.failure
        if why is None and peer.ep_state.failed:
            why = f"endpoint error {status_name(peer.ep_state.status)}"
        detail = f"; peer {xfer.peer!r} {why}" if why else ""
        advice = "if the peer restarted, re-import its metadata with add_peer()"
        if status == self._lib.UCS_ERR_INVALID_PARAM and not why:
            detail = ("; an index or descriptor array the call was given changed while the call read it "
                      "(another thread wrote it), or UCX refused an operation's parameters")
            advice = "pass arrays that nobody writes until the call returns"
        return TransferError(
            f"{xfer.op.value} transfer {xfer.id} with peer {xfer.peer!r} failed: {name}{detail} "
            f"({xfer.num_descs} descriptors, {xfer.nbytes} bytes); {advice}",
            status=name,
        )

    def _timeout_error(self, xfer: Transfer) -> TransferTimeoutError:
        return TransferTimeoutError(
            f"{xfer.op.value} transfer {xfer.id} with peer {xfer.peer!r} did not complete within "
            f"its deadline ({xfer.num_descs} descriptors, {xfer.nbytes} bytes); the peer's "
            "endpoint was closed: re-import its metadata with add_peer() once it is back",
            # Same convention as every other TransferError.status: UCX's own
            # ucs_status_string() text ("Operation timed out"), not an enum name.
            status=status_name(self._lib.UCS_ERR_TIMED_OUT))

    # --------------------------------------------------------------- callbacks

    def add_done_callback(self, xfer: Transfer, fn: Callback) -> bool:
        """Queue ``fn`` for ``xfer``'s settlement; False if it has settled."""
        if xfer.finished is not None:
            return False
        if xfer._callbacks is None:
            xfer._callbacks = [fn]
        else:
            xfer._callbacks.append(fn)
        return True

    def take_callbacks(self) -> Callbacks:
        callbacks, self._callbacks = self._callbacks, []
        return callbacks

    def take_due(self) -> Callbacks | None:
        """``take_callbacks``, None when there are none (the post paths ask on
        every request). Lock held; run them once it is released: a callback
        that takes a lock of the caller's, waits for a thread that needs
        this agent, or closes the agent would otherwise do so under the
        agent's lock (a close from a callback stalled 5 s, then left the
        agent wedged)."""
        return self.take_callbacks() if self._callbacks else None

    @staticmethod
    def run_callbacks(callbacks: Iterable[tuple[Callback, Transfer]]) -> None:
        """Run callbacks taken under the lock; call with no lock held."""
        for cb, xfer in callbacks:
            try:
                cb(xfer)
            except Exception:  # a caller's callback must not kill progress
                log.exception("transfer completion callback %r raised", cb)

    # ------------------------------------------------------------------- stats

    def stats(self) -> AgentStats:
        ctx = self.ctx
        return AgentStats(transfers=int(ctx.transfers), ops_posted=int(ctx.ops_posted), descs=int(ctx.descs),
                          bytes=int(ctx.bytes), failed=self._failed)

    @property
    def zombies(self) -> int:
        """Slots settled without UCX's completion, still held for UCX."""
        return len(self._zombies)

