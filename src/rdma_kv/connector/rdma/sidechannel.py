"""The side channel: a small TCP server per worker, and its client.

Owns the sockets. The server binds only the configured interface
(``kv_ip:kv_port + tp_rank``), admits connections within per-source and
total limits (``admission``), and serves each in a thread: read a
size-limited frame, decode it against the schema (``wire``), dispatch to a
:class:`Handler` (the worker: handshake and leases), reply. A malformed
frame gets an ``ErrorReply`` and the connection is closed; the server keeps
serving everyone else. Every socket operation has a timeout.

Every connection opens with HELLO -> CHALLENGE. With a shared secret
(``auth``), AUTH -> AUTH_OK must follow before any other request is
served: a peer that fails gets ``Refused``, the connection closes, and the
server logs a WARNING naming the peer address and the reason (never the
secret or a proof). Nothing else (agent metadata, remote keys, lease
answers) is sent on a connection that has not completed this opening.

A connection is untrusted until it authenticates (with a secret) or a lease
request of it is answered HELD or PENDING (without one); an untrusted
connection is closed at its opening deadline, a few seconds after its
accept, whatever it sends. Floods therefore hold slots only briefly, only
within their source's budget, and never the slots kept for trusted peers.
Refusals are logged a few lines per window plus one summary line
(``lograte.EventSummary``), never one line per connection.

The client keeps one connection per peer, re-opened on failure, with
bounded retries and backoff; every call has a deadline. Lease RPCs are
idempotent (a retried CONFIRM of a lease its first attempt released still
reads HELD; see ``leases``), so retrying is safe.

Imports the standard library, ``rdma_kv.errors``, ``rdma.admission``, ``rdma.auth``,
``rdma.lograte`` and ``rdma.wire``.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
import threading
import time
from typing import Protocol

import msgspec

from rdma_kv.connector.rdma import auth, wire
from rdma_kv.connector.rdma.admission import Admission, ConnectionLimits
from rdma_kv.connector.rdma.lograte import EventSummary
from rdma_kv.errors import AuthenticationError, ConfigError, HandshakeError, MetadataError, PeerError

__all__ = ["ConnectionLimits", "Handler", "SideChannelClient", "SideChannelServer", "bind_advice"]

logger = logging.getLogger(__name__)


class Handler(Protocol):
    """What the server dispatches to (the worker implements it)."""

    def on_handshake(self, request: wire.Handshake) -> wire.HandshakeReply | wire.Refused: ...

    def on_renew(self, request: wire.Renew) -> wire.LeaseReply: ...

    def on_confirm(self, request: wire.Confirm) -> wire.LeaseReply: ...

    def on_release(self, request: wire.Release) -> wire.LeaseReply: ...


class _Connection:
    """One accepted connection's standing: untrusted until it authenticates
    (secret) or proves it holds a lease (no secret); until then it must get
    there before ``deadline``."""

    __slots__ = ("source", "deadline", "trusted", "requests", "expired")

    def __init__(self, source: str, deadline: float) -> None:
        self.source, self.deadline = source, deadline
        self.trusted, self.requests, self.expired = False, 0, False


# A lease reply with one of these proves the connection knows a live lease.
_LIVE_STATUSES = frozenset((wire.LeaseStatus.HELD, wire.LeaseStatus.PENDING))


def _abort(conn: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0): a refused or expired flood
    connection leaves no TIME_WAIT entry behind on this host."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    conn.close()


def bind_advice(exc: OSError, host: str, port: int) -> str | None:
    """What to change when the side channel cannot bind ``host:port`` (None:
    no specific advice). ``rdma-kv info --config`` gives the same words."""
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"side_channel_host {host} is not an address of this host; set "
                "kv_connector_extra_config['side_channel_host'] to one of its interfaces")
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is in use; choose another kv_port or side_channel_port "
                "(tensor-parallel rank r listens on port + r)")
    return None


class SideChannelServer:
    """Serves ``handler`` on ``host:port`` (port 0: the OS picks; see ``port``).

    Admission (``limits``, see :class:`ConnectionLimits` for the defaults)
    happens in the accept loop; a refused connection is reset without a
    thread or a byte. An untrusted connection is closed ``opening_deadline_s``
    after its accept; a trusted one after ``idle_timeout_s`` without a
    request. ``backlog`` is the listen queue (the kernel caps it at
    ``net.core.somaxconn``): deep enough that a legitimate SYN is not
    dropped while the accept loop drains a flood. Refusals and closures are
    logged through :class:`EventSummary`: ``log_burst`` lines per reason per
    ``log_window_s``, then one summary line; ``stats`` counts every one.
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
        backlog: int = 1024,
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
        self._sock.settimeout(0.2)  # the accept loop checks for close() this often
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self.stats = {"connections": 0, "refused_connections": 0, "bad_frames": 0, "requests": 0,
                      "authenticated": 0, "auth_failures": 0, "trusted": 0, "closed_at_deadline": 0,
                      **{f"refused_{reason}": 0 for reason in Admission.REASONS}}
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def _count(self, *keys: str) -> None:
        with self._lock:
            for key in keys:
                self.stats[key] += 1

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            self._events.flush()
            try:
                conn, addr = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                if self._closed.is_set():
                    return
                logger.exception("side channel %s: accept failed", self._name)
                time.sleep(0.05)
                continue
            source = str(addr[0])
            refusal = self._admission.admit(source)
            if refusal is not None:
                reason, why = refusal
                self._count("refused_connections", f"refused_{reason}")
                _abort(conn)
                self._events.event(reason, source, "side channel %s: refused %s: %s", self._name, addr, why)
                continue
            with self._lock:
                self._conns.add(conn)
                self.stats["connections"] += 1
            state = _Connection(source, time.monotonic() + self.limits.opening_deadline_s)
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=self._serve, args=(conn, addr, state), daemon=True,
                                 name=f"{self._name}-conn").start()
            except (OSError, RuntimeError) as exc:  # reset by the peer already, or no thread to be had
                self._admission.leave(source, trusted=False)
                with self._lock:
                    self._conns.discard(conn)
                _abort(conn)
                logger.debug("side channel %s: dropped %s at accept: %s", self._name, addr, exc)

    def _serve(self, conn: socket.socket, addr: object, state: _Connection) -> None:
        try:
            if not self._open(conn, addr, state):
                return
            while not self._closed.is_set():
                request = self._read(conn, addr, state)
                if request is None:
                    return
                if isinstance(request, (wire.Hello, wire.Auth)):
                    self._refuse(conn, addr, state, f"unexpected {type(request).__name__.upper()} "
                                                    "after the opening")
                    return
                reply = self._dispatch(request)
                self._count("requests")
                state.requests += 1
                if (not state.trusted and isinstance(reply, wire.LeaseReply)
                        and any(status in _LIVE_STATUSES for status in reply.statuses)):
                    self._trust(state)
                wire.send_frame(conn, wire.encode(reply), self._io_timeout_s)
        except OSError:
            return
        finally:
            self._admission.leave(state.source, state.trusted)
            with self._lock:
                self._conns.discard(conn)
            if state.expired:
                _abort(conn)
            else:
                conn.close()

    def _trust(self, state: _Connection) -> None:
        state.trusted = True
        self._admission.trust(state.source)
        self._count("trusted")

    def _read(self, conn: socket.socket, addr: object, state: _Connection) -> wire.Request | None:
        """One request; ``None`` when the connection is to be closed (bad
        frames are answered and logged here). An untrusted connection reads
        against its opening deadline, a trusted one against the idle timeout."""
        timeout_s = self._idle_timeout_s if state.trusted else state.deadline - time.monotonic()
        try:
            if timeout_s <= 0:
                raise TimeoutError("opening deadline passed")
            body = wire.recv_frame(conn, wire.MAX_REQUEST_BYTES, timeout_s,
                                   f"side channel request from {addr}")
        except TimeoutError:
            if not state.trusted:
                self._expire(addr, state)
            return None
        except (OSError, PeerError):
            return None
        except MetadataError as exc:
            self._bad(conn, addr, state, str(exc))
            return None
        if body is None:
            return None
        try:
            return wire.decode_request(body)
        except MetadataError as exc:
            self._bad(conn, addr, state, str(exc))
            return None

    def _expire(self, addr: object, state: _Connection) -> None:
        state.expired = True
        self._count("closed_at_deadline")
        if state.requests:  # a consumer that handshook and has no lease yet: it reconnects when it needs to
            logger.debug("side channel %s: closed %s: not trusted %.1f s after connecting",
                         self._name, addr, self.limits.opening_deadline_s)
            return
        what = "authenticated" if self._secret is not None else "holding a lease"
        self._events.event("opening_deadline", state.source,
                           "side channel %s: closed %s: not %s %.1f s after connecting (opening_deadline_s)",
                           self._name, addr, what, self.limits.opening_deadline_s)

    def _open(self, conn: socket.socket, addr: object, state: _Connection) -> bool:
        """HELLO -> CHALLENGE, then AUTH -> AUTH_OK when a secret is set.
        True when the connection may carry requests. Bounded by the opening
        deadline, not the idle timeout: an unauthenticated peer cannot hold
        a connection slot for long."""
        hello = self._read(conn, addr, state)
        if hello is None:
            if self._secret is not None and not state.expired:
                self._auth_failed(addr, state, "closed before HELLO")
            return False
        if hello.version != wire.PROTOCOL_VERSION:
            self._refuse(conn, addr, state, self._version_refusal(hello.version))
            return False
        if not isinstance(hello, wire.Hello):
            self._refuse(conn, addr, state, f"a connection must open with HELLO (side-channel protocol "
                                            f"{wire.PROTOCOL_VERSION}), got {type(hello).__name__.upper()}")
            return False
        nonce = auth.new_nonce()
        wire.send_frame(conn, wire.encode(wire.Challenge(wire.PROTOCOL_VERSION, nonce,
                                                         self._secret is not None)),
                        self._io_timeout_s)
        if self._secret is None:
            return True
        answer = self._read(conn, addr, state)
        if answer is None:
            if not state.expired:
                self._auth_failed(addr, state, "closed instead of answering the challenge")
            return False
        if not isinstance(answer, wire.Auth):
            reason = f"sent {type(answer).__name__.upper()} instead of AUTH"
        elif answer.version != wire.PROTOCOL_VERSION:
            reason = (f"sent AUTH for side-channel protocol version {answer.version}; this producer "
                      f"expects version {wire.PROTOCOL_VERSION}: run the same rdma-kv release on both sides")
        elif not answer.proof:
            reason = "peer has no shared secret configured"
        elif not auth.verify(auth.client_proof(self._secret, nonce, hello.nonce, wire.PROTOCOL_VERSION,
                                               hello.role), answer.proof):
            reason = "wrong proof (the peer's secret differs)"
        else:
            self._count("authenticated")
            self._trust(state)
            proof = auth.server_proof(self._secret, hello.nonce, nonce, wire.PROTOCOL_VERSION, hello.role)
            wire.send_frame(conn, wire.encode(wire.AuthOk(proof)), self._io_timeout_s)
            return True
        self._auth_failed(addr, state, reason)
        self._send_quietly(conn, wire.Refused(f"authentication failed: {reason}"))
        return False

    def _auth_failed(self, addr: object, state: _Connection, reason: str) -> None:
        self._count("auth_failures")
        self._events.event("auth_failed", state.source, "side channel %s: refused %s: authentication failed: %s",
                           self._name, addr, reason)

    def _refuse(self, conn: socket.socket, addr: object, state: _Connection, reason: str) -> None:
        self._count("refused_connections")
        self._events.event("protocol", state.source, "side channel %s: refused %s: %s", self._name, addr, reason)
        self._send_quietly(conn, wire.Refused(reason[:8000]))

    def _send_quietly(self, conn: socket.socket, message: msgspec.Struct) -> None:
        try:
            wire.send_frame(conn, wire.encode(message), self._io_timeout_s)
        except OSError:
            pass

    @staticmethod
    def _version_refusal(version: int) -> str:
        return (f"side-channel protocol version {version} is not supported; this producer speaks "
                f"version {wire.PROTOCOL_VERSION}: run the same rdma-kv release on both sides")

    def _bad(self, conn: socket.socket, addr: object, state: _Connection, message: str) -> None:
        self._count("bad_frames")
        self._events.event("bad_frame", state.source, "side channel %s: closing %s: %s", self._name, addr, message)
        self._send_quietly(conn, wire.ErrorReply(message[:8000]))

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
            return wire.ErrorReply(f"unexpected {type(request).__name__} after the opening")
        except Exception as exc:  # a handler bug must not kill the server
            logger.exception("side channel %s: handler failed", self._name)
            return wire.ErrorReply(f"producer failed to handle {type(request).__name__}: {exc}"[:8000])

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._sock.close()
        self._thread.join(timeout=2.0)
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> SideChannelServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SideChannelClient:
    """One peer's side channel: request/reply with deadlines and bounded retries."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float = 2.0,
        rpc_timeout_s: float = 2.0,
        retries: int = 2,
        backoff_s: float = 0.05,
        secret: auth.Secret | None = None,
        role: str = "consumer",
    ) -> None:
        self.host, self.port = host, port
        self._secret = secret
        self._role = role
        self._connect_timeout_s = connect_timeout_s
        self._rpc_timeout_s = rpc_timeout_s
        self._retries = retries
        self._backoff_s = backoff_s
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False
        # After a failed call, fail fast for a moment: a dead peer must not
        # tie up every RPC thread in connect timeouts.
        self._down_until = 0.0
        self._down_reason = ""
        self._down_error: type[PeerError] = PeerError  # a refusal stays an AuthenticationError
        self.down_s = 1.0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self, timeout_s: float) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=self._connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._open(sock, timeout_s)
        except BaseException:
            sock.close()
            raise
        return sock

    def _exchange(self, sock: socket.socket, message: msgspec.Struct, timeout_s: float) -> wire.Reply:
        wire.send_frame(sock, wire.encode(message), timeout_s)
        body = wire.recv_frame(sock, wire.MAX_REPLY_BYTES, timeout_s, f"reply from {self.address}")
        if body is None:
            raise PeerError(f"{self.address} closed the side channel")
        return wire.decode_reply(body)

    def _open(self, sock: socket.socket, timeout_s: float) -> None:
        """HELLO -> CHALLENGE (-> AUTH -> AUTH_OK). Raises ``HandshakeError``
        (not retried) when the peer speaks another version, and
        ``AuthenticationError`` when the two sides' secrets disagree."""
        nonce = auth.new_nonce()
        reply = self._exchange(sock, wire.Hello(wire.PROTOCOL_VERSION, self._role, nonce), timeout_s)
        if isinstance(reply, wire.Refused):
            raise HandshakeError(f"producer at {self.address} refused the connection: {reply.reason}")
        if isinstance(reply, wire.ErrorReply):  # a version-1 producer does not know HELLO
            raise HandshakeError(
                f"producer at {self.address} does not speak side-channel protocol "
                f"{wire.PROTOCOL_VERSION} ({reply.message}); run the same rdma-kv release on both sides")
        if not isinstance(reply, wire.Challenge) or reply.version != wire.PROTOCOL_VERSION:
            raise HandshakeError(f"{self.address} answered HELLO with {reply!r:.200}")
        if not reply.auth_required:
            if self._secret is not None:
                raise AuthenticationError(
                    f"producer at {self.address} does not authenticate, but this consumer has a "
                    f"shared secret ({self._secret.source}); configure the same auth_secret_file / "
                    "auth_secret_env on the producer (refusing to trust an unauthenticated peer)")
            return
        if self._secret is None:
            self._send_quietly(sock, wire.Auth(wire.PROTOCOL_VERSION, b""), timeout_s)  # its log says why
            raise AuthenticationError(
                f"producer at {self.address} requires a shared secret and this consumer has none; "
                "set kv_connector_extra_config auth_secret_file or auth_secret_env")
        proof = auth.client_proof(self._secret, reply.nonce, nonce, wire.PROTOCOL_VERSION, self._role)
        answer = self._exchange(sock, wire.Auth(wire.PROTOCOL_VERSION, proof), timeout_s)
        if isinstance(answer, wire.Refused):
            raise AuthenticationError(f"producer at {self.address} refused this consumer: {answer.reason}")
        expected = auth.server_proof(self._secret, nonce, reply.nonce, wire.PROTOCOL_VERSION, self._role)
        if not isinstance(answer, wire.AuthOk) or not auth.verify(expected, answer.proof):
            raise AuthenticationError(
                f"producer at {self.address} failed to prove it knows the shared secret (its secret "
                "differs, or it is not the producer it claims to be)")

    @staticmethod
    def _send_quietly(sock: socket.socket, message: msgspec.Struct, timeout_s: float) -> None:
        try:
            wire.send_frame(sock, wire.encode(message), timeout_s)
        except OSError:
            pass

    def call(self, request: wire.Request, timeout_s: float | None = None) -> wire.Reply:
        """Send ``request``, return the decoded reply. Transport failures are
        retried ``retries`` times; then :class:`PeerError`. An ``ErrorReply``
        raises :class:`MetadataError`; ``Refused`` is returned (the caller
        names what was refused)."""
        timeout = self._rpc_timeout_s if timeout_s is None else timeout_s
        payload = wire.encode(request)
        last: Exception | None = None
        with self._lock:
            for attempt in range(self._retries + 1):
                if self._closed:
                    raise PeerError(f"side channel client for {self.address} is closed")
                if time.monotonic() < self._down_until:
                    raise self._down_error(f"side channel {self.address} is down: {self._down_reason}")
                try:
                    if self._sock is None:
                        self._sock = self._connect(timeout)
                    wire.send_frame(self._sock, payload, timeout)
                    body = wire.recv_frame(self._sock, wire.MAX_REPLY_BYTES, timeout,
                                           f"reply from {self.address}")
                    if body is None:
                        raise PeerError(f"{self.address} closed the side channel")
                    reply = wire.decode_reply(body)
                except HandshakeError as exc:  # refused at the opening: retrying cannot help
                    self._drop()
                    self._down_until = time.monotonic() + self.down_s
                    self._down_reason, self._down_error = str(exc), type(exc)
                    raise
                except (OSError, TimeoutError, PeerError) as exc:
                    last = exc
                    self._drop()
                    if attempt < self._retries:
                        time.sleep(self._backoff_s * (2**attempt))
                    continue
                except MetadataError as exc:
                    self._drop()
                    raise MetadataError(f"malformed reply from {self.address}: {exc}") from None
                if isinstance(reply, wire.ErrorReply):
                    self._drop()
                    raise MetadataError(f"{self.address} rejected {type(request).__name__}: {reply.message}")
                return reply
            self._down_until = time.monotonic() + self.down_s
            self._down_reason = f"unreachable after {self._retries + 1} attempts: {last}"
            self._down_error = PeerError
        raise PeerError(f"side channel {self.address} {self._down_reason}")

    def handshake(self, request: wire.Handshake) -> wire.HandshakeReply:
        reply = self.call(request, timeout_s=max(self._rpc_timeout_s, 5.0))
        if isinstance(reply, wire.Refused):
            raise HandshakeError(f"producer at {self.address} refused the handshake: {reply.reason}")
        if not isinstance(reply, wire.HandshakeReply):
            raise HandshakeError(f"{self.address} answered a handshake with {type(reply).__name__}")
        return reply

    def lease_call(self, request: wire.Renew | wire.Confirm | wire.Release) -> wire.LeaseReply:
        reply = self.call(request)
        if isinstance(reply, wire.Refused):
            raise HandshakeError(f"producer at {self.address} refused {type(request).__name__}: {reply.reason}")
        if not isinstance(reply, wire.LeaseReply) or len(reply.statuses) != len(request.leases):
            raise MetadataError(
                f"{self.address} answered {type(request).__name__} of {len(request.leases)} leases "
                f"with {reply!r:.200}"
            )
        return reply

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop()
