"""Push mode, the decode's side: registering an allocation, and knowing when no write can land.

Owns :class:`Pushes` and :class:`PushHandle`. In push mode a load's source
is not read: its blocks (the decode's, allocated to this request by its
scheduler) are registered with the producer rank (PUSH, on an RPC thread),
which writes them and notifies the allocation's random ``token`` once every
write is remotely complete. The handle stands where a read's transfer
stands in pull (``loads``): ``done()``, ``error`` and done-callbacks, so the
load state machine is the same one.

**When a handle resolves** -- the decode may act on its blocks (use them,
or hand them back to its engine) only then:

- success: the producer's notification for the token (the transport sent
  it after flushing every endpoint that carried a write: the data landed),
  or its answer DONE to a query;
- failure, nothing can land: the producer answered REFUSED or PENDING
  past the load's deadline (nothing was posted), ABORTED (every write it
  posted completed; it posts none again), FAILED or UNKNOWN to a query
  after it had answered the PUSH (forgotten long after it resolved) --
  these two with the producer *fenced* first (its endpoints force-closed:
  a failed batch may have been abandoned by the producer's transport, its
  bytes still queued there or in the kernel, and a graceful close is no
  fence against them, ``Agent.remove_peer``) --, or UNKNOWN to an abort of a PUSH
  it never answered: the producer remembers that abort, so an attempt of
  the PUSH still on its way (one the client gave up on, answered too late)
  is refused when it arrives;
- not yet: a PUSH that got no answer is queried; UNKNOWN (not taken yet,
  a producer slow to answer) sends it again, under the same token, so an
  earlier attempt arriving too is answered, not taken twice;
- failure, the producer is gone: its side channel refuses connections
  (no process listens: none posts; what its kernel still sends is
  fenced off) -- the producer is fenced first;
- failure, unreachable: no answer at all, until ``lease_max_s`` plus the
  write timeout after the PUSH was sent (the lease ended by then on the
  producer's own clock, and it posts no write for an ended lease; a write
  posted before had its timeout, and one its transport abandoned is fenced
  off: the producer is fenced first). The blocks stay out of the engine
  until then; the bound is documented (docs/rdma-connector.md, "Push mode").

A load that fails or is aborted while its push runs asks the producer to
abort (PUSH_QUERY with ``abort``) and waits for one of the above.

Runs on the engine thread (``start``, ``poll``), the RPC threads (PUSH,
PUSH_QUERY) and never blocks the engine. Imports numpy, the standard
library, the connector's ``rdma`` modules ``wire``, ``settings``, ``slots``,
``topology``, ``meta``, ``stats``, and the consumer's ``clients``, ``peers``
and ``records``; never the producer's modules (``pusher``).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rdma_kv.connector.rdma import wire
from rdma_kv.connector.rdma.consumer.clients import ClientPool
from rdma_kv.connector.rdma.consumer.peers import LocalKV, PeerState
from rdma_kv.connector.rdma.meta import LoadSpec, RemoteLease
from rdma_kv.connector.rdma.settings import RdmaSettings, is_loopback
from rdma_kv.connector.rdma.slots import HeadSlice, SlotTable
from rdma_kv.connector.rdma.stats import PushCounters, Tally
from rdma_kv.connector.rdma.topology import RankPlan, Read
from rdma_kv.connector.types import GroupBlockIds
from rdma_kv.errors import PeerError

__all__ = ["PushHandle", "Pushes"]

logger = logging.getLogger(__name__)

QUERY_AFTER_S = 1.0
"""A push with no notification this long after its PUSH was answered is
queried (and again every ``QUERY_EVERY_S``): a lost or late notification,
or a producer that failed, is found within about a second."""
QUERY_EVERY_S = 0.5
"""A push is asked about at most this often; and at most one such query per
producer rank is queued or in flight at a time (``Pushes.poll``): the
calls to one rank go one at a time, in order (``clients``), so a query per
push due queued every PUSH and PUSH_REG behind all of them."""
PENDING_RETRY_S = 0.05
"""A PUSH answered PENDING (the lease's grant had not reached the
producer's worker) is sent again after this long."""


class PushFailed(Exception):
    """Why a push resolved without the data."""


@dataclasses.dataclass(eq=False)
class PushHandle:
    """One source's push: a ``TransferHandle`` for the load state machine."""

    token: bytes
    peer: PeerState
    request: wire.Push | wire.PushReg
    nbytes: int
    num_descs: int
    sent_at: float
    hard_deadline: float
    """Past this, with no answer, no write can land (module docstring)."""
    ops_posted: int = 0
    post_s: float = 0.0
    chained: bool | None = None  # (a push chains no read)
    abandoned = False  # (a push resolves once none of its writes can land)
    answered: bool = False
    """The producer answered the PUSH (it knows the token, or refused it)."""
    aborting: bool = False
    next_query_at: float = 0.0
    busy: bool = False  # an RPC for it is on an RPC thread
    probing: bool = False  # that RPC is its rank's one query (``Pushes.poll``)
    resend: bool = False  # answered PENDING (or unknown to a query): the next due time sends the PUSH again
    send_error: str = ""  # why the last call before an answer failed
    life: bytes = b""  # the life of the producer's transport this push was sent to (wire.PushReply.life)
    error: BaseException | None = None
    _done: bool = False
    _finished_at: float | None = None
    _callbacks: list[Callable[[Any], None]] = dataclasses.field(default_factory=list)
    _resolved: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def started(self) -> float:
        return self.sent_at

    @property
    def elapsed_s(self) -> float:
        return (self._finished_at or time.perf_counter()) - self.sent_at

    def done(self) -> bool:
        return self._done

    def wait(self, timeout_s: float | None = None) -> PushHandle:
        if not self._resolved.wait(timeout_s):
            raise TimeoutError(f"push {self.token.hex()} not resolved after {timeout_s} s")
        if self.error is not None:
            raise self.error
        return self

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        if self._done:
            fn(self)
        else:
            self._callbacks.append(fn)


class Pushes:
    """The pushes of one decode rank."""

    def __init__(self, local: LocalKV, engine_id: str, registration: int, incarnation: bytes, settings: RdmaSettings,
                 pool: ClientPool, peer_failed: Callable[[PeerState, str], None],
                 local_table: Callable[[HeadSlice | None], tuple[SlotTable, Any]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._local = local
        self._engine_id = engine_id
        self._registration = registration
        self._incarnation = incarnation
        """This worker's, drawn when it started (``wire.Incarnation``): the producer
        tells it apart from another decode given the same engine id."""
        self._settings = settings
        self._pool = pool
        self._peer_failed = peer_failed
        self._clock = clock
        self._lock = threading.Lock()
        self._running: dict[bytes, PushHandle] = {}
        self._probing: set[tuple[str, int]] = set()
        """Producer ranks with a query queued or in flight (one at a time each: ``poll``)."""
        self._counts = Tally(PushCounters)  # counted under self._lock
        self._local_table = local_table
        """This rank's slot table per head slice (``PeerDirectory.local_table``: one cache for reads and pushes)."""

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts.add(name, n)

    # --- starting (engine thread) ------------------------------------------------------------------

    def start(self, peer: PeerState, plan: RankPlan, read: Read, lease: RemoteLease,
              local_block_ids: GroupBlockIds, remote_block_ids: GroupBlockIds) -> PushHandle:
        """Register this source's blocks with its producer rank (on an RPC thread)."""
        local_heads, remote_heads = _heads(plan, read)
        request = wire.Push(wire.PROTOCOL_VERSION, lease.to_wire(), secrets.token_bytes(wire.PUSH_TOKEN_BYTES),
                            self._engine_id, self._settings.tp_rank, self._incarnation, self._registration,
                            [list(g) for g in local_block_ids], [list(g) for g in remote_block_ids],
                            local_heads, remote_heads, _link(peer))
        return self._begin(peer, request, local_block_ids)

    def register(self, peer: PeerState, plan: RankPlan, read: Read, readers: int, spec: LoadSpec) -> PushHandle:
        """Concurrent dispatch: register this source's blocks with its
        producer rank under the router's transfer id (on an RPC thread)."""
        assert spec.transfer_id is not None
        local_heads, remote_heads = _heads(plan, read)
        request = wire.PushReg(wire.PROTOCOL_VERSION, spec.transfer_id, secrets.token_bytes(wire.PUSH_TOKEN_BYTES),
                               self._engine_id, self._settings.tp_rank, self._incarnation, self._registration,
                               spec.first_token, spec.num_tokens, [list(g) for g in spec.local_block_ids],
                               self._settings.tp_rank, readers, local_heads, remote_heads, spec.prompt_digest,
                               _link(peer))
        return self._begin(peer, request, spec.local_block_ids)

    def _begin(self, peer: PeerState, request: wire.Push | wire.PushReg,
               local_block_ids: GroupBlockIds) -> PushHandle:
        """Track ``request``'s push and send it (an RPC thread)."""
        h = request.local_heads
        table, _ = self._local_table(None if h is None else HeadSlice(h.first, h.count, h.of))
        counts = np.array([len(g) for g in local_block_ids], dtype=np.int64)
        nbytes = int((counts * table.group_nbytes[:len(counts)]).sum())  # a group's id covers its layers only
        ndescs = int(counts[table.row_group].sum()) if len(counts) == table.num_groups else 0
        now = self._clock()
        handle = PushHandle(request.token, peer, request, nbytes, ndescs, time.perf_counter(),
                            hard_deadline=now + self._settings.lease_max_s + self._settings.read_timeout_s,
                            life=peer.connection.life if peer.connection is not None else b"")
        with self._lock:
            self._running[request.token] = handle
            handle.busy = True
        if not self._pool.submit(self._send, handle, to=self._address(handle)):
            self._resolve(handle, PushFailed("the worker is closing"))
        return handle

    # --- RPC threads -------------------------------------------------------------------------------

    @staticmethod
    def _address(handle: PushHandle) -> tuple[str, int]:
        return handle.peer.address.rank_address(handle.peer.rank)

    def _client(self, handle: PushHandle) -> Any:
        return self._pool.get(*self._address(handle))

    def introduce(self, peer: PeerState, link: str, life: bytes) -> None:
        """The handshake's step in push mode (its RPC thread, once the
        transport peer ``link`` is made): introduce this decode to the
        producer rank on it, so that no link stays without an introduction
        (the two sides' counts of endpoints to each other stay equal, which
        the fence needs: ``_hello``). ``life``: the handshake reply's (the
        producer's transport that ``link`` was made to). Raises what
        refused it."""
        self._hello(link, self._pool.get(*peer.address.rank_address(peer.rank)), life)

    def _hello(self, link: str, client: Any, life: bytes) -> None:
        """Introduce this decode's KV cache to the producer rank on ``link``:
        the transport peer this decode made for it at the handshake (each
        handshake makes a new one, and introduces it once: ``introduce``).
        The producer imports the decode afresh for a new link, its endpoint
        made the same number as ours for the link among each side's to the
        other (``ordinal``), so that UCX pairs the two: our fence (a forced
        close of ours) stops its writes only through that pairing (versions.py:
        13 and 14)."""
        if not (client.authenticated or self._settings.allow_unauthenticated or is_loopback(client.host)):
            # A PUSH_HELLO carries this worker's address and the remote keys of its whole KV
            # cache, writable; without a secret the producer is whoever answers at an address
            # the request's kv_transfer_params named, and any client of the decode server names it.
            raise PushFailed(
                f"not introducing this decode's KV cache to producer {client.address}: this decode has no "
                "shared secret, so it cannot check that the peer there is a producer of this deployment, and "
                "would hand whoever answers the remote keys to write its whole KV cache (any client of this "
                "server can name that address in kv_transfer_params). Set kv_connector_extra_config "
                "auth_secret_file or auth_secret_env on the decodes and producers, or, on a network you "
                "trust, allow_unauthenticated: true (docs/security.md). This load is computed here instead")
        local = self._local
        reply = client.call(wire.PushHello(wire.PROTOCOL_VERSION, self._engine_id, local.rank, self._incarnation,
                                           self._registration, local.transport.metadata(),
                                           wire.GeometryWire.from_geometry(local.geometry), link,
                                           local.transport.ordinal(link), life))
        if not isinstance(reply, wire.PushReply) or reply.state is not wire.PushState.DONE:
            detail = reply.detail if isinstance(reply, wire.PushReply) else getattr(reply, "reason", repr(reply))
            raise PushFailed(f"producer {client.address} refused this decode's KV cache: {detail}")
        if life and reply.life != life:
            # The producer slept and woke between the handshake and this answer: its new
            # worker imported this decode numbering our endpoint to its *old* worker, so
            # its writes would cross a connection none of ours pairs with, out of our
            # fence's reach. The handshake fails (and fences the link); the next dials
            # the new worker.
            raise PushFailed(f"producer {client.address}'s transport restarted between the handshake and "
                             "this decode's introduction (it slept and woke): dialled again")

    def _send(self, handle: PushHandle) -> None:
        """PUSH ``handle`` (its producer rank's RPC thread)."""
        try:
            client = self._client(handle)  # (introduced on this link at its handshake)
            reply = client.call(handle.request, timeout_s=self._settings.rpc_timeout_s)
            if isinstance(reply, wire.PushReply) and reply.state is wire.PushState.REFUSED \
                    and "PUSH_HELLO" in reply.detail:
                # The producer forgot this decode (it made room for others, or forgot it after a
                # push it failed). Introducing ourselves again on this link would give it a new
                # endpoint that none of ours pairs with, and our fence would no longer reach its
                # writes: fence this link instead, and the next load dials it afresh (this one is
                # refused, nothing was written: recomputed).
                self._peer_failed(handle.peer, f"it forgot this decode's KV cache: {reply.detail}")
        except PushFailed as exc:
            self._after(handle, None, exc)
            return
        except Exception as exc:
            self._after(handle, None, exc)
            return
        self._after(handle, reply, None)

    def _query(self, handle: PushHandle) -> None:
        """PUSH_QUERY (with ``abort`` once the load no longer wants the data)."""
        try:
            reply = self._client(handle).call(wire.PushQuery(wire.PROTOCOL_VERSION, handle.token, handle.aborting),
                                              timeout_s=self._settings.rpc_timeout_s)
        except Exception as exc:
            self._after(handle, None, exc)
            return
        self._after(handle, reply, None)

    def _after(self, handle: PushHandle, reply: Any, exc: BaseException | None) -> None:
        """An answer (or none) to a PUSH or PUSH_QUERY: resolve, or look again later."""
        now = self._clock()
        with self._lock:
            handle.busy = False
            self._end_probe(handle)
            if handle.done():
                return
        S = wire.PushState
        if exc is not None:
            if not handle.answered:
                handle.send_error = f"{type(exc).__name__}: {exc}"
            if _refused_connection(exc):
                # No process listens on the producer's side channel: nothing of it writes.
                self._peer_failed(handle.peer, str(exc))
                self._count("producer_gone")
                self._resolve(handle, PushFailed(f"producer rank {handle.peer.rank} is gone ({exc}); "
                                                 "no write of it can land"))
                return
            if now >= handle.hard_deadline:
                self._count("unreachable")
                # Past the bound no write *posted within its timeout* lands; one the producer's transport
                # abandoned (a flush outstanding to this decode) may still, when the network heals: fenced.
                self._peer_failed(handle.peer, f"unreachable past a push's bound ({exc})")
                self._resolve(handle, PushFailed(
                    f"producer rank {handle.peer.rank} unreachable since the push ({exc}); past the push's "
                    "bound (lease_max_s + read_timeout_s, or the writes' timeout after a RUNNING answer) no "
                    f"write can land; this decode's progress threads: {self._progress_report()}"))
                return
            with self._lock:
                handle.next_query_at = now + QUERY_EVERY_S
            return
        if not isinstance(reply, wire.PushReply):
            why = getattr(reply, "reason", None) or getattr(reply, "message", None) or repr(reply)
            if not handle.answered and not handle.send_error:  # its only PUSH refused: nothing was taken
                self._resolve(handle, PushFailed(f"the producer refused the push: {why}"))
                return
            if handle.answered and now < handle.hard_deadline:  # a query misunderstood: ask again, within the bound
                with self._lock:
                    handle.next_query_at = now + QUERY_EVERY_S
                return
            # Past the bound, or a PUSH that got no answer may have been taken (its writes
            # posted) by whoever listened then: this says nothing of those writes. Fenced
            # first, as a REFUSED PushReply after no answer is (a review: it resolved
            # unfenced, and after an answer it asked for ever, the blocks held).
            self._peer_failed(handle.peer, f"a push from it was answered {why!r}")
            self._resolve(handle, PushFailed(f"the producer's side channel answered {why!r} to a push it may "
                                             "have taken; its endpoints were closed before the blocks go back"))
            return
        state = reply.state
        if state is S.DONE:
            self._resolve(handle, None)
        elif state in (S.RUNNING, S.WAITING):  # WAITING: registered, its prefill not finished yet
            with self._lock:
                if not handle.answered and state is S.WAITING:
                    self._counts.add("loads_waiting")
                handle.answered = True
                handle.next_query_at = now + (QUERY_EVERY_S if handle.aborting else QUERY_AFTER_S)
                handle.hard_deadline = min(handle.hard_deadline, now + reply.writes_end_within_s + 1.0)
        elif state is S.PENDING and not handle.answered:
            # The grant is one producer step away: PUSH again shortly (poll); aborting, the
            # abort goes instead (an earlier attempt of this PUSH may still be on its way).
            with self._lock:
                handle.resend, handle.next_query_at = True, now + (0.0 if handle.aborting else PENDING_RETRY_S)
        elif state is S.UNKNOWN and not handle.answered and handle.aborting:
            # An abort of a PUSH the producer never took: it remembered the abort, so an
            # attempt of the PUSH still on its way writes nothing.
            why = f"; the PUSH got no answer: {handle.send_error}" if handle.send_error else ""
            if handle.send_error and (not reply.life or reply.life != handle.life):
                # ... in this life of its transport. An attempt that got no answer may have been
                # taken, its writes posted, by the life the push was sent to, which then went to
                # sleep or died (its transport closed; what it queued may still land): fenced first.
                self._peer_failed(handle.peer, f"an aborted push got no answer from the producer's transport "
                                               f"it was sent to (life {handle.life.hex() or '?'}), and the "
                                               f"producer now answers from {reply.life.hex() or 'sleep'}")
            self._resolve(handle, PushFailed(f"aborted before the producer took the push ({reply.detail}){why}"))
        elif state is S.UNKNOWN and not handle.answered:
            # A query after a PUSH that got no answer (a producer slow to answer: its side
            # channel without a CPU for longer than the RPC's attempts): it has not taken it
            # yet. PUSH again; the token makes a second arrival of the first one harmless.
            with self._lock:
                self._counts.add("resent")
                handle.resend, handle.next_query_at = True, now + QUERY_EVERY_S
        else:  # REFUSED, FAILED, ABORTED, UNKNOWN after an answer (forgotten long after it resolved)
            # A PUSH of it that got no answer may have been taken, and its writes posted, by a
            # producer that then forgot it (asleep: its transport closed); whatever ends the push
            # now, except ABORTED (every write completed), says nothing of those writes.
            unseen = state is not S.ABORTED and bool(handle.send_error)
            if state is S.FAILED or state is S.UNKNOWN and handle.answered or unseen:
                # The producer's transport failed a posted batch (its deadline
                # passed: the writes may be abandoned, still queued in UCX or
                # the kernel), or it no longer knows a push it said was under
                # way (it forgot it, or went to sleep and closed its
                # transport). What it still sends would be applied by this
                # decode's worker (TCP) or land in its memory (RDMA) after the
                # blocks went back: fence the producer first (its endpoints
                # force-closed: a graceful close is no fence, Agent.remove_peer).
                what = ("failed" if state is S.FAILED else "was forgotten" if handle.answered
                        else f"got no answer ({handle.send_error}), then {state.value}")
                self._peer_failed(handle.peer, f"a push from it {what}: {reply.detail}")
            self._resolve(handle, PushFailed(f"push {state.value}: {reply.detail}"))

    # --- every step (engine thread) ----------------------------------------------------------------

    def _end_probe(self, handle: PushHandle) -> None:
        """(Under the lock.) ``handle``'s query, if it held its rank's one, is over."""
        if handle.probing:
            handle.probing = False
            self._probing.discard(self._address(handle))

    def poll(self) -> None:
        """Match the producers' notifications; query the pushes due: a PUSH
        to send again and an abort at once, a plain query only while its
        producer rank has none queued or in flight (the one longest due
        first). Calls to a rank go one at a time, in order (``clients``):
        with a query per push due, every new PUSH and PUSH_REG to a rank
        queued behind one query of each of its pushes waiting (WAITING
        registrations, pushes whose notification is late), a round trip
        each -- the more pushes wait, the longer the next one waits to be
        sent. Queries are no fewer: they were sent one at a time anyway."""
        for note in self._local.transport.get_notifications():
            payload = getattr(note, "payload", b"")
            if not payload.startswith(wire.PUSH_NOTIFY_PREFIX):
                continue
            with self._lock:
                handle = self._running.get(payload[len(wire.PUSH_NOTIFY_PREFIX):])
            if handle is None:
                self._count("notifications_unmatched")  # a load that gave up on it: its blocks were kept until then
                continue
            self._resolve(handle, None)
        now = self._clock()
        due = []
        with self._lock:
            waiting = []
            for token, handle in list(self._running.items()):
                if handle.done():  # adopted while a call of the Pushes before a sleep was in flight,
                    del self._running[token]  # which resolved it there: nothing to ask
                    continue
                if not handle.busy and handle.next_query_at and now >= handle.next_query_at:
                    if handle.resend or handle.aborting:
                        handle.busy = True
                        due.append(handle)
                    else:
                        waiting.append(handle)
            waiting.sort(key=lambda h: h.next_query_at)
            for handle in waiting:
                address = self._address(handle)
                if address not in self._probing:
                    self._probing.add(address)
                    handle.busy = handle.probing = True
                    due.append(handle)
        for handle in due:
            resend, handle.resend = handle.resend, False
            # Aborting, a PUSH due again is not sent: the abort asks the producer instead.
            # It answers UNKNOWN and refuses any earlier attempt of that PUSH still on its
            # way (an attempt the client gave up on may yet arrive), or stops what it took.
            if not self._pool.submit(self._send if resend and not handle.aborting else self._query, handle,
                                   to=self._address(handle)):
                with self._lock:
                    handle.busy = False
                    self._end_probe(handle)
                self._resolve(handle, PushFailed("the worker is closing"))

    def abort(self, handle: PushHandle) -> None:
        """The load no longer wants this push: ask the producer to stop, now."""
        with self._lock:
            if handle.done() or handle.aborting:
                return
            handle.aborting = True
            if handle.answered or handle.resend:
                handle.next_query_at = self._clock()  # the next poll asks (or resends, and learns PENDING)

    def _resolve(self, handle: PushHandle, error: BaseException | None) -> None:
        with self._lock:
            if handle._done:
                return
            handle._done, handle.error, handle._finished_at = True, error, time.perf_counter()
            handle._resolved.set()
            self._running.pop(handle.token, None)
            callbacks, handle._callbacks = handle._callbacks, []
            # The load's outcome: once the decode aborted it, however the push
            # resolved (its notification may overtake the producer's ABORTED).
            self._counts.add("loads_aborted" if handle.aborting else "loads_done" if error is None else "loads_failed")
        for fn in callbacks:
            try:
                fn(handle)
            except Exception:
                logger.exception("push completion callback failed")

    def running(self) -> int:
        with self._lock:
            return len(self._running)

    def adopt(self, old: Pushes) -> None:
        """Take over the pushes ``old`` (this rank's before a sleep) left
        unresolved: asked about from the next :meth:`poll` on, within their
        own bounds. The producer's answer resolves each (their notifications
        went to the transport the sleep closed: a query learns DONE, or the
        abort ``suspend`` asked for is sent); a call of ``old``'s still in
        flight may resolve one through ``old``, and :meth:`poll` then drops
        it. Before, nothing polled them
        again: their loads, blocks and requests stayed for ever (found by an
        adversarial review)."""
        with old._lock:
            handles, old._running = old._running, {}
        now = self._clock()
        with self._lock:
            for token, handle in handles.items():
                if not handle.done():
                    handle.next_query_at = handle.next_query_at or now
                    self._running[token] = handle

    def _progress_report(self) -> str:
        try:
            return self._local.transport.progress_report()
        except Exception as exc:  # a diagnostic never stands in the way of a failure
            return f"(not readable: {exc!r})"

    def take_counters(self) -> PushCounters:
        with self._lock:
            return self._counts.take()


def _refused_connection(exc: BaseException) -> bool:
    """The producer's side channel actively refused a connection (nothing
    listens), as opposed to a timeout or a reset mid-call."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ConnectionRefusedError) or getattr(seen, "errno", None) == errno.ECONNREFUSED:
            return True
        seen = seen.__cause__ or seen.__context__
    return isinstance(exc, PeerError) and "refused" in str(exc).lower() and "connect" in str(exc).lower()


def _link(peer: PeerState) -> str:
    """The link a push to ``peer`` goes on (the producer writes it over its
    import for that link only: ``wire.Push.link``)."""
    return peer.connection.name if peer.connection is not None else ""


def _heads(plan: RankPlan, read: Read) -> tuple[wire.HeadsWire | None, wire.HeadsWire | None]:
    """The (decode, producer) head slices of ``read``; None for whole blocks."""
    if plan.whole(read):
        return None, None
    return (wire.HeadsWire(read.local_first, read.count, plan.local_heads),
            wire.HeadsWire(read.remote_first, read.count, plan.remote_heads))
