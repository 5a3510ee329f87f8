"""The side channel's server: one event-driven TCP server per worker.

Owns the listening socket and every accepted connection. One thread runs a
``selectors`` loop (epoll on Linux) over non-blocking sockets: it accepts,
admits or evicts (``admission``), reads size-limited frames into a
per-connection buffer (every trusted connection each turn, at most
``UNTRUSTED_READS_PER_TURN`` untrusted ones, least recently read first), decodes them against the schema (``wire``),
dispatches to a :class:`Handler` (the worker: handshake and leases) and
writes the reply. A connection costs a file descriptor and a small record,
not a thread, so one producer rank serves thousands of consumer ranks; the
engine thread never waits on any of it (the handler's lease table has its
own short lock). The server binds only the configured interface
(``kv_ip:kv_port + tp_rank``).

Every connection opens with HELLO -> CHALLENGE. With a shared secret
(``auth``), AUTH -> AUTH_OK must follow before any other request is
served: a peer that fails gets ``Refused``, the connection closes, and the
server logs a WARNING naming the peer address and the reason (never the
secret or a proof). Nothing else (agent metadata, remote keys, lease
answers) is sent on a connection that has not completed this opening.

Trust (``admission``): with a secret, from AUTH on; without one, only while
the connection has proven it holds a live lease (a lease call answered
HELD, checked against the lease table again every ``TRUST_CHECK_S``),
never from PENDING. Every wait is bounded, per connection:

- untrusted: closed at its opening deadline, a few seconds after its
  accept or after it lost its trust, whatever it sends, unless a HANDSHAKE
  of it was answered: that ends the opening (a consumer connects ahead of
  its first load, which may wait for admission), and the connection is then
  closed once idle ``handshake_idle_s`` (logged at DEBUG: it reconnects at its
  next call). It stays untrusted, within the untrusted budgets;
- a frame once started must arrive whole within ``io_timeout_s``, and a
  reply must drain within it (slowloris, before or after AUTH);
- trusted: closed after ``idle_timeout_s`` without a request, and evicted
  for a newcomer once idle ``evict_idle_s`` when a budget is full.

A malformed frame gets an ``ErrorReply`` and the connection is closed; the
server keeps serving everyone else. Refusals, evictions, closures and
altered lease params (FORGED) are logged a few lines per window plus one
summary line (``lograte.EventSummary``), never one line per connection.

Imports the standard library, msgspec, ``rdma_kv.errors``, ``rdma.admission``,
``rdma.auth``, ``rdma.lograte``,
``rdma.sideconn`` (a connection's record, its frames and deadline, the server's counters),
``rdma.sidehandler`` (the :class:`Handler` Protocols, re-exported here, and
what a lease answer means: FORGED/UNKNOWN accounting, trust earned by a held
lease), ``rdma.sidetrust`` (trust earned by a lease), ``rdma.stats`` and
``rdma.wire``.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import selectors
import socket
import threading
import time
from typing import Any

import msgspec

from rdma_kv.connector.rdma import auth, wire
from rdma_kv.connector.rdma.admission import Admission, ConnectionLimits
from rdma_kv.connector.rdma.lograte import EventSummary
from rdma_kv.connector.rdma.sideconn import (EVICTED, REFUSED, Accepted, FrameTooLarge, Phase, SideChannelCounters,
                                             abort, bind_advice)
from rdma_kv.connector.rdma.sidehandler import Handler, LeaseReplies, PushHandler
from rdma_kv.connector.rdma.sidetrust import LeaseTrust
from rdma_kv.connector.rdma.stats import Tally
from rdma_kv.errors import ConfigError, MetadataError

__all__ = ["ConnectionLimits", "Handler", "PushHandler", "SideChannelCounters", "SideChannelServer", "bind_advice"]

logger = logging.getLogger(__name__)

TRUST_CHECK_S = 1.0
"""How often connections trusted by a lease (no secret) are checked against
the lease table: trust ends within this long of the lease."""
ACCEPTS_PER_TURN = 64
"""Connections accepted per loop turn before the loop serves the open ones
again: a connect flood cannot starve consumers already connected."""
ACCEPT_PAUSE_S = 0.1
"""How long accepting pauses when accept() finds no file descriptor (EMFILE,
ENFILE) or no memory: the connection stays in the listen queue and the
listener readable, so accepting again at once would spin the loop (and hold
the GIL against the engine thread) until a descriptor frees."""
RECV_BYTES = 65536
UNTRUSTED_READS_PER_TURN = 4
"""Untrusted connections read per loop turn (every trusted one is), least
recently read first: 64 untrusted ones flooding 4,096-lease calls made a
trusted call wait behind 64 reads (4 MiB) and the calls they completed."""


class SideChannelServer:
    """Serves ``handler`` on ``host:port`` (port 0: the OS picks; see ``port``).

    ``limits`` (:class:`ConnectionLimits`) are applied at accept, before a
    byte is read; ``backlog`` is the listen queue (the kernel caps it at
    ``net.core.somaxconn``): deep enough that a legitimate SYN is not
    dropped while the loop drains a flood. Refusals, evictions and closures
    are logged through :class:`EventSummary` (``log_burst`` lines per reason
    per ``log_window_s``, then one summary line); ``stats`` counts each.
    """

    def __init__(
        self,
        handler: Handler,
        host: str,
        port: int,
        *,
        io_timeout_s: float = 5.0,
        idle_timeout_s: float = 300.0,
        limits: ConnectionLimits | None = None,
        backlog: int = 4096,
        log_burst: int = 3,
        log_window_s: float = 10.0,
        name: str = "rdma-kv-sidechannel",
        secret: auth.Secret | None = None,
        role: str = "producer",
    ) -> None:
        self._handler = handler
        self._secret = secret
        self._role = role
        self._io_timeout_s = io_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self.limits = limits if limits is not None else ConnectionLimits()
        self._admission = Admission(self.limits)
        self._events = EventSummary(logger, f"side channel {name}", "connections refused or closed",
                                    burst=log_burst, window_s=log_window_s)
        self._name = name
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise ConfigError(f"side channel host {host!r} cannot be resolved: {exc}") from None
        family, _, _, _, address = infos[0]
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind(address)
        except OSError as exc:
            self._sock.close()
            advice = bind_advice(exc, host, port) or "check side_channel_host and kv_port / side_channel_port"
            raise ConfigError(f"side channel cannot bind {host}:{port}: {exc.strerror}: {advice}") from None
        self._sock.listen(backlog)
        self._sock.setblocking(False)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._sock, selectors.EVENT_READ, None)
        self._accept_resume: float | None = None  # while accepting is paused: when it resumes
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        self._conns: dict[int, Accepted] = {}
        self._deadlines: list[tuple[float, int, Accepted]] = []
        self._seq = itertools.count()
        self._lease_trust: LeaseTrust[Accepted] = LeaseTrust(handler.live)
        self._next_trust_check = 0.0
        self._turn = 0  # loop turns that read untrusted connections (``Accepted.read_turn``)
        self._closed = threading.Event()
        self._counts = Tally(SideChannelCounters)  # counted on the loop thread only
        self._lease_replies = LeaseReplies(name, self._counts, self._events,
                                           self._lease_trust if secret is None else None)
        self._thread = threading.Thread(target=self._loop, name=f"{name}-loop", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> SideChannelCounters:
        """What the server did with its connections so far."""
        return self._counts.snapshot()

    # --- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closed.is_set():
            now = time.monotonic()
            timeout = min(0.5, max(0.0, self._deadlines[0][0] - now)) if self._deadlines else 0.5
            if self._accept_resume is not None:
                timeout = min(timeout, max(0.0, self._accept_resume - now))
            try:
                events = self._selector.select(timeout)
            except OSError:  # closed under us
                if self._closed.is_set():
                    break
                raise
            untrusted: list[Accepted] = []
            for key, mask in events:
                if key.data is None:
                    self._accept_some()
                elif key.data is self._wake_r:
                    continue
                else:
                    conn = key.data
                    if mask & selectors.EVENT_WRITE and not conn.closed:
                        self._flush(conn)
                        if not conn.closed and not conn.outbuf:
                            self._serve(conn)  # what arrived while the reply was written
                    if mask & selectors.EVENT_READ and not conn.closed:
                        if conn.trusted:
                            self._on_readable(conn)
                        else:
                            untrusted.append(conn)
            self._read_untrusted(untrusted)
            now = time.monotonic()
            if self._accept_resume is not None and now >= self._accept_resume:
                self._accept_resume = None
                self._selector.register(self._sock, selectors.EVENT_READ, None)
            self._expire(now)
            if now >= self._next_trust_check:
                self._check_lease_trust(now)
                self._next_trust_check = now + TRUST_CHECK_S
            self._events.flush()
        for conn in list(self._conns.values()):
            self._close(conn)
        self._selector.close()

    def _read_untrusted(self, readable: list[Accepted]) -> None:
        """Read ``UNTRUSTED_READS_PER_TURN`` of the untrusted connections
        found readable, those read least recently first; the others stay
        readable for the next turn."""
        self._turn += 1
        if len(readable) > UNTRUSTED_READS_PER_TURN:
            readable.sort(key=lambda conn: conn.read_turn)
            del readable[UNTRUSTED_READS_PER_TURN:]
        for conn in readable:
            if not conn.closed:  # (evicted for a connection accepted this turn)
                conn.read_turn = self._turn
                self._on_readable(conn)

    def _accept_some(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._events.event("no_fd", "-", "side channel %s: cannot accept: %s (raise the "
                                       "file-descriptor limit, ulimit -n); accepting again in %.1f s",
                                       self._name, exc.strerror, ACCEPT_PAUSE_S)
                    self._pause_accepting()
                    return
                if self._closed.is_set():
                    return
                logger.exception("side channel %s: accept failed", self._name)
                return
            self._admit(sock, addr)

    def _pause_accepting(self) -> None:
        """Stop watching the listener for ``ACCEPT_PAUSE_S`` (the loop watches
        it again after): the connection accept() could not take stays
        queued, and the listener readable."""
        if self._accept_resume is None:
            self._selector.unregister(self._sock)
            self._accept_resume = time.monotonic() + ACCEPT_PAUSE_S
            self._counts.add("accept_paused")

    def _admit(self, sock: socket.socket, addr: tuple[Any, ...]) -> None:
        now = time.monotonic()
        source = str(addr[0])
        victims, refusal = self._admission.plan(source, now)
        if refusal is not None:
            reason, why = refusal
            self._counts.add("refused_connections")
            self._counts.add(REFUSED[reason])
            abort(sock)
            self._events.event(reason, source, "side channel %s: refused %s: %s", self._name, addr, why)
            return
        for victim, why in victims:
            assert isinstance(victim, Accepted)
            self._counts.add(EVICTED[why])
            self._events.event(f"evicted_{why}", victim.source,
                               "side channel %s: evicted %s (%s, idle %.1f s) for a new connection from %s: "
                               "the %s budget was full", self._name, victim.addr,
                               "trusted" if victim.trusted else "untrusted", now - victim.last_active,
                               source, why.replace("_", " "))
            self._close(victim, reset=True)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # reset by the peer already
            abort(sock)
            return
        conn = Accepted(sock, addr, now, self.limits.opening_deadline_s)
        self._admission.enter(conn)
        self._conns[conn.fd] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn)
        self._counts.add("connections")
        self._reschedule(conn)

    # --- reading and dispatch -------------------------------------------------------------------

    def _on_readable(self, conn: Accepted) -> None:
        try:
            chunk = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not chunk:
            if conn.phase != Phase.READY and self._secret is not None and conn.requests == 0:
                self._auth_failed(conn, "closed before HELLO" if conn.phase == Phase.HELLO
                                  else "closed instead of answering the challenge")
            self._close(conn)
            return
        conn.inbuf += chunk
        self._serve(conn)

    def _serve(self, conn: Accepted) -> None:
        """Serve every whole request buffered, one reply at a time."""
        now = time.monotonic()
        while not conn.closed and not conn.closing and not conn.outbuf:
            try:
                body = conn.take_frame()
            except FrameTooLarge as exc:
                self._bad(conn, str(exc))
                break
            if body is None:
                break
            if conn.frame_started is not None:
                conn.frame_started = None
                self._admission.unstall(conn)
            self._on_frame(conn, body, now)
        if not conn.closed:
            if conn.inbuf and conn.frame_started is None:
                conn.frame_started = now  # a partial frame: it must arrive whole in time
                self._admission.stall(conn)
            self._reschedule(conn)

    def _on_frame(self, conn: Accepted, body: bytes, now: float) -> None:
        try:
            request = wire.decode_request(body)
        except MetadataError as exc:
            self._bad(conn, str(exc))
            return
        if conn.phase == Phase.HELLO:
            self._on_hello(conn, request)
        elif conn.phase == Phase.AUTH:
            self._on_auth(conn, request)
        elif isinstance(request, (wire.Hello, wire.Auth)):
            self._refuse(conn, f"unexpected {type(request).__name__.upper()} after the opening")
        else:
            self._on_request(conn, request, now)

    def _on_hello(self, conn: Accepted, hello: wire.Request) -> None:
        if hello.version != wire.PROTOCOL_VERSION:
            self._refuse(conn, self._version_refusal(hello.version))
            return
        if not isinstance(hello, wire.Hello):
            self._refuse(conn, f"a connection must open with HELLO (side-channel protocol "
                               f"{wire.PROTOCOL_VERSION}), got {type(hello).__name__.upper()}")
            return
        conn.nonce, conn.hello = auth.new_nonce(), hello
        self._send(conn, wire.Challenge(wire.PROTOCOL_VERSION, conn.nonce, self._secret is not None))
        conn.phase = Phase.AUTH if self._secret is not None else Phase.READY

    def _on_auth(self, conn: Accepted, answer: wire.Request) -> None:
        assert self._secret is not None and conn.hello is not None
        hello = conn.hello
        if not isinstance(answer, wire.Auth):
            reason = f"sent {type(answer).__name__.upper()} instead of AUTH"
        elif answer.version != wire.PROTOCOL_VERSION:
            reason = (f"sent AUTH for side-channel protocol version {answer.version}; this producer "
                      f"expects version {wire.PROTOCOL_VERSION}: run the same rdma-kv release on both sides")
        elif not answer.proof:
            reason = "peer has no shared secret configured"
        elif not auth.verify(auth.client_proof(self._secret, conn.nonce, hello.nonce, wire.PROTOCOL_VERSION,
                                               hello.role), answer.proof):
            reason = "wrong proof (the peer's secret differs)"
        else:
            self._counts.add("authenticated")
            self._trust(conn)
            conn.phase = Phase.READY
            proof = auth.server_proof(self._secret, hello.nonce, conn.nonce, wire.PROTOCOL_VERSION, hello.role)
            self._send(conn, wire.AuthOk(proof))
            return
        self._auth_failed(conn, reason)
        self._send(conn, wire.Refused(f"authentication failed: {reason}"), then_close=True)

    def _on_request(self, conn: Accepted, request: wire.Request, now: float) -> None:
        reply = self._dispatch(request)
        self._counts.add("requests")
        conn.requests += 1
        conn.last_active = now
        if conn.trusted:
            self._admission.touch(conn)
        if isinstance(reply, wire.LeaseReply) and isinstance(request, (wire.Renew, wire.Confirm, wire.Release)):
            if self._lease_replies.earns_trust(conn, request, reply):
                self._trust(conn)
        elif isinstance(reply, wire.HandshakeReply):
            conn.handshaken = True  # the opening is done: idle-bounded from now on (_reschedule)
        self._send(conn, reply)

    def _dispatch(self, request: wire.Request) -> wire.Reply:
        if request.version != wire.PROTOCOL_VERSION:
            return wire.Refused(self._version_refusal(request.version))
        try:
            if isinstance(request, wire.Handshake):
                return self._handler.on_handshake(request)
            if isinstance(request, wire.Renew):
                return self._handler.on_renew(request)
            if isinstance(request, wire.Confirm):
                return self._handler.on_confirm(request)
            if isinstance(request, wire.Release):
                return self._handler.on_release(request)
            if isinstance(request, (wire.PushHello, wire.Push, wire.PushReg, wire.PushQuery)):
                # Push mode's requests (PushHandler); a handler without them refuses.
                name = {wire.PushHello: "on_push_hello", wire.Push: "on_push", wire.PushReg: "on_push_reg",
                        wire.PushQuery: "on_push_query"}[type(request)]
                answer = getattr(self._handler, name, None)
                if answer is None:
                    return wire.Refused("this side channel does not take push requests")
                reply: wire.Reply = answer(request)
                return reply
            return wire.ErrorReply(f"unexpected {type(request).__name__} after the opening")
        except Exception as exc:  # a handler bug must not kill the server
            logger.exception("side channel %s: handler failed", self._name)
            return wire.ErrorReply(f"producer failed to handle {type(request).__name__}: {exc}"[:8000])

    # --- trust -----------------------------------------------------------------------------------

    def _trust(self, conn: Accepted) -> None:
        self._admission.trust(conn)
        self._counts.add("trusted")
        self._reschedule(conn)

    def _check_lease_trust(self, now: float) -> None:
        """A connection trusted by a lease is untrusted again once no lease it
        proved lives (of the last ``sidetrust.MAX_PROOFS``); it then has a new opening deadline to prove another (one
        that handshook: its idle bound, ``handshake_idle_s``)."""
        for conn in self._lease_trust.lapsed():
            self._admission.untrust(conn)
            self._counts.add("untrusted_again")
            conn.opening_deadline = now + self.limits.opening_deadline_s
            self._reschedule(conn)

    # --- writing ------------------------------------------------------------------------------------

    def _send(self, conn: Accepted, message: msgspec.Struct, then_close: bool = False) -> None:
        conn.queue(wire.encode(message), then_close)
        self._flush(conn)

    def _flush(self, conn: Accepted) -> None:
        try:
            while conn.outbuf:
                sent = conn.sock.send(conn.outbuf)
                del conn.outbuf[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(conn)
            return
        if not conn.outbuf:
            conn.write_started = None
            if conn.closing:
                self._close(conn)
                return
        elif conn.write_started is None:
            conn.write_started = time.monotonic()
        # Read only when nothing waits to be written: a peer that does not
        # read its replies cannot make this server buffer without bound.
        mask = selectors.EVENT_WRITE if conn.outbuf else selectors.EVENT_READ
        if not conn.closed and mask != conn.mask:
            conn.mask = mask
            self._selector.modify(conn.sock, mask, conn)
        if not conn.closed:
            self._reschedule(conn)

    # --- deadlines -----------------------------------------------------------------------------------

    def _reschedule(self, conn: Accepted) -> None:
        due = conn.deadline(self._idle_timeout_s, self.limits.handshake_idle_s, self._io_timeout_s)
        if due != conn.due:
            conn.due = due
            heapq.heappush(self._deadlines, (due, next(self._seq), conn))

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            due, _, conn = heapq.heappop(self._deadlines)
            if conn.closed or due != conn.due:
                continue  # closed, or its deadline moved
            if conn.write_started is not None and now >= conn.write_started + self._io_timeout_s:
                self._count_close(conn, "closed_slow", "a reply was not read within io_timeout_s")
            elif conn.frame_started is not None and now >= conn.frame_started + self._io_timeout_s:
                self._count_close(conn, "closed_slow", "a request frame did not arrive whole within io_timeout_s")
            elif conn.trusted:
                self._count_close(conn, "closed_idle", None)
            elif conn.handshaken:
                # A consumer that handshook ahead of a load that never came
                # (or whose lease ended): routine, it reconnects when it must.
                logger.debug("side channel %s: closed %s: handshook, then idle %.0f s without a request and "
                            "holding no lease (handshake_idle_s); a consumer reconnects at its next call",
                            self._name, conn.addr, self.limits.handshake_idle_s)
                self._count_close(conn, "closed_idle", None)
            else:
                self._count_close(conn, "closed_at_deadline", None)
        if len(self._deadlines) > 4 * len(self._conns) + 64:  # entries of moved deadlines
            self._deadlines = [(c.due, next(self._seq), c) for c in self._conns.values()]
            heapq.heapify(self._deadlines)

    def _count_close(self, conn: Accepted, what: str, why: str | None) -> None:
        self._counts.add(what)
        if what == "closed_at_deadline":
            if conn.requests == 0:  # opened and asked nothing: what an idle flood looks like
                how = "authenticated" if self._secret is not None else "holding a lease"
                self._events.event("opening_deadline", conn.source, "side channel %s: closed %s: not %s "
                                   "%.1f s after connecting (opening_deadline_s)", self._name, conn.addr,
                                   how, self.limits.opening_deadline_s)
        elif why is not None:
            self._events.event(what, conn.source, "side channel %s: closed %s: %s", self._name, conn.addr, why)
        self._close(conn, reset=not conn.trusted)

    # --- endings -------------------------------------------------------------------------------------

    def _close(self, conn: Accepted, reset: bool = False) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._admission.leave(conn)
        self._lease_trust.forget(conn)
        self._conns.pop(conn.fd, None)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        if reset:
            abort(conn.sock)
        else:
            conn.sock.close()

    def _auth_failed(self, conn: Accepted, reason: str) -> None:
        self._counts.add("auth_failures")
        self._events.event("auth_failed", conn.source, "side channel %s: refused %s: authentication failed: %s",
                           self._name, conn.addr, reason)

    def _refuse(self, conn: Accepted, reason: str) -> None:
        self._counts.add("refused_connections")
        self._events.event("protocol", conn.source, "side channel %s: refused %s: %s", self._name, conn.addr,
                           reason)
        self._send(conn, wire.Refused(reason[:8000]), then_close=True)

    def _bad(self, conn: Accepted, message: str) -> None:
        self._counts.add("bad_frames")
        self._events.event("bad_frame", conn.source, "side channel %s: closing %s: %s", self._name, conn.addr,
                           message)
        conn.inbuf.clear()
        self._send(conn, wire.ErrorReply(message[:8000]), then_close=True)

    @staticmethod
    def _version_refusal(version: int) -> str:
        return (f"side-channel protocol version {version} is not supported; this producer speaks "
                f"version {wire.PROTOCOL_VERSION}: run the same rdma-kv release on both sides")

    # --- introspection and shutdown --------------------------------------------------------------------

    def counts(self) -> tuple[int, int]:
        """(open, untrusted) connections now."""
        return self._admission.counts()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout=5.0)
        self._sock.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> SideChannelServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
