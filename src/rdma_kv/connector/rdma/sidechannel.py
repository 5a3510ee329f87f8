"""The side channel: a small TCP server per worker, and its client.

Owns the sockets. The server binds only the configured interface
(``kv_ip:kv_port + tp_rank``), accepts a bounded number of connections, and
serves each in a thread: read a size-limited frame, decode it against the
schema (``wire``), dispatch to a :class:`Handler` (the worker: handshake
and leases), reply. A malformed frame gets an ``ErrorReply`` and the
connection is closed; the server keeps serving everyone else. Every socket
operation has a timeout.

The client keeps one connection per peer, re-opened on failure, with
bounded retries and backoff; every call has a deadline. Lease RPCs are
idempotent (a retried CONFIRM of a lease its first attempt released still
reads HELD; see ``leases``), so retrying is safe.

Imports the standard library, ``rdma_kv.errors`` and ``rdma.wire``.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Protocol

import msgspec

from rdma_kv.connector.rdma import wire
from rdma_kv.errors import ConfigError, HandshakeError, MetadataError, PeerError

__all__ = ["Handler", "SideChannelClient", "SideChannelServer"]

logger = logging.getLogger(__name__)


class Handler(Protocol):
    """What the server dispatches to (the worker implements it)."""

    def on_handshake(self, request: wire.Handshake) -> wire.HandshakeReply | wire.Refused: ...

    def on_renew(self, request: wire.Renew) -> wire.LeaseReply: ...

    def on_confirm(self, request: wire.Confirm) -> wire.LeaseReply: ...

    def on_release(self, request: wire.Release) -> wire.LeaseReply: ...


class SideChannelServer:
    """Serves ``handler`` on ``host:port`` (port 0: the OS picks; see ``port``)."""

    def __init__(
        self,
        handler: Handler,
        host: str,
        port: int,
        *,
        io_timeout_s: float = 5.0,
        idle_timeout_s: float = 300.0,
        max_connections: int = 256,
        name: str = "rdma-kv-sidechannel",
    ) -> None:
        self._handler = handler
        self._io_timeout_s = io_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._max_connections = max_connections
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
            raise ConfigError(
                f"side channel cannot bind {host}:{port}: {exc}; choose another kv_port "
                "(each tensor-parallel rank uses kv_port + rank) or kv_ip"
            ) from None
        self._sock.listen(128)
        self._sock.settimeout(0.2)  # the accept loop checks for close() this often
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self.stats = {"connections": 0, "refused_connections": 0, "bad_frames": 0, "requests": 0}
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
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
            with self._lock:
                if len(self._conns) >= self._max_connections:
                    self.stats["refused_connections"] += 1
                    conn.close()
                    logger.warning("side channel %s: refused %s, %d connections open",
                                   self._name, addr, len(self._conns))
                    continue
                self._conns.add(conn)
                self.stats["connections"] += 1
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                             name=f"{self._name}-conn").start()

    def _serve(self, conn: socket.socket, addr: object) -> None:
        try:
            while not self._closed.is_set():
                try:
                    body = wire.recv_frame(conn, wire.MAX_REQUEST_BYTES, self._idle_timeout_s,
                                           f"side channel request from {addr}")
                except (OSError, PeerError, TimeoutError):
                    return
                except MetadataError as exc:
                    self._bad(conn, addr, str(exc))
                    return
                if body is None:
                    return
                try:
                    request = wire.request_decoder.decode(body)
                except msgspec.DecodeError as exc:
                    self._bad(conn, addr, f"malformed request: {exc}")
                    return
                reply = self._dispatch(request)
                self.stats["requests"] += 1
                wire.send_frame(conn, wire.encode(reply), self._io_timeout_s)
        except OSError:
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _bad(self, conn: socket.socket, addr: object, message: str) -> None:
        self.stats["bad_frames"] += 1
        logger.warning("side channel %s: closing %s: %s", self._name, addr, message)
        try:
            wire.send_frame(conn, wire.encode(wire.ErrorReply(message[:8000])), self._io_timeout_s)
        except OSError:
            pass

    def _dispatch(self, request: wire.Request) -> wire.Reply:
        if request.version != wire.PROTOCOL_VERSION:
            return wire.Refused(
                f"side-channel protocol version {request.version} is not supported; this "
                f"producer speaks version {wire.PROTOCOL_VERSION}: upgrade rdma-kv on one side"
            )
        try:
            if isinstance(request, wire.Handshake):
                return self._handler.on_handshake(request)
            if isinstance(request, wire.Renew):
                return self._handler.on_renew(request)
            if isinstance(request, wire.Confirm):
                return self._handler.on_confirm(request)
            return self._handler.on_release(request)
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
    ) -> None:
        self.host, self.port = host, port
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
        self.down_s = 1.0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=self._connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

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
                    raise PeerError(f"side channel {self.address} is down: {self._down_reason}")
                try:
                    if self._sock is None:
                        self._sock = self._connect()
                    wire.send_frame(self._sock, payload, timeout)
                    body = wire.recv_frame(self._sock, wire.MAX_REPLY_BYTES, timeout,
                                           f"reply from {self.address}")
                    if body is None:
                        raise PeerError(f"{self.address} closed the side channel")
                    reply = wire.reply_decoder.decode(body)
                except (OSError, TimeoutError, PeerError) as exc:
                    last = exc
                    self._drop()
                    if attempt < self._retries:
                        time.sleep(self._backoff_s * (2**attempt))
                    continue
                except msgspec.DecodeError as exc:
                    self._drop()
                    raise MetadataError(f"malformed reply from {self.address}: {exc}") from None
                if isinstance(reply, wire.ErrorReply):
                    self._drop()
                    raise MetadataError(f"{self.address} rejected {type(request).__name__}: {reply.message}")
                return reply
            self._down_until = time.monotonic() + self.down_s
            self._down_reason = f"unreachable after {self._retries + 1} attempts: {last}"
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
