"""The side channel's client: one producer rank's side channel, as a
consumer calls it.

Owns the socket to one producer rank, re-opened on failure, with bounded
retries and backoff; every call has a deadline. A call retries ``retries``
times and, while its attempts find the way to the peer down ("Network is
unreachable": a link or interface of this host that flaps; "No route to
host"), until ``connect_timeout_s`` has passed: that error comes back in
microseconds, and three attempts with backoff were over in 0.15 s, so a
0.5 s flap of the consumer's own end failed its CONFIRMs. A name lookup
that fails for now (``EAI_AGAIN``: the DNS server out of reach, as it is
during such a flap) is waited out the same way. A refused connect is not:
nobody listens there (the producer died or restarted, and its leases with
it), and a consumer must learn that at once; nor is a name that does not
exist. One attempt takes at most ``connect_timeout_s`` (lookup and
connect) plus the call's timeout (opening, request and reply). The opening (HELLO ->
CHALLENGE, then AUTH -> AUTH_OK with a shared secret) is checked both
ways: a consumer with a secret refuses a producer that cannot prove it
knows the same one. Lease RPCs are idempotent (a retried CONFIRM of a
lease its first attempt released still reads HELD; see ``leases``), so
retrying is safe. After a failed call the client fails fast for
``down_s``: a dead peer must not tie up every RPC thread in connect
timeouts. An attempt that times out (the connect, or the peer's answer:
a producer that accepts and never answers, stopped or starved of CPU, or
an address that drops what is sent to it) marks the client not
``answering``, which the consumer's pool caps (``consumer.clients``); it
is retried as any failure is (a producer starved of CPU a while on a
loaded host answers the next attempt), once only for a peer that never
answered before the call (a port a client named that accepts and never
answers holds a capped place for two attempts, not ``retries`` + 1). A call
whose last attempt timed out raises :class:`PeerTimeout` (so does the fast
failure after it): the peer may be stalled, not gone, and a caller whose
call can be made again later (a CONFIRM) tells the two apart; it says
whether the peer answered this client before (``answered_before``: a
producer known live, which a HANDSHAKE waits out, not an address that never
answered, which fails its loads at once). Any attempt that
fails at the peer (a timeout, a new connection refused or reset; not the
way to it down, nor a kept connection the producer closed) marks the client not ``answering`` until one is answered: the
ranks of a producer engine that just stopped answered before, and their
first calls were not capped. Whoever runs the call may say, on its thread
(:class:`CallGuard`), that a peer that stopped answering is not tried
again, and that a call is not made at all.

One call at a time per connection (request, then its reply). A call that
must not wait behind another (``urgent``: a RENEW, whose lease lapses if it
comes late) takes a second connection, opened on first need, when the
first stays busy ``URGENT_WAIT_S``: a call stuck on a stalled connection can
hold the first for ``rpc_timeout_s`` x (``retries`` + 1) and more, longer
than a lease's margin (``RdmaSettings.renew_interval_for``).

Imports the standard library, msgspec, ``rdma_kv.errors`` and the
connector's ``rdma.auth`` and ``rdma.wire``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from rdma_kv.connector.rdma import auth, framing, wire
from rdma_kv.errors import AuthenticationError, HandshakeError, MetadataError, PeerError, PeerTimeout

__all__ = ["HANDSHAKE_TIMEOUT_S", "URGENT_WAIT_S", "CallGuard", "SideChannelClient", "guarded"]

HANDSHAKE_TIMEOUT_S = 5.0
"""A HANDSHAKE's least timeout per attempt (the producer imports nothing to
answer it, but its reply carries the agent metadata)."""

URGENT_WAIT_S = 0.5
"""How long an urgent call waits for a busy first connection before it takes
the second. A call in flight ends in milliseconds unless it is stuck, so a
RENEW that meets a handshake or a CONFIRM (the scheduler's first renewal and
its pre-connect go out in the same step) does not cost the producer a second
connection."""
BACKOFF_S = 0.05
"""The first pause between a call's attempts; it doubles with each retry, up
to ``MAX_BACKOFF_S``."""
MAX_BACKOFF_S = 0.25
"""The longest pause between two attempts."""
LINK_DOWN = frozenset({errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EHOSTDOWN})
"""Errors that say the way to the peer is down, for now: a call meeting them
keeps trying until ``connect_timeout_s`` (a host whose router answers that
the peer's host is gone takes that long to fail, too)."""
RESOLVER_THREADS = 4
"""Name lookups outstanding at once in a process. A lookup cannot be
cancelled: one the resolver never answers keeps its thread until the
resolver's own timeout, and this many of them make the next lookup fail
(within its bound) instead of starting yet another thread."""

_lookups = threading.BoundedSemaphore(RESOLVER_THREADS)


@dataclasses.dataclass(frozen=True)
class CallGuard:
    """What the calls to ``address`` made on this thread may do (the
    consumer's pool sets one around each job it runs: :func:`guarded`)."""

    address: tuple[str, int]
    refusal: str = ""
    """Not empty: a call fails at once with this reason, touching no socket."""
    stopped_answering: Callable[[], str] | None = None
    """Asked when an attempt of a peer that answered before fails at the
    peer: "" to try it again, otherwise why not."""


_guards = threading.local()


@contextlib.contextmanager
def guarded(guard: CallGuard) -> Iterator[None]:
    """Calls made on this thread to ``guard.address`` follow ``guard`` meanwhile."""
    before = getattr(_guards, "guard", None)
    _guards.guard = guard
    try:
        yield
    finally:
        _guards.guard = before


def _guard(host: str, port: int) -> CallGuard | None:
    guard: CallGuard | None = getattr(_guards, "guard", None)
    return guard if guard is not None and guard.address == (host, port) else None


def _link_down(exc: BaseException) -> bool:
    """Whether a failed attempt says the way to the peer is down for now:
    an error of ``LINK_DOWN``, or a name lookup that failed for now
    (``EAI_AGAIN``, "Temporary failure in name resolution": glibc's answer
    when no DNS server can be reached)."""
    if isinstance(exc, socket.gaierror):
        return exc.errno == socket.EAI_AGAIN
    return isinstance(exc, OSError) and exc.errno in LINK_DOWN


def _failure_kind(exc: BaseException | None) -> type[PeerError]:
    """What a call that failed on ``exc`` raises: :class:`PeerTimeout` for
    a timeout (the peer may be stalled), else :class:`PeerError`."""
    return PeerTimeout if isinstance(exc, TimeoutError) else PeerError


def _pause(backoff_s: float, retry: int) -> float:
    """The pause before retry ``retry`` (0: the first) of a call."""
    return min(backoff_s * (1 << min(retry, 16)), MAX_BACKOFF_S)


def resolve(host: str, port: int, timeout_s: float) -> list[tuple[str, int]]:
    """The addresses of ``host`` to connect to, within ``timeout_s``.

    ``socket.create_connection`` resolves a name with ``getaddrinfo``, which
    takes no timeout: a name that its DNS server does not answer blocked the
    caller for the resolver's timeout (glibc: 5 s x 2 attempts per server),
    past ``connect_timeout_s``, and with it the lease calls this client
    owes (``urgent_worst_case_s`` counts the connect bound). The host comes
    from a request's ``kv_transfer_params``. An address needs no lookup; a
    name is looked up on a thread of its own, waited for at most
    ``timeout_s``. Raises ``PeerError``, or the resolver's ``gaierror``
    (both retried by the caller, like a refused connect)."""
    try:
        ipaddress.ip_address(host)
        return [(host, port)]
    except ValueError:
        pass
    deadline = time.monotonic() + timeout_s
    if not _lookups.acquire(timeout=timeout_s):
        raise PeerError(f"cannot look up {host!r}: {RESOLVER_THREADS} earlier lookups of this process are still "
                        "unanswered (is its DNS server answering?); give the producer's advertise_host as an "
                        "address to need none")
    done = threading.Event()
    answer: list[Any] = []

    def lookup() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            answer.append(exc)
        finally:
            _lookups.release()
            done.set()

    threading.Thread(target=lookup, name="rdma-kv-resolve", daemon=True).start()
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise PeerError(f"{host!r} was not resolved within connect_timeout_s={timeout_s:g} s (is its DNS "
                        "server answering?); give the producer's advertise_host as an address to need no lookup")
    if isinstance(answer[0], OSError):
        raise answer[0]
    if not answer[0]:
        raise PeerError(f"{host!r} resolved to no address")
    return [(str(info[4][0]), port) for info in answer[0]]


class _Connection:
    """One connection of a client, and the lock that keeps it to one call at a time."""

    __slots__ = ("lock", "sock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None

    def drop(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None


class SideChannelClient:
    """One peer's side channel: request/reply with deadlines and bounded
    retries. ``source_address``: the local address to connect from (a
    multi-homed host; the cluster simulator gives each simulated rank its own)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float = 2.0,
        rpc_timeout_s: float = 2.0,
        retries: int = 2,
        backoff_s: float = BACKOFF_S,
        secret: auth.Secret | None = None,
        role: str = "consumer",
        source_address: str | None = None,
    ) -> None:
        self.host, self.port = host, port
        self._source = None if source_address is None else (source_address, 0)
        self._secret = secret
        self._role = role
        self._connect_timeout_s = connect_timeout_s
        self._rpc_timeout_s = rpc_timeout_s
        self._retries = retries
        self._backoff_s = backoff_s
        self._first, self._spare = _Connection(), _Connection()  # the spare: urgent calls while the first is busy
        self._closed = False
        # After a failed call, fail fast for a moment: a dead peer must not
        # tie up every RPC thread in connect timeouts.
        self._down_until = 0.0
        self._down_reason = ""
        self._down_error: type[PeerError] = PeerError  # a refusal stays an AuthenticationError
        self.down_s = 1.0
        self.answering = False
        """The last attempt that ended got a reply (False: none yet, or it
        timed out): ``ClientPool`` caps the calls to peers not answering."""
        self.has_answered = False
        """A call of this client was answered (never cleared): the peer is a
        producer that was live, said by a :class:`PeerTimeout` it raises
        (``answered_before``)."""

    @property
    def authenticated(self) -> bool:
        """Whether this client proves a shared secret and has the producer prove it."""
        return self._secret is not None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self, timeout_s: float) -> tuple[socket.socket, float]:
        """A new connection, opened; and the deadline of the call it is for.
        The name lookup and the connects share ``connect_timeout_s``; the
        opening, then the call's request and reply, share ``timeout_s``
        from then: one attempt takes at most the two together
        (``urgent_worst_case_s`` counts on it)."""
        connect_by = time.monotonic() + self._connect_timeout_s
        addresses = resolve(self.host, self.port, self._connect_timeout_s)
        for k, address in enumerate(addresses):  # in the resolver's order, as create_connection does
            left = connect_by - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"connect to {self.host}:{self.port} timed out after {k} of "
                                   f"{len(addresses)} addresses (connect_timeout_s={self._connect_timeout_s:g})")
            try:
                sock = socket.create_connection(address, timeout=left, source_address=self._source)
                break
            except OSError:
                if k == len(addresses) - 1:
                    raise
        deadline = time.monotonic() + timeout_s
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._open(sock, deadline)
        except BaseException:
            sock.close()
            raise
        return sock, deadline

    def _exchange(self, sock: socket.socket, message: msgspec.Struct, deadline: float) -> wire.Reply:
        framing.send_frame(sock, wire.encode(message), deadline=deadline)
        body = framing.recv_frame(sock, wire.MAX_REPLY_BYTES, f"reply from {self.address}", deadline=deadline)
        if body is None:
            raise PeerError(f"{self.address} closed the side channel")
        return wire.decode_reply(body)

    def _open(self, sock: socket.socket, deadline: float) -> None:
        """HELLO -> CHALLENGE (-> AUTH -> AUTH_OK). Raises ``HandshakeError``
        (not retried) when the peer speaks another version, and
        ``AuthenticationError`` when the two sides' secrets disagree."""
        nonce = auth.new_nonce()
        reply = self._exchange(sock, wire.Hello(wire.PROTOCOL_VERSION, self._role, nonce), deadline)
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
            self._send_quietly(sock, wire.Auth(wire.PROTOCOL_VERSION, b""), deadline)  # its log says why
            raise AuthenticationError(
                f"producer at {self.address} requires a shared secret and this consumer has none; "
                "set kv_connector_extra_config auth_secret_file or auth_secret_env")
        proof = auth.client_proof(self._secret, reply.nonce, nonce, wire.PROTOCOL_VERSION, self._role)
        answer = self._exchange(sock, wire.Auth(wire.PROTOCOL_VERSION, proof), deadline)
        if isinstance(answer, wire.Refused):
            raise AuthenticationError(f"producer at {self.address} refused this consumer: {answer.reason}")
        expected = auth.server_proof(self._secret, nonce, reply.nonce, wire.PROTOCOL_VERSION, self._role)
        if not isinstance(answer, wire.AuthOk) or not auth.verify(expected, answer.proof):
            raise AuthenticationError(
                f"producer at {self.address} failed to prove it knows the shared secret (its secret "
                "differs, or it is not the producer it claims to be)")

    @staticmethod
    def _send_quietly(sock: socket.socket, message: msgspec.Struct, deadline: float) -> None:
        try:
            framing.send_frame(sock, wire.encode(message), deadline=deadline)
        except OSError:
            pass

    @staticmethod
    def call_worst_case_s(connect_timeout_s: float, rpc_timeout_s: float, retries: int,
                          backoff_s: float = BACKOFF_S) -> float:
        """The longest a call can take once it holds its connection, against
        a producer that stalls rather than refuses: every attempt's
        ``connect_timeout_s`` and ``rpc_timeout_s`` (its two bounds,
        ``_connect``), and the backoffs between them."""
        attempts = retries + 1
        slow = attempts * (connect_timeout_s + rpc_timeout_s) + sum(_pause(backoff_s, k) for k in range(retries))
        # Attempts that find the network down go on until connect_timeout_s,
        # then one more may start (after a pause) and be slow:
        window = connect_timeout_s + MAX_BACKOFF_S + connect_timeout_s + rpc_timeout_s if retries else 0.0
        return max(slow, window)

    @staticmethod
    def urgent_worst_case_s(connect_timeout_s: float, rpc_timeout_s: float, retries: int,
                            backoff_s: float = BACKOFF_S) -> float:
        """The longest an ``urgent`` call (a RENEW) can take against a
        producer that stalls rather than refuses: the waits for the two
        connections (``URGENT_WAIT_S`` each), then ``call_worst_case_s``."""
        return 2 * URGENT_WAIT_S + SideChannelClient.call_worst_case_s(connect_timeout_s, rpc_timeout_s, retries,
                                                                       backoff_s)

    def call(self, request: wire.Request, timeout_s: float | None = None, *, urgent: bool = False) -> wire.Reply:
        """Send ``request``, return the decoded reply. Transport failures are
        retried ``retries`` times; then :class:`PeerError`. An ``ErrorReply``
        raises :class:`MetadataError`; ``Refused`` is returned (the caller
        names what was refused). A call waits for the connection at most one
        call's worst case (``call_worst_case_s``), then :class:`PeerError`.
        ``urgent``: do not wait behind a call in
        flight for more than ``URGENT_WAIT_S``; take the second connection
        (module docstring); if another urgent call holds that one too, wait
        for it as long, then :class:`PeerError` (two calls stuck at once: the
        producer stalls; the next renewal tries again)."""
        guard = _guard(self.host, self.port)
        if guard is not None and guard.refusal:
            raise PeerError(f"side channel {self.address}: not called: {guard.refusal}")
        timeout = self._rpc_timeout_s if timeout_s is None else timeout_s
        conn = self._first
        # Whoever holds the first connection is done within one call's worst case (the
        # longest-timed call is a handshake).
        wait = URGENT_WAIT_S if urgent else self.call_worst_case_s(
            self._connect_timeout_s, max(timeout, self._rpc_timeout_s, HANDSHAKE_TIMEOUT_S), self._retries,
            self._backoff_s)
        if not conn.lock.acquire(timeout=wait):
            if not urgent:
                raise PeerError(f"side channel {self.address}: the connection stayed busy for {wait:.3g} s "
                                "(is the producer stalled?)")
            conn = self._spare
            if not conn.lock.acquire(timeout=URGENT_WAIT_S):
                raise PeerError(f"side channel {self.address}: both connections stayed busy for "
                                f"{URGENT_WAIT_S:g} s each (is the producer stalled?)")
        try:
            return self._call(conn, request, timeout)
        finally:
            conn.lock.release()

    def _call(self, conn: _Connection, request: wire.Request, timeout: float) -> wire.Reply:
        """``call`` on ``conn``, its lock held."""
        payload = wire.encode(request)
        last: Exception | None = None
        start = time.monotonic()
        attempts = 0
        answered_before = self.answering  # (this call's first failure clears it)
        while True:
            if self._closed:
                raise PeerError(f"side channel client for {self.address} is closed")
            if time.monotonic() < self._down_until:
                raise self._error(self._down_error, f"side channel {self.address} is down: {self._down_reason}")
            fresh = conn.sock is None  # (a kept connection may have been closed by the producer meanwhile)
            try:
                if conn.sock is None:
                    conn.sock, deadline = self._connect(timeout)
                else:
                    deadline = time.monotonic() + timeout
                framing.send_frame(conn.sock, payload, deadline=deadline)
                body = framing.recv_frame(conn.sock, wire.MAX_REPLY_BYTES, f"reply from {self.address}", deadline=deadline)
                if body is None:
                    raise PeerError(f"{self.address} closed the side channel")
                reply = wire.decode_reply(body)
            except HandshakeError as exc:  # refused at the opening: retrying cannot help
                conn.drop()
                self._down_until = time.monotonic() + self.down_s
                self._down_reason, self._down_error = str(exc), type(exc)
                raise
            except (OSError, TimeoutError, PeerError) as exc:
                last = exc
                conn.drop()
                attempts += 1
                if (fresh or isinstance(exc, TimeoutError)) and not _link_down(exc):  # failed at the peer
                    answered, self.answering = self.answering, False  # (the pool caps the calls to it now)
                    if isinstance(exc, TimeoutError) and not answered_before and attempts > 1:
                        break  # never answered: one retry (a first answer slow once), not a stranger's slot for long
                    guard = _guard(self.host, self.port)
                    why = guard.stopped_answering() if answered and guard and guard.stopped_answering else ""
                    if why:
                        self._down_until = time.monotonic() + self.down_s
                        self._down_reason = f"stopped answering ({exc}); not tried again: {why}"
                        self._down_error = _failure_kind(exc)
                        raise self._error(self._down_error, f"side channel {self.address} {self._down_reason}")
                if not self._retries or (attempts > self._retries and not (
                        _link_down(exc) and time.monotonic() - start < self._connect_timeout_s)):
                    break
                time.sleep(_pause(self._backoff_s, attempts - 1))
                continue
            except MetadataError as exc:
                conn.drop()
                raise MetadataError(f"malformed reply from {self.address}: {exc}") from None
            self.answering = self.has_answered = True
            if isinstance(reply, wire.ErrorReply):
                conn.drop()
                raise MetadataError(f"{self.address} rejected {type(request).__name__}: {reply.message}")
            return reply
        self._down_until = time.monotonic() + self.down_s
        self._down_reason = f"unreachable after {attempts} attempts in {time.monotonic() - start:.2g} s: {last}"
        self._down_error = _failure_kind(last)
        raise self._error(self._down_error, f"side channel {self.address} {self._down_reason}")

    def _error(self, kind: type[PeerError], message: str) -> PeerError:
        """A failed call's ``kind`` of error; a :class:`PeerTimeout` says
        whether the peer answered this client before (``has_answered``)."""
        if issubclass(kind, PeerTimeout):
            return kind(message, answered_before=self.has_answered)
        return kind(message)

    def handshake(self, request: wire.Handshake) -> wire.HandshakeReply:
        reply = self.call(request, timeout_s=max(self._rpc_timeout_s, HANDSHAKE_TIMEOUT_S))
        if isinstance(reply, wire.Refused):
            raise HandshakeError(f"producer at {self.address} refused the handshake: {reply.reason}")
        if not isinstance(reply, wire.HandshakeReply):
            raise HandshakeError(f"{self.address} answered a handshake with {type(reply).__name__}")
        return reply

    def lease_call(self, request: wire.Renew | wire.Confirm | wire.Release, *, urgent: bool = False) -> wire.LeaseReply:
        reply = self.call(request, urgent=urgent)
        if isinstance(reply, wire.Refused):
            raise HandshakeError(f"producer at {self.address} refused {type(request).__name__}: {reply.reason}")
        if not isinstance(reply, wire.LeaseReply) or len(reply.statuses) != len(request.leases):
            raise MetadataError(
                f"{self.address} answered {type(request).__name__} of {len(request.leases)} leases "
                f"with {reply!r:.200}"
            )
        return reply

    def close(self) -> None:
        self._closed = True  # a call in flight on either connection stops at its next attempt
        for conn in (self._first, self._spare):
            with conn.lock:
                conn.drop()
